"""Shared machinery of the compressed attention layers.

Axes: ``batch``, ``pos`` (query position), ``head`` (query head), ``kv_head``, ``block``,
``slot``, ``w`` (raw band slot: key ``t - Wr + 1 + w`` for query ``t``), ``d_head``.

A compressed layer is a TransformerLens attention module (``Attention`` or, for grouped-query
models, ``GroupedQueryAttention``: the concrete class is built by ``make_attention_class``) whose
``forward`` is replaced. Q/K/V projection, rotary, ``hook_q/k/v``, ``hook_rot_q/k``, ``hook_z``,
``hook_result`` and the output projection are TransformerLens' own, so parameter names, cached
activations and the stock patching tools keep working.

Pooled designs (``mean``, ``gated``, ``mlp``) attend, in ONE softmax, over a key axis made of the
``block`` compressed entries followed by a raw band of ``Wr`` tokens (``phasemech.core.grid``
fixes which entries are visible). The raw band is computed in query chunks, so the default
forward holds ``O(T * (T/d + Wr))`` scores, not ``O(T^2)``.

Hooks added to TransformerLens' set:

* ``hook_grid_offset`` ``[batch, kv_head]``: the grid offsets used by this forward (ints);
* ``hook_k_block``, ``hook_v_block`` ``[batch, block, kv_head, d_head]``: compressed entries;
* ``hook_block_weights`` ``[batch, kv_head, block, slot]``: pooling weights (``gated`` with
  ``gate="channel"``: ``[batch, kv_head, block, slot, d_head]``);
* ``hook_attn_scores``, ``hook_pattern`` ``[batch, head, pos, block + w]`` for pooled designs
  (masked scores are ``-inf``); the selecting designs' gathered layout is in
  :mod:`phasemech.attention.selection`;
* ``hook_token_pattern`` ``[batch, head, pos, key_pos]``: attention paid to each source token,
  ``m_t = p_t^blocks A + p_t^raw``. Exact for ``mean``, scalar ``gated`` and the selecting
  designs; for ``mlp`` (and channel-gated pooling) an approximation, flagged by
  ``token_pattern_exact``. Computed only when ``cfg.use_token_pattern`` is set or a hook is
  attached to it.

With a TransformerLens KV cache (the decode regime, :mod:`phasemech.model.decode`) a layer
computes only the new rows: ``hook_z``, ``hook_token_pattern`` and the selecting designs'
``hook_route_*`` then have ``new`` rows where ``pos`` stands above.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.components import Attention, GroupedQueryAttention
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.attention.projection import OLMO_QK_NORM, fused_qkv
from phasemech.attention.rows import RowsMixin, masked_softmax
from phasemech.core.grid import Geometry, build_geometry, left_padding

#: longest context the training fast path lays raw keys out densely for (``O(T^2)`` scores)
DENSE_MAX_POS = 256
#: the geometries built last (``_geometry``): one per grid a forward uses, shared by its layers
#: (index tensors, no graph; they outlive the forward, so at a long context on a GPU a caller
#: done with a model may ``_GEO_CACHE.clear()``)
_GEO_CACHE: OrderedDict[tuple, Geometry] = OrderedDict()
_GEO_CACHE_SIZE = 8  # per_layer offsets on local and global layers: 2 x d grids


class CompressedAttentionMixin(RowsMixin):
    """Forward pass shared by every compressed design. A weighted-sum design implements
    ``pooling_weights``; ``mlp`` overrides ``pool`` and ``route`` overrides ``attend``."""

    design: str = "abstract"
    #: whether ``hook_token_pattern`` is an exact decomposition of ``hook_z``
    token_pattern_exact: bool = True

    # ------------------------------------------------------------------ construction
    def __init__(self, cfg: Any, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)  # type: ignore[call-arg]
        comp = self.cfg.compression
        self.stride: int = comp.stride
        self.block_len: int = comp.block_len
        self.window: int = comp.window
        self.visibility: str = comp.visibility
        self.hook_grid_offset = HookPoint()  # [batch, kv_head]
        self.hook_k_block = HookPoint()  # [batch, block, kv_head, d_head]
        self.hook_v_block = HookPoint()  # [batch, block, kv_head, d_head]
        self.hook_block_weights = HookPoint()  # [batch, kv_head, block, slot]
        self.hook_token_pattern = HookPoint()  # [batch, head, pos, key_pos]
        # Static offsets [kv_head] of this layer; the model adds per-sequence shifts.
        self.register_buffer(
            "base_offset", torch.zeros(self.n_kv_heads, dtype=torch.long), persistent=False
        )
        # Per-forward shifts (random offsets, user shifts) come from the owning model.
        self._grid_state: Any = None

    @property
    def n_kv_heads(self) -> int:
        return self.cfg.n_kv_heads

    @property
    def local_window(self) -> int | None:
        """A sliding-window layer's span (its keys ``t - S + 1 .. t``); ``None`` if global."""
        local = self.attn_type == "local" and self.cfg.use_local_attn
        return int(self.cfg.window_size) if local else None

    def calculate_qkv_matrices(self, query_input, key_input, value_input):
        """TransformerLens' projections (with its per-head QK-norm), then what its ``forward``
        applies after them and before rotary: the OLMo family's QK-norm over whole projected
        vectors (all heads at once) and OLMo's ``clip_qkv``."""
        q, k, v = super().calculate_qkv_matrices(query_input, key_input, value_input)
        if self.cfg.original_architecture in OLMO_QK_NORM:
            q = self.q_norm(q.flatten(-2)).unflatten(-1, q.shape[-2:])
            k = self.k_norm(k.flatten(-2)).unflatten(-1, k.shape[-2:])
        if self.cfg.clip_qkv is not None:
            c = self.cfg.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return q, k, v

    def _generator(self) -> torch.Generator:
        """Deterministic RNG for compressor parameters, independent of global RNG state."""
        seed = 0 if self.cfg.seed is None else int(self.cfg.seed)
        return torch.Generator().manual_seed(seed * 1_000 + 7 * (self.layer_id or 0) + 1)

    # ------------------------------------------------------------------ helpers
    def grid_offsets(
        self, batch: int, device: torch.device, attention_mask: Tensor | None = None
    ) -> Int[Tensor, "batch kv_head"]:
        """Offsets of this forward: static per-head offsets, plus the model's per-sequence shift
        (random offsets, ``PhaseTransformer.shift_grid``), plus left padding so that the grid is
        anchored to each sequence's first real token, as TransformerLens' position ids are."""
        off = self.base_offset.to(device)[None, :].expand(batch, -1)
        shift = torch.zeros(batch, dtype=torch.long, device=device)
        if self._grid_state is not None:
            shift = shift + self._grid_state.shift(batch, device)
        if attention_mask is not None:
            shift = shift + left_padding(attention_mask.to(device))
        return torch.remainder(off + shift[:, None], self.stride)

    def _repeat_kv(self, x: Tensor, dim: int) -> Tensor:
        rep = self.cfg.n_heads // x.shape[dim]
        return x if rep == 1 else torch.repeat_interleave(x, rep, dim=dim)

    def _token_pattern_wanted(self) -> bool:
        return bool(self.cfg.use_token_pattern) or self.hook_token_pattern.has_hooks()

    def _gather_slots(
        self, x: Float[Tensor, "batch pos kv_head d"], geo: Geometry
    ) -> Float[Tensor, "batch kv_head block slot d"]:
        """``x`` at every block slot; missing slots are zero."""
        b, seq, g, dd = x.shape
        nb, sl = geo.slot_pos.shape[2], geo.slot_pos.shape[3]
        pos = geo.slot_pos.clamp(0, seq - 1)
        if geo.shared:
            # one grid for the whole batch (no per-sequence shift): an index_select per KV
            # head, about twice as fast as the batched gather forward and backward
            rows = [x[:, :, i].index_select(1, pos[0, i].reshape(-1)) for i in range(g)]
            out = torch.stack(rows, 1).reshape(b, g, nb, sl, dd)
        else:
            idx = pos.reshape(b, g, nb * sl, 1).expand(-1, -1, -1, dd)
            out = torch.gather(x.transpose(1, 2), 2, idx).reshape(b, g, nb, sl, dd)
        return out * geo.slot_valid[..., None]

    def _output(
        self, z: Float[Tensor, "batch pos head d_head"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """TransformerLens' output projection (with ``hook_result`` when enabled)."""
        if not self.cfg.use_attn_result:
            w = einops.rearrange(self.W_O, "head d_head d_model -> d_model (head d_head)")
            return F.linear(z.reshape(z.shape[0], z.shape[1], -1), w, self.b_O)
        result = self.hook_result(einops.einsum(z, self.W_O, "b p h dh, h dh m -> b p h m"))
        return result.sum(-2) + self.b_O

    # ------------------------------------------------------------------ raw band
    def _band_chunks(self, seq: int, band: int) -> tuple[int, int]:
        chunk = max(band, 32)
        return chunk, -(-seq // chunk)

    def _band_scores(
        self, q: Float[Tensor, "batch head pos d"], k: Float[Tensor, "batch head pos d"], band: int
    ) -> Float[Tensor, "batch head pos w"]:
        """Scores of every query against its raw band, in query chunks (no T x T tensor)."""
        b, h, seq, dd = q.shape
        chunk, n_chunks = self._band_chunks(seq, band)
        padded = n_chunks * chunk
        qc = F.pad(q, (0, 0, 0, padded - seq)).reshape(b, h, n_chunks, chunk, dd)
        # keys of chunk c: positions [c*chunk - band, c*chunk + chunk - 1]
        kp = F.pad(k, (0, 0, band, padded - seq))
        kw = kp.unfold(2, chunk + band, chunk)  # [b, h, n_chunks, d, chunk + band]
        scores = qc @ kw  # [b, h, n_chunks, chunk, chunk + band]
        idx = self._band_index(chunk, band, q.device).expand(b, h, n_chunks, -1, -1)
        return scores.gather(-1, idx).reshape(b, h, padded, band)[:, :, :seq]

    @staticmethod
    def _band_index(chunk: int, band: int, device: torch.device) -> Tensor:
        # query i of a chunk, band slot w  ->  key column i + 1 + w of the chunk's key window
        i = torch.arange(chunk, device=device)[:, None]
        w = torch.arange(band, device=device)[None, :]
        return (i + 1 + w)[None, None, None]

    def _band_mix(
        self, p: Float[Tensor, "batch head pos w"], v: Float[Tensor, "batch head pos d"]
    ) -> Float[Tensor, "batch head pos d"]:
        """``sum_w p[t, w] v[t - Wr + 1 + w]`` in query chunks."""
        b, h, seq, band = p.shape
        dd = v.shape[-1]
        chunk, n_chunks = self._band_chunks(seq, band)
        padded = n_chunks * chunk
        pc = F.pad(p, (0, 0, 0, padded - seq)).reshape(b, h, n_chunks, chunk, band)
        full = pc.new_zeros(b, h, n_chunks, chunk, chunk + band)
        idx = self._band_index(chunk, band, p.device).expand(b, h, n_chunks, -1, -1)
        full = full.scatter(-1, idx, pc)
        vp = F.pad(v, (0, 0, band, padded - seq))
        vw = vp.unfold(2, chunk + band, chunk).transpose(-1, -2)  # [b, h, n, chunk+band, d]
        return (full @ vw).reshape(b, h, padded, dd)[:, :, :seq]

    @staticmethod
    def _unband(p: Float[Tensor, "batch head pos w"]) -> Float[Tensor, "batch head pos key_pos"]:
        """Band weights laid out on absolute key positions."""
        b, h, seq, band = p.shape
        cols = torch.arange(seq, device=p.device)[:, None] + torch.arange(band, device=p.device)
        out = p.new_zeros(b, h, seq, seq + band - 1)
        out = out.scatter(-1, cols.expand(b, h, -1, -1), p)
        return out[..., band - 1 :]

    @staticmethod
    def _blocks_to_tokens(
        weights: Float[Tensor, "batch kv_head block slot"], geo: Geometry, seq: int
    ) -> Float[Tensor, "batch kv_head block key_pos"]:
        """Dense ``A[block, key_pos]``: how much of each token each block holds."""
        b, g, nb, sl = weights.shape
        pos = geo.slot_pos.clamp(0, seq - 1).reshape(b, g, nb, sl)
        dense = weights.new_zeros(b, g, nb, seq)
        return dense.scatter_add(-1, pos, weights * geo.slot_valid)

    # ------------------------------------------------------------------ design interface
    def pooling_weights(
        self, x: Tensor | None, geo: Geometry
    ) -> Float[Tensor, "batch kv_head block slot"]:
        """Convex pooling weights of each block over its slots (zero on missing slots)."""
        raise NotImplementedError

    def pool(
        self,
        x: Tensor | None,
        k: Float[Tensor, "batch pos kv_head d_head"],
        v: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``K_blk, V_blk [batch, kv_head, block, d_head]`` and the weights ``A`` that made them
        (``[batch, kv_head, block, slot]``, or ``None`` when a design has no cheap ``A``).

        Weighted-sum designs share this: weights first (so ``hook_block_weights`` can be
        patched), then the same weights pool keys and values.
        """
        weights = self.hook_block_weights(self.pooling_weights(x, geo).to(k.dtype))
        ks, vs = self._gather_slots(k, geo), self._gather_slots(v, geo)
        if weights.ndim == 4:  # one weight per slot
            w = weights[..., None]  # a broadcast product beats a batch of 1 x l matmuls here
            return (w * ks).sum(3), (w * vs).sum(3), weights
        # per-channel weights [b, g, n, s, d]; token attribution uses the channel mean
        return (ks * weights).sum(3), (vs * weights).sum(3), weights.mean(-1)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query_input: Tensor,
        key_input: Tensor,
        value_input: Tensor,
        past_kv_cache_entry: Any = None,
        additive_attention_mask: Tensor | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        position_bias: Tensor | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        if additive_attention_mask is not None or position_bias is not None:
            raise NotImplementedError(
                f"layer {self.layer_id} ({self.design}): additive masks and position biases "
                "are not supported on compressed layers"
            )
        if past_kv_cache_entry is not None:
            inputs = (query_input, key_input, value_input)
            return self._forward_cached(inputs, past_kv_cache_entry, attention_mask)
        if self.training:  # one fused projection; the same q, k, v and hooks
            q, k, v = fused_qkv(self, query_input, key_input, value_input)
        else:
            q, k, v = self.calculate_qkv_matrices(query_input, key_input, value_input)
        if self.cfg.positional_embedding_type == "rotary":
            # Pool post-RoPE keys (fla-org NSA, MoBA): each entry keeps its tokens' rotations.
            q = self.hook_rot_q(self.apply_rotary(q, 0, attention_mask))
            k = self.hook_rot_k(self.apply_rotary(k, 0, attention_mask))
        offsets = self.hook_grid_offset(self.grid_offsets(q.shape[0], q.device, attention_mask))
        key_valid = None if attention_mask is None else attention_mask.to(q.device).bool()
        geo = self._geometry(offsets, q.shape[1], key_valid)
        z, token_pattern = self.attend(key_input, q, k, v, geo)
        if token_pattern is not None:
            self.hook_token_pattern(token_pattern)
        z = self.hook_z(z)
        return self._output(z)

    def _geometry(
        self, offsets: Int[Tensor, "batch kv_head"], seq: int, key_valid: Tensor | None
    ) -> Geometry:
        if key_valid is not None:  # padded inputs differ per batch: never cached
            return self._build_geometry(offsets, seq, key_valid)
        # every layer of a forward (and every forward of a training step) builds the same
        # geometry from the same grid: build it once. A geometry built under inference mode
        # cannot enter a graph (attribution patching).
        key = (
            seq,
            tuple(offsets.flatten().tolist()),
            tuple(offsets.shape),
            str(offsets.device),
            self.stride,
            self.block_len,
            self.window,
            self.visibility,
            self.cfg.compression.block_scope,
            self.local_window,
            self.cfg.compression.sink_tokens,
            torch.is_inference_mode_enabled(),
        )
        geo = _GEO_CACHE.pop(key, None)
        if geo is None:
            geo = self._build_geometry(offsets, seq, None)
        _GEO_CACHE[key] = geo  # most recent last
        while len(_GEO_CACHE) > _GEO_CACHE_SIZE:
            _GEO_CACHE.popitem(last=False)
        return geo

    def _build_geometry(
        self, offsets: Int[Tensor, "batch kv_head"], seq: int, key_valid: Tensor | None
    ) -> Geometry:
        c = self.cfg.compression
        return build_geometry(
            offsets,
            seq,
            self.stride,
            self.block_len,
            self.window,
            self.visibility,
            key_valid,
            c.block_scope,
            self.local_window,
            c.sink_tokens or 0,
        )

    def attend(
        self,
        x: Tensor | None,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        v: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> tuple[Float[Tensor, "batch pos head d_head"], Tensor | None]:
        """Pooled designs: one softmax over [blocks, raw band]."""
        seq = q.shape[1]
        k_blk, v_blk, weights = self.pool(x, k, v, geo)
        k_blk = self.hook_k_block(k_blk.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        v_blk = self.hook_v_block(v_blk.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        qh = q.transpose(1, 2)  # [batch, head, pos, d]
        kh = self._repeat_kv(k.transpose(1, 2), 1)
        vh = self._repeat_kv(v.transpose(1, 2), 1)
        if self._dense_ok(seq):
            return self._attend_dense(qh, kh, vh, k_blk, v_blk, geo).transpose(1, 2), None
        s_blk = qh @ self._repeat_kv(k_blk, 1).transpose(-1, -2)  # [batch, head, pos, block]
        s_raw = self._band_scores(qh, kh, geo.band)  # [batch, head, pos, w]
        visible = self._repeat_kv(torch.cat([geo.block_used, geo.band_valid], dim=-1), 1)
        pattern = self._pattern(torch.cat([s_blk, s_raw], dim=-1), visible)
        nb = s_blk.shape[-1]
        p_blk, p_raw = pattern[..., :nb], pattern[..., nb:]
        z = p_blk @ self._repeat_kv(v_blk, 1) + self._band_mix(p_raw, vh)
        token_pattern = None
        if self._token_pattern_wanted():
            if weights is None:
                weights = self.block_attribution(x, k, v, geo)
            a = self._blocks_to_tokens(weights, geo, seq)  # [batch, kv_head, block, key_pos]
            token_pattern = p_blk @ self._repeat_kv(a, 1) + self._unband(p_raw)
        return z.transpose(1, 2), token_pattern

    def _dense_ok(self, seq: int) -> bool:
        """The short-context training path: nothing hooked that only the banded path feeds."""
        return (
            self.training
            and seq <= DENSE_MAX_POS
            and not self.hook_attn_scores.has_hooks()
            and not self.hook_pattern.has_hooks()
            and not self._token_pattern_wanted()
        )

    def _attend_dense(
        self,
        qh: Float[Tensor, "batch head pos d"],
        kh: Float[Tensor, "batch head pos d"],
        vh: Float[Tensor, "batch head pos d"],
        k_blk: Float[Tensor, "batch kv_head block d"],
        v_blk: Float[Tensor, "batch kv_head block d"],
        geo: Geometry,
    ) -> Float[Tensor, "batch head pos d"]:
        """``attend``'s softmax over [blocks, raw window] with the raw keys laid out on every
        position (``[pos, block + key_pos]``, the window a mask): two matmuls instead of the
        band's gathers and scatters, which dominate a training step at short context."""
        seq = qh.shape[2]
        t = torch.arange(seq, device=qh.device)
        raw = (t[None, :] >= geo.raw_start[..., None]) & (t[None, :] <= t[:, None])
        if geo.key_valid is not None:
            raw = raw & geo.key_valid[:, None, None, :].to(raw.device)
        visible = self._repeat_kv(torch.cat([geo.block_used, raw], dim=-1), 1)
        keys = torch.cat([self._repeat_kv(k_blk, 1), kh], dim=2)
        values = torch.cat([self._repeat_kv(v_blk, 1), vh], dim=2)
        # scaling q (not the larger score matrix) is the same product
        scores = apply_softcap(
            (qh / self.attn_scale) @ keys.transpose(-1, -2), self.cfg.attn_scores_soft_cap
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.window >= 1 and geo.key_valid is None:  # each query sees itself: no empty row
            return torch.softmax(scores, dim=-1) @ values
        return masked_softmax(scores, visible, neg_inf_masked=True) @ values

    def _pattern(
        self,
        scores: Float[Tensor, "batch head pos key"],
        visible: Bool[Tensor, "batch head pos key"],
    ) -> Float[Tensor, "batch head pos key"]:
        """Scale, soft-cap and mask the raw ``q . k`` scores (TransformerLens' order), run
        ``hook_attn_scores`` (hidden entries ``-inf``) and return the hooked ``hook_pattern``.

        ``scores`` must be a fresh tensor: it is scaled and masked in place (the score tensor is
        the largest one here, so each avoided copy matters; see ``bench/attention_scaling.py``).
        """
        scores = apply_softcap(scores.div_(self.attn_scale), self.cfg.attn_scores_soft_cap)
        scores = scores.masked_fill_(~visible, float("-inf"))
        hooked = self.hook_attn_scores.has_hooks()
        scores = self.hook_attn_scores(scores)
        if hooked:  # a hook may hide more entries (set -inf); respect it
            visible = visible & (scores > float("-inf"))
        return self.hook_pattern(masked_softmax(scores, visible, neg_inf_masked=not hooked))

    def block_attribution(
        self, x: Tensor | None, k: Tensor, v: Tensor, geo: Geometry
    ) -> Float[Tensor, "batch kv_head block slot"]:
        raise NotImplementedError


_CLASS_CACHE: dict[tuple[type, type], type] = {}


def make_attention_class(design_cls: type, grouped: bool) -> type:
    """The module class: a design mixin over TL's ``Attention`` or ``GroupedQueryAttention``."""
    base = GroupedQueryAttention if grouped else Attention
    key = (design_cls, base)
    if key not in _CLASS_CACHE:
        name = design_cls.__name__ + ("GQA" if grouped else "")
        _CLASS_CACHE[key] = type(name, (design_cls, base), {"__module__": design_cls.__module__})
    return _CLASS_CACHE[key]
