"""``evict``: chunk eviction by observation-window attention (ChunkKV, 2025).

Axes: ``batch, head, kv_head, pos, key_pos, block``. The KV cache is kept in chunks (the grid's
blocks). For query ``t`` and KV head ``g``, each candidate block (exactly ``route``'s: the pooled
designs' used blocks outside the raw window, see ``phasemech.core.grid``) is scored by the attention
that the observation queries ``u in [max(0, t - obs_window + 1), t]`` of all query heads of KV
group ``g`` pay to its tokens, where each ``u`` attends as ordinary dense causal attention over
raw post-RoPE keys ``j <= u`` (the attention before any eviction; padding keys hidden). Only
queries and keys ``<= t`` enter, so the score is causal; a query ``u`` that ``attention_mask``
hides observes nothing (its query vector would carry the masked token into the ranking). The
``top_k`` best blocks are kept for the whole KV group (eviction acts on a KV head's cache), plus
what ``route`` forces (the current block when the query closes it); the query attends, in one
softmax over raw tokens, the tokens of kept blocks plus its raw window, exactly as ``route``
does. The rest is evicted. No parameters (applied post hoc with ``PhaseTransformer.from_hooked``);
selection has no gradient.

Everything but the ranking is ``route``'s code path (``BlockRouteAttention``), so the hooks are
``route``'s: ``hook_route_scores`` ``[batch, head, pos, block]`` holds the eviction scores
(identical across the heads of one KV group, ``-inf`` off the ranked candidates),
``hook_route_selected`` the kept blocks, ``hook_attn_scores``/``hook_pattern`` and
``hook_token_pattern`` (identical to the pattern, exact) are ``[batch, head, pos, key_pos]``.
``hook_block_weights`` and ``hook_k_block`` do not run: eviction uses no block keys. Like
``route`` this reference implementation materialises ``[pos, key_pos]`` scores (twice: the
observation attention and the final one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasemech.attention.route import BlockRouteAttention


class ChunkEvictAttention(BlockRouteAttention):
    design = "evict"

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        self.obs_window: int = self.cfg.compression.obs_window

    def _members(self, geo, seq: int, dtype: torch.dtype) -> torch.Tensor:
        """``[batch, head, block, key_pos]``: 1 where token ``key_pos`` lies in the block."""
        member = self._blocks_to_tokens(geo.slot_valid.to(dtype), geo, seq) > 0
        return self._repeat_kv(member.to(dtype), 1)

    def _group_sum(self, mass: torch.Tensor) -> torch.Tensor:
        """Sum ``[batch, head, ...]`` over the query heads of each KV group and give every head
        its group's total (heads ``g*rep .. g*rep + rep - 1`` share KV head ``g``)."""
        b, h = mass.shape[:2]
        g = self.n_kv_heads
        total = mass.reshape(b, g, h // g, *mass.shape[2:]).sum(2)
        return self._repeat_kv(total, 1)

    def gate_scores(self, x, q, k, v, geo):
        """Eviction score ``[batch, head, pos, block]`` of every block for every query."""
        with torch.no_grad():
            seq = q.shape[1]
            qh = q.detach().transpose(1, 2)  # [batch, head, pos, d]
            kh = self._repeat_kv(k.detach().transpose(1, 2), 1)
            t = torch.arange(seq, device=q.device)
            visible = (t[None, :] <= t[:, None])[None, None]  # [1, 1, pos(u), key_pos]
            if geo.key_valid is not None:
                visible = visible & geo.key_valid[:, None, None, :]
            visible = visible.expand(qh.shape[0], qh.shape[1], seq, seq)
            dense = self._row_pattern(qh @ kh.transpose(-1, -2), visible)  # [b, h, u, key]
            member = self._members(geo, seq, dense.dtype)  # [batch, head, block, key_pos]
            mass = self._group_sum(dense @ member.transpose(-1, -2))  # [b, h, u, block]
            if geo.key_valid is not None:
                # a masked position is no observation query: its q would leak its token
                mass = mass * geo.key_valid[:, None, :, None].to(mass.dtype)
            # observation window: sum over u in [t - obs_window + 1, t] (zeros before 0)
            w = self.obs_window
            padded = F.pad(mass, (0, 0, w - 1, 0))
            return padded.unfold(2, w, 1).sum(-1)  # [batch, head, pos, block]

    def gate_scores_rows(self, x, q, k, v, geo, rows):
        """``gate_scores`` at one query row per sequence: ``[batch, head, block]``."""
        with torch.no_grad():
            b, seq = q.shape[:2]
            ar = torch.arange(b, device=q.device)
            u = rows[:, None] - torch.arange(self.obs_window, device=q.device)  # [batch, obs]
            q_u = q.detach()[ar[:, None], u.clamp(min=0)]  # [batch, obs, head, d]
            scores = torch.einsum("bohd,bkhd->bhok", q_u, self._repeat_kv(k.detach(), 2))
            keys = torch.arange(seq, device=q.device)
            visible = (keys[None, None, :] <= u[:, :, None]) & (u[:, :, None] >= 0)
            if geo.key_valid is not None:
                visible = visible & geo.key_valid[:, None, :]
            visible = visible[:, None].expand(-1, scores.shape[1], -1, -1)  # [b, h, obs, key]
            dense = self._row_pattern(scores, visible)
            member = self._members(geo, seq, dense.dtype)  # [batch, head, block, key_pos]
            mass = torch.einsum("bhok,bhnk->bhn", dense, member)
            return self._group_sum(mass)
