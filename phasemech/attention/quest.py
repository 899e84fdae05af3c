"""``quest``: query-aware block selection by element-wise key bounds (Quest, 2024).

Axes: ``batch, head, kv_head, pos, row, block, d_head``. Each block keeps the element-wise
minimum ``m_b`` and maximum ``M_b`` of its real tokens' post-RoPE keys; the block's score for
query ``q`` is the upper bound of ``q . k`` over any key inside that box,
``sum_i max(q_i m_b,i, q_i M_b,i) = relu(q) . M_b + min(q, 0) . m_b`` (two matrix products, not
an element-wise pass over ``[row, block, d_head]``). The ``top_k`` best candidate blocks are
kept and attended raw with the raw window, as every selecting design does
(:mod:`phasemech.attention.selection`). No parameters: applied post hoc to any model.
Selection has no gradient.
"""

from __future__ import annotations

import torch

from phasemech.attention.rows import query_rows
from phasemech.attention.selection import SelectingAttention, grouped_scores


class QuestAttention(SelectingAttention):
    design = "quest"
    summary_block_dim = 2  # [batch, kv_head, block, d_head]

    def block_summary(self, x, k, v, geo):
        """``(min, max)`` of each block's real keys, ``[batch, kv_head, block, d_head]`` each
        (zeros for a block without a real token: it is never a candidate)."""
        slots = self._gather_slots(k, geo)  # [batch, kv_head, block, slot, d]
        valid = geo.slot_valid[..., None]
        big = torch.finfo(k.dtype).max
        low = slots.masked_fill(~valid, big).amin(3)
        high = slots.masked_fill(~valid, -big).amax(3)
        has = geo.slot_valid.any(-1)[..., None]
        return low.where(has, 0.0), high.where(has, 0.0)

    def block_scores(self, summary, q, rows, k, geo):
        low, high = summary
        q_rows = query_rows(q, rows)  # [batch, head, row, d]
        pos_part = q_rows.clamp(min=0)
        return grouped_scores(pos_part, high) + grouped_scores(q_rows - pos_part, low)
