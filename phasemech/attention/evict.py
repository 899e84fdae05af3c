"""``evict``: chunk eviction by observation-window attention (ChunkKV, 2025).

Axes: ``batch, head, kv_head, pos, row, u`` (an observation query), ``key_pos, block``. The KV
cache is kept in chunks (the grid's blocks). For query ``t`` and KV head ``g``, each candidate
block (exactly ``route``'s) is scored by the attention that the observation queries
``u in [max(0, t - obs_window + 1), t]`` of all query heads of KV group ``g`` pay to its tokens,
where each ``u`` attends as ordinary dense causal attention over raw post-RoPE keys ``j <= u``
(the attention before any eviction; padding keys hidden). Only queries and keys ``<= t`` enter,
so the score is causal; a query ``u`` that ``attention_mask`` hides observes nothing (its query
vector would carry the masked token into the ranking). The ``top_k`` best blocks are kept for
the whole KV group (eviction acts on a KV head's cache), plus the forced block; the query
attends the tokens of kept blocks and its raw window in one softmax, as every selecting design
does (:mod:`phasemech.attention.selection`). The rest is evicted. No parameters (applied post
hoc); selection has no gradient.

The observation attention touches every key (``O(T^2)`` products: the rule's nature), computed
in row chunks that are reduced to ``[u, block]`` at once, so memory stays ``O(chunk x T)``.
Consecutive rows (a forward, a decode chunk) share their observation queries; scattered rows
(one per sequence) score their own. ``hook_route_scores`` holds the eviction scores (identical
across the heads of one KV group); ``hook_block_weights`` and ``hook_k_block`` do not run.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from phasemech.attention.rows import query_rows
from phasemech.attention.selection import (
    ROW_CHUNK,
    SelectingAttention,
    grouped_scores,
    sub_geometry,
)
from phasemech.core.grid import Geometry


class ChunkEvictAttention(SelectingAttention):
    design = "evict"

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        self.obs_window: int = self.cfg.compression.obs_window
        self.cached_queries = self.obs_window  # a decode step observes recent prefill queries

    def row_chunk(self, seq: int) -> int:
        return max(16, min(ROW_CHUNK, (ROW_CHUNK * 1024) // max(seq, 1)))

    def block_scores(self, summary, q, rows, k, geo):
        w = self.obs_window
        b, n = rows.shape
        consecutive = bool((rows == rows[:, :1] + torch.arange(n, device=rows.device)).all())
        if consecutive:  # u in [first - w + 1, last]: each shared by up to w rows
            u = rows[:, :1] - w + 1 + torch.arange(n + w - 1, device=rows.device)
            mass = self._observed(q, u, k, geo)  # [batch, head, n + w - 1, block]
            return mass.unfold(2, w, 1).sum(-1)  # [batch, head, n, block]
        u = (rows[..., None] - torch.arange(w, device=rows.device)).reshape(b, n * w)
        mass = self._observed(q, u, k, geo)
        return mass.reshape(*mass.shape[:2], n, w, -1).sum(3)

    def _observed(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        u: Int[Tensor, "batch u"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> Float[Tensor, "batch head u block"]:
        """Attention mass that observation query ``u`` (all heads of its KV group) pays to each
        block, under dense causal attention; zero for ``u < 0`` and masked ``u``. Over copies
        of one prefill (``shared_prefix``) an observation query inside it sees only the
        prefill, so its mass is computed for one copy."""
        prefix, b = self.shared_prefix, q.shape[0]
        if not prefix or b == 1 or not geo.shared or geo.key_valid is not None:
            return self._observed_dense(q, u, k, geo)
        inside = u[0] < prefix
        if not bool(inside.any()) or not bool((u == u[:1]).all()):
            return self._observed_dense(q, u, k, geo)
        one = self._observed_dense(q[:1], u[:1, inside], k[:1], sub_geometry(geo, 1, slice(None)))
        rest = self._observed_dense(q, u[:, ~inside], k, geo)
        out = rest.new_empty(*rest.shape[:2], u.shape[1], rest.shape[-1])
        out[:, :, inside] = one
        out[:, :, ~inside] = rest
        return out

    def _observed_dense(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        u: Int[Tensor, "batch u"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> Float[Tensor, "batch head u block"]:
        seq = k.shape[1]
        lacking = (u >= 0) & (u < self.known_queries_from)
        if bool(lacking.any()):
            raise ValueError(
                f"layer {self.layer_id} (evict): observation query {int(u[lacking].min())} "
                "is in the prefill but the KV cache kept no query for it; prefill with "
                "phasemech.model.decode.prefill (it keeps the last obs_window queries)"
            )
        keys = torch.arange(seq, device=u.device)
        visible = keys[None, None, :] <= u[..., None]  # [batch, u, key_pos]
        if geo.key_valid is not None:
            visible = visible & geo.key_valid[:, None, :]
        dense = grouped_scores(query_rows(q, u), k.transpose(1, 2))
        dense = self._row_pattern(dense, visible[:, None].expand_as(dense))
        b, h = dense.shape[:2]
        mass = self._at_slots(dense, geo, 0.0).sum(-1)
        real = u >= 0
        if geo.key_valid is not None:  # a masked position is no observation query
            real = real & geo.key_valid.gather(1, u.clamp(min=0))
        mass = mass * real[:, None, :, None]
        g = self.n_kv_heads  # every head of a KV group gets the group's total
        return self._repeat_kv(mass.reshape(b, g, h // g, *mass.shape[2:]).sum(2), 1)
