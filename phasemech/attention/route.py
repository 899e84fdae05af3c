"""``route``: block routing over raw tokens (MoBA).

Axes: ``batch, head, kv_head, pos, row, block``. Each candidate block is scored per query head by
the parameter-free MoBA gate ``q_t . mean_j(k_j)`` over the block's post-RoPE keys; the query
attends, in one softmax over raw tokens, the tokens of its ``top_k`` best blocks plus its raw
window (and the block it closes, forced as in MoBA). Phase acts only through whether the
needle's block is selected. Selection has no gradient (as in MoBA). The candidates, the forced
block, the gathering of kept tokens and the hooks are the selecting designs' shared engine
(:mod:`phasemech.attention.selection`); this file is the rule. ``hook_block_weights`` (uniform
weights) and ``hook_k_block`` (the block means) run once per forward.
``block_scope="all"`` is refused: it would spend top-k picks on blocks already read raw.
"""

from __future__ import annotations

import torch

from phasemech.attention.mean import mean_weights
from phasemech.attention.selection import SelectingAttention


class BlockRouteAttention(SelectingAttention):
    design = "route"
    summary_block_dim = 2  # [batch, kv_head, block, d_head]

    def pooling_weights(self, x, geo):
        return mean_weights(geo)  # MoBA's block key is the mean key

    def block_summary(self, x, k, v, geo):
        """The block means ``[batch, kv_head, block, d_head]`` (through the block hooks)."""
        weights = self.hook_block_weights(self.pooling_weights(x, geo).to(k.dtype))
        k_blk = torch.einsum("bgns,bgnsd->bgnd", weights, self._gather_slots(k, geo))
        return self.hook_k_block(k_blk.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)

    def block_scores(self, summary, q, rows, k, geo):
        return self._block_key_scores(summary, q, rows)
