"""``route``: block routing over raw tokens (MoBA).

Axes: ``batch, head, pos, key_pos, block``. Each candidate block (same candidates as the pooled
designs' used blocks, see ``phasemech.core.grid``) is scored per query head by the parameter-free
MoBA gate ``q_t . mean_j(k_j)`` (post-RoPE keys); the query attends, in one softmax over raw
tokens, the tokens of its ``top_k`` best blocks plus its current block (the raw window / tail,
or, when the query closes its block, that whole block, forced as in MoBA). Nothing is
compressed: phase acts only through whether the needle's block is selected, and tokens of
unselected blocks are dropped on purpose. Selection has no gradient (as in MoBA).

This reference implementation materialises ``[pos, key_pos]`` scores: exact and simple, not
memory-saving (real MoBA needs a kernel). ``hook_attn_scores``/``hook_pattern`` and
``hook_token_pattern`` (identical to the pattern, exact) are ``[batch, head, pos, key_pos]``;
``hook_k_block`` holds the block means used for routing; ``hook_route_scores``
``[batch, head, pos, block]`` the gate (``-inf`` off the ranked candidates: the forced current
block is not ranked); ``hook_route_selected`` the selection (top-k plus the forced block).
``block_scope="all"`` is refused: it would spend top-k picks on blocks already read raw.
"""

from __future__ import annotations

import torch
from transformer_lens.hook_points import HookPoint

from phasemech.attention.base import CompressedAttentionMixin
from phasemech.attention.mean import mean_weights


class BlockRouteAttention(CompressedAttentionMixin):
    design = "route"

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        self.top_k: int = self.cfg.compression.top_k
        self.hook_route_scores = HookPoint()  # [batch, head, pos, block]
        self.hook_route_selected = HookPoint()  # [batch, head, pos, block] (bool)

    def pooling_weights(self, x, geo):
        return mean_weights(geo)  # MoBA's block key is the mean key

    def gate_scores(self, x, q, k, v, geo):
        """Gate of every block for every query ``[batch, head, pos, block]`` (no gradient),
        before candidates are masked: MoBA's ``q_t . mean_j(k_j)``. Runs ``hook_block_weights``
        and ``hook_k_block``. Subclasses (``evict``) override it to rank blocks otherwise."""
        weights = self.hook_block_weights(self.pooling_weights(x, geo).to(k.dtype))
        ks = self._gather_slots(k, geo)
        k_blk = torch.einsum("bgns,bgnsd->bgnd", weights, ks)
        k_blk = self.hook_k_block(k_blk.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        qh = q.transpose(1, 2)  # [batch, head, pos, d]
        return (qh @ self._repeat_kv(k_blk, 1).transpose(-1, -2)).detach()

    def gate_scores_rows(self, x, q, k, v, geo, rows):
        """``gate_scores`` at one query row per sequence: ``[batch, head, block]``, no hooks."""
        ar = torch.arange(q.shape[0], device=q.device)
        weights = self.pooling_weights(x, geo).to(k.dtype)
        k_blk = torch.einsum("bgns,bgnsd->bgnd", weights, self._gather_slots(k, geo))
        q_t = q[ar, rows]  # [batch, head, d]
        return torch.einsum("bhd,bhnd->bhn", q_t, self._repeat_kv(k_blk, 1))

    def attend(self, x, q, k, v, geo):
        seq = q.shape[1]
        gate = self.gate_scores(x, q, k, v, geo)  # [batch, head, pos, block]
        qh = q.transpose(1, 2)  # [batch, head, pos, d]
        candidate = self._repeat_kv(geo.block_used, 1)  # [batch, head, pos, block]
        # MoBA always keeps the current block: the one ending at the query itself (inclusive
        # visibility, last slot, nothing left raw) is forced, not ranked.
        t = torch.arange(seq, device=q.device)
        own = self._repeat_kv(geo.block_last[:, :, None, :] == t[None, None, :, None], 1)
        forced = candidate & own
        gate = self.hook_route_scores(gate.masked_fill(~(candidate & ~forced), float("-inf")))
        n_pick = min(self.top_k, gate.shape[-1])
        top = gate.topk(n_pick, dim=-1).indices
        ranked = torch.zeros_like(candidate).scatter(-1, top, True) & candidate & ~forced
        selected = self.hook_route_selected(ranked | forced)
        # token j is reachable if it is in the raw window or in a selected block
        member = self._blocks_to_tokens(geo.slot_valid.float(), geo, seq) > 0  # [b, g, n, key]
        via_block = (selected.float() @ self._repeat_kv(member.float(), 1)) > 0
        # the raw window is the pooled designs' band (raw start, causality, padding) on key_pos
        raw = self._unband(geo.band_valid.float()) > 0  # [batch, kv_head, pos, key_pos]
        visible = self._repeat_kv(raw, 1) | via_block
        kh = self._repeat_kv(k.transpose(1, 2), 1)
        vh = self._repeat_kv(v.transpose(1, 2), 1)
        pattern = self._pattern(qh @ kh.transpose(-1, -2), visible)
        z = pattern @ vh
        token_pattern = pattern if self._token_pattern_wanted() else None
        return z.transpose(1, 2), token_pattern

    def attend_rows(self, x, q, k, v, geo, rows):
        """``attend`` at one query row per sequence: same candidates, gate, top-k and raw
        window as the full forward, scores against every key for that row only."""
        ar = torch.arange(q.shape[0], device=q.device)
        seq = q.shape[1]
        q_t = q[ar, rows]  # [batch, head, d]
        candidate = self._repeat_kv(geo.block_used[ar, :, rows], 1)  # [batch, head, block]
        own = self._repeat_kv(geo.block_last == rows[:, None, None], 1)
        forced = candidate & own
        gate = self.gate_scores_rows(x, q, k, v, geo, rows)
        gate = gate.masked_fill(~(candidate & ~forced), float("-inf"))
        top = gate.topk(min(self.top_k, gate.shape[-1]), dim=-1).indices
        ranked = torch.zeros_like(candidate).scatter(-1, top, True) & candidate & ~forced
        selected = ranked | forced
        member = self._blocks_to_tokens(geo.slot_valid.float(), geo, seq) > 0  # [b, g, n, key]
        via_block = (
            torch.einsum("bhn,bhnk->bhk", selected.float(), self._repeat_kv(member.float(), 1)) > 0
        )
        band_pos = rows[:, None] - geo.band + 1 + torch.arange(geo.band, device=q.device)
        raw = torch.zeros(
            q.shape[0], geo.band_valid.shape[1], seq + 1, dtype=torch.bool, device=q.device
        )
        # scatter the row's valid band slots onto key positions (invalid ones to a spare column)
        cols = torch.where(geo.band_valid[ar, :, rows], band_pos[:, None, :].clamp(min=0), seq)
        raw = raw.scatter(-1, cols, True)[..., :seq]
        visible = self._repeat_kv(raw, 1) | via_block
        scores = torch.einsum("bhd,bkhd->bhk", q_t, self._repeat_kv(k, 2))
        pattern = self._row_pattern(scores, visible)
        return torch.einsum("bhk,bkhd->bhd", pattern, self._repeat_kv(v, 2))
