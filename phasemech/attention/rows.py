"""Computing a compressed layer at chosen query rows: the rows path and the decode regime.

Axes: ``batch, head, kv_head, pos`` (every position), ``row`` (the query rows computed),
``new`` (rows after a KV cache's prefill), ``block``, ``w`` (raw band slot), ``d_head``.

:class:`RowsMixin` is part of every compressed layer (``CompressedAttentionMixin`` derives from
it): ``forward_rows`` / ``attend_rows`` give one row per sequence (what patching needs after the
last layer), ``attend_many`` any rows (pooled designs here; the selecting designs' engine has
its own), and ``_forward_cached`` is the decode regime, a layer reading a TransformerLens KV
cache and computing only the new rows (:mod:`phasemech.model.decode`).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.core.designs import CACHE_DESIGNS, traits
from phasemech.core.grid import Geometry


def masked_softmax(
    scores: Float[Tensor, "... key"], visible: Bool[Tensor, "... key"], neg_inf_masked: bool = False
) -> Float[Tensor, "... key"]:
    """Softmax over visible entries; rows with nothing visible give zeros (and finite grads).

    ``neg_inf_masked``: the caller guarantees every hidden entry already holds ``-inf``; then,
    unless a row is entirely hidden, a plain softmax is exact and saves two passes.
    """
    if neg_inf_masked and bool(visible.any(-1).all()):
        return torch.softmax(scores, dim=-1)
    filled = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    return torch.softmax(filled, dim=-1) * visible


def gather_heads(
    x: Float[Tensor, "batch pos kv_head d"], pos: Int[Tensor, "batch head row m"]
) -> Float[Tensor, "batch head row m d"]:
    """``x`` at positions ``pos`` for every query head (head ``i`` reads KV head ``i // rep``),
    without repeating ``x`` per query head."""
    b, seq, g, dd = x.shape
    h, rest = pos.shape[1], pos.shape[2:]
    # whole rows of a flat [batch * pos * kv_head, d] table (a row copy per index, several
    # times faster than an element-wise gather with a broadcast index)
    base = torch.arange(b, device=pos.device)[:, None] * (seq * g)
    head = torch.arange(g, device=pos.device)[None, :]
    rows = base[..., None] + pos.clamp(0, seq - 1).reshape(b, g, -1) * g + head[..., None]
    return x.reshape(b * seq * g, dd).index_select(0, rows.flatten()).reshape(b, h, *rest, dd)


def at_rows(t: Tensor, rows: Int[Tensor, "batch row"]) -> Tensor:
    """``t [batch, kv_head, pos, ...]`` at each sequence's rows: ``[batch, kv_head, row, ...]``."""
    ar = torch.arange(t.shape[0], device=t.device)[:, None]
    return t.transpose(1, 2)[ar, rows].transpose(1, 2)


def query_rows(
    q: Float[Tensor, "batch pos head d"], rows: Int[Tensor, "batch row"]
) -> Float[Tensor, "batch head row d"]:
    """Each sequence's queries at its rows, head-major."""
    ar = torch.arange(q.shape[0], device=q.device)[:, None]
    return q[ar, rows.clamp(min=0)].transpose(1, 2)


def band_positions(rows: Int[Tensor, "batch row"], band: int, n_heads: int) -> Tensor:
    """``[batch, head, row, w]``: key position of raw band slot ``w`` of each row."""
    pos = rows[:, None, :, None] - band + 1 + torch.arange(band, device=rows.device)
    return pos.expand(-1, n_heads, -1, -1)


def _one_copy(t: Tensor) -> bool:
    """Whether every sequence of ``t``'s batch is one tensor (an expanded view, or one)."""
    return t.shape[0] == 1 or t.stride(0) == 0


class RowsMixin:
    """The rows path and the decode regime of a compressed layer (see the module docstring)."""

    # ------------------------------------------------------------------ one query row
    def forward_rows(
        self, x: Float[Tensor, "batch pos d_model"], rows: Int[Tensor, "batch"]
    ) -> Float[Tensor, "batch d_model"]:
        """This layer's output at ONE query position per sequence (``rows``), as ``forward``
        computes it there, without the other queries' scores (what patching needs after the
        last layer). ``x`` is the normalised layer input; no padding mask; hooks on scores and
        patterns do not run (callers use it only where none are attached)."""
        q, k, v = self.calculate_qkv_matrices(x, x, x)
        if self.cfg.positional_embedding_type == "rotary":
            q, k = self.apply_rotary(q, 0, None), self.apply_rotary(k, 0, None)
        geo = self._geometry(self.grid_offsets(q.shape[0], q.device), q.shape[1], None)
        z = self.attend_rows(x, q, k, v, geo, rows)  # [batch, head, d_head]
        return self._output(z[:, None])[:, 0]

    def _row_pattern(
        self, scores: Float[Tensor, "batch head key"], visible: Bool[Tensor, "batch head key"]
    ) -> Float[Tensor, "batch head key"]:
        """``_pattern``'s arithmetic on query rows (no hooks). ``scores`` must be a fresh
        tensor: it is scaled and masked in place (the largest tensor of a decode step)."""
        scores = apply_softcap(scores.div_(self.attn_scale), self.cfg.attn_scores_soft_cap)
        scores = scores.masked_fill_(~visible, float("-inf"))
        return masked_softmax(scores, visible, neg_inf_masked=True)

    def attend_rows(
        self,
        x: Tensor | None,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        v: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
        rows: Int[Tensor, "batch"],
    ) -> Float[Tensor, "batch head d_head"]:
        """``attend`` at one query row per sequence."""
        return self.attend_many(x, q, k, v, geo, rows[:, None])[0][:, 0]

    def attend_many(
        self,
        x: Tensor | None,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        v: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
        rows: Int[Tensor, "batch row"],
    ) -> tuple[Float[Tensor, "batch row head d_head"], Tensor | None]:
        """``attend`` at the given query rows of each sequence (pooled designs; no hooks on
        scores or patterns): blocks pooled once, the raw band gathered. The token pattern
        ``[batch, head, row, key_pos]`` when wanted."""
        k_blk, v_blk, weights = self.pool(x, k, v, geo)  # [batch, kv_head, block, d_head]
        q_rows = query_rows(q, rows)  # [batch, head, row, d]
        s_blk = q_rows @ self._repeat_kv(k_blk, 1).transpose(-1, -2)  # [batch, head, row, block]
        band_pos = band_positions(rows, geo.band, self.cfg.n_heads)  # [batch, head, row, w]
        s_raw = torch.einsum("bhrd,bhrwd->bhrw", q_rows, gather_heads(k, band_pos))
        visible = torch.cat([at_rows(geo.block_used, rows), at_rows(geo.band_valid, rows)], -1)
        pattern = self._row_pattern(torch.cat([s_blk, s_raw], -1), self._repeat_kv(visible, 1))
        nb = s_blk.shape[-1]
        z = pattern[..., :nb] @ self._repeat_kv(v_blk, 1) + torch.einsum(
            "bhrw,bhrwd->bhrd", pattern[..., nb:], gather_heads(v, band_pos)
        )
        token_pattern = None
        if self._token_pattern_wanted():  # [batch, head, row, key_pos]
            if weights is None:
                weights = self.block_attribution(x, k, v, geo)
            a = self._blocks_to_tokens(weights, geo, k.shape[1])  # [batch, kv_head, block, key]
            token_pattern = pattern[..., :nb] @ self._repeat_kv(a, 1)
            band_at = band_pos.clamp(0, k.shape[1] - 1)
            token_pattern.scatter_add_(-1, band_at, pattern[..., nb:])
        return z.transpose(1, 2), token_pattern

    # ------------------------------------------------------------------ decode regime
    @property
    def serves_from_cache(self) -> bool:
        """Whether a KV cache (keys and values only) holds what the design reads (the design
        registry's trait: ``gated``'s gates read the layer input, which a cache drops)."""
        return traits(self.design).serves_from_cache

    #: how many of the prefill's last queries a cache should keep (``evict`` observes them)
    cached_queries: int = 0
    #: positions before it hold the same keys and values in every sequence of the batch (a
    #: cached forward over copies of one prefill; 0: none known)
    shared_prefix: int = 0
    #: what the prefill's unknown queries hold where no rule reads them (``None``: left unset;
    #: a test sets NaN to prove that nothing reads them)
    unknown_query: float | None = None
    #: the first position whose query this forward knows (a cached forward: the prefill's
    #: older queries are not kept)
    known_queries_from: int = 0

    def _forward_cached(
        self, inputs: tuple[Tensor, Tensor, Tensor], entry: Any, attention_mask: Tensor | None
    ) -> Float[Tensor, "batch new d_model"]:
        """The decode regime: the new rows (positions ``past .. past + new - 1``) read the
        compressed cache (``entry``: TransformerLens' KV cache entry, pre-RoPE keys); the
        prefill that filled it ran with full attention. Exactly one step of decode-time
        compression per row, computed for all new rows at once (teacher forcing)."""
        if not self.serves_from_cache:
            served = ", ".join(d for d in CACHE_DESIGNS if d != "none")
            raise NotImplementedError(
                f"layer {self.layer_id}: design {self.design!r} cannot read a KV cache (it "
                f"reads the layer input); decode-regime designs: {served}"
            )
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise NotImplementedError(
                f"layer {self.layer_id} ({self.design}): a padded KV cache is not supported; "
                "decode one sequence (or equal-length sequences) at a time"
            )
        q, k, v = self.calculate_qkv_matrices(*inputs)  # query, key, value inputs (shortformer)
        x = inputs[1]  # the layer input a pooling rule may read (as ``forward`` passes it)
        past = entry.past_keys.shape[1]
        if self.cfg.positional_embedding_type == "rotary":
            q = self.hook_rot_q(self.apply_rotary(q, past, None))
            k, v = self._rotated_keys(entry, k, v, past)
            k = self.hook_rot_k(k)
        else:
            k, v = entry.append(k, v)
        q_full, known_from = self._cached_queries(entry, q, past)
        offsets = self.hook_grid_offset(self.grid_offsets(q.shape[0], q.device))
        geo = self._geometry(offsets, k.shape[1], None)
        rows = torch.arange(past, k.shape[1], device=q.device).expand(q.shape[0], -1)
        self.known_queries_from = known_from  # a rule that reads past queries checks it
        copies = _one_copy(entry.past_keys) and _one_copy(entry.past_values)
        self.shared_prefix = past if entry.frozen and q.shape[0] > 1 and copies else 0
        try:
            z, token_pattern = self.attend_many(x, q_full, k, v, geo, rows)
        finally:
            self.known_queries_from = self.shared_prefix = 0
        if token_pattern is not None:  # [batch, head, new, key_pos]: the new rows only
            self.hook_token_pattern(token_pattern)
        return self._output(self.hook_z(z))

    def _rotated_keys(
        self, entry: Any, k: Tensor, v: Tensor, past: int
    ) -> tuple[Float[Tensor, "batch pos kv_head d"], Float[Tensor, "batch pos kv_head d"]]:
        """Post-RoPE keys on every position and the values. A frozen cache's keys are rotated
        once and kept on the entry (rotating a long prefill per forward dominated patching,
        whose batches are copies of one prefill: an expanded cache is rotated for one copy);
        RoPE is position-wise, so the result is what rotating the whole sequence gives.
        Dynamic NTK RoPE rescales with the length, so it rotates everything every time."""
        if not entry.frozen or self.cfg.use_dynamic_ntk_rope:
            k, v = entry.append(k, v)
            return self.apply_rotary(k, 0, None), v
        keys = entry.past_keys
        rotated = getattr(entry, "rotated_keys", None)
        if rotated is None or (rotated.is_inference() and not torch.is_inference_mode_enabled()):
            rotated = self.apply_rotary(keys[:1] if _one_copy(keys) else keys, 0, None)
            entry.rotated_keys = rotated = rotated.expand(keys.shape[0], *rotated.shape[1:])
        k = torch.cat([rotated, self.apply_rotary(k, past, None)], dim=1)
        return k, torch.cat([entry.past_values, v], dim=1)

    def _cached_queries(
        self, entry: Any, q: Float[Tensor, "batch new head d_head"], past: int
    ) -> tuple[Float[Tensor, "batch pos head d_head"], int]:
        """Queries on every position (the prefill's unknown ones unset: a rule that reads past
        queries reads only known ones, ``known_queries_from`` on) and the first position whose
        query is known; an unfrozen cache keeps the last ``cached_queries`` of them."""
        stored = getattr(entry, "past_queries", None)
        known = 0 if stored is None else stored.shape[1]
        shape = (q.shape[0], past + q.shape[1], *q.shape[2:])
        if self.unknown_query is None:  # no rule reads them: zeroing cost ~15% of a forward
            q_full = q.new_empty(shape)
        else:
            q_full = q.new_full(shape, self.unknown_query)
        q_full[:, past:] = q
        if known:
            q_full[:, past - known : past] = stored.to(q.dtype)
        known_from = past - known if past else 0
        if not entry.frozen and self.cached_queries:  # only queries this forward knows
            keep_from = max(known_from, q_full.shape[1] - self.cached_queries)
            entry.past_queries = q_full[:, keep_from:].detach()
        return q_full, known_from
