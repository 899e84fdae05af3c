"""``partition``: head-partitioned history (CoWindow-style): each head reads a fixed slice of
the past.

Axes: ``batch, head, kv_head, row, block``. The grid's blocks (``d`` tokens at fixed
boundaries, offset ``o``) are dealt round-robin to the query heads, from the sequence's first
block: head ``h`` of ``H`` owns block ``i`` when ``(i - i_0) mod H == h``, ``i_0`` the first
block holding a real token. A query of head ``h`` attends, in one softmax, the raw
tokens of every block it owns that the coverage rule would read compressed, its raw window,
and the block it closes (forced, as every selecting design), through the selecting designs'
engine (:mod:`phasemech.attention.selection`). Nothing is pooled: every past token is read raw
by exactly one head of the layer (beyond the window), so a head's KV budget is about
``T / H + W``. The phase question moves from the place of a token in a chunk to the place of a
token in its head's slice, and to which head owns it (period ``H d``); per-layer and per-head
offsets move the slice boundaries as they move any grid. No parameters; no top-k (the rule
keeps every owned block).
"""

from __future__ import annotations

import torch

from phasemech.attention.selection import SelectingAttention


class PartitionAttention(SelectingAttention):
    design = "partition"
    ranks_reachable = False  # its budget is a share of all the blocks

    def n_keep(self, n_blocks: int) -> int:
        return -(-n_blocks // self.cfg.n_heads)  # the most blocks one head can own

    def block_scores(self, summary, q, rows, k, geo):
        """0 on the blocks a head owns, ``-inf`` elsewhere: ``[batch, head, row, block]``.
        Blocks are dealt from each sequence's first block with a real token, so left padding
        (which the grid offset absorbs) never changes who owns what."""
        h, seq = self.cfg.n_heads, k.shape[1]
        n = geo.block_used.shape[-1]
        first = (geo.block_first < seq).int().argmax(-1, keepdim=True)  # [batch, kv_head, 1]
        owner = torch.remainder(torch.arange(n, device=q.device) - first, h)  # [b, g, block]
        owned = self._repeat_kv(owner, 1) == torch.arange(h, device=q.device)[:, None]
        gate = torch.zeros(q.shape[0], h, rows.shape[1], n, dtype=q.dtype, device=q.device)
        return gate.masked_fill(~owned[:, :, None, :], float("-inf"))
