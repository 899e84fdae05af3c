"""``csa`` and ``hca``: DeepSeek-V4's compressors (Compressed / Heavily-Compressed Attention).

Axes: ``batch, pos, kv_head, block, slot, series, d_head``. Block ``i`` holds ``l = S*d`` slots
(``S`` projection series of ``d`` tokens; slot ``j`` belongs to series ``j // d``, so with
``csa``'s default ``l = 2d`` series 0 is the previous stride's half and series 1 the current
one's; ``hca`` has ``l = d``, one series, at a large stride). For keys (values alike, with their
own weights)::

    z_j = x_j W_z[series(j)] + B[slot(j)]              per channel [d_head], from the input
    c_j = k_j P_K[series(j)]                           the series' projection of the key
    K_b = RMSNorm( sum_j softmax_j(z_j) * c_j ) * w_K   softmax over the block's real slots

``P`` starts as the identity and ``W_z``, ``B`` near zero, so a fresh compressor is mean pooling
followed by RMSNorm. ``pool_rope="pre"`` (the default, as the real system) pools pre-RoPE keys
(the layer's rotated keys rotated back by their own position) and rotates the entry at its
block's current stride start ``i*d + o - d`` (clamped at 0); ``"post"`` pools the rotated keys
as phasemech's other pooled designs do. Entries and the raw window share one softmax
(``block_scope="all"`` by default, as DeepSeek-V4).

Token attribution is approximate (per-channel gates, the projections and the norm): the
weights reported through ``hook_block_weights`` are the gates ``[batch, kv_head, block, slot,
d_head]`` and ``hook_token_pattern`` uses their channel mean; ``token_pattern_exact`` is
``False``. Real CSA also picks top-k entries with a lightning indexer; that part is ``dsa``'s.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor

from phasemech.attention.base import CompressedAttentionMixin
from phasemech.core.grid import Geometry

RMS_EPS = 1e-6


class SeriesPoolAttention(CompressedAttentionMixin):
    design = "csa"
    token_pattern_exact = False

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        comp = self.cfg.compression
        self.design = comp.design
        self.pool_rope: str = comp.pool_rope
        g, m, dh, sl = self.n_kv_heads, self.cfg.d_model, self.cfg.d_head, self.block_len
        series = sl // self.stride
        std = self.cfg.initializer_range if self.cfg.initializer_range > 0 else 0.02
        gen = self._generator()
        dt = self.cfg.dtype
        eye = torch.eye(dh, dtype=dt).expand(g, series, dh, dh)
        self.P_K, self.P_V = nn.Parameter(eye.clone()), nn.Parameter(eye.clone())
        self.W_z_K = nn.Parameter((torch.randn(g, series, m, dh, generator=gen) * std).to(dt))
        self.W_z_V = nn.Parameter((torch.randn(g, series, m, dh, generator=gen) * std).to(dt))
        self.B_K = nn.Parameter(torch.zeros(g, sl, dh, dtype=dt))
        self.B_V = nn.Parameter(torch.zeros(g, sl, dh, dtype=dt))
        self.w_K = nn.Parameter(torch.ones(g, dh, dtype=dt))
        self.w_V = nn.Parameter(torch.ones(g, dh, dtype=dt))
        self.register_buffer("series_of_slot", torch.arange(sl) // self.stride, persistent=False)

    # ------------------------------------------------------------------ rotary
    def _positions(self, geo: Geometry, seq: int, device: torch.device) -> Int[Tensor, "b pos"]:
        """Rotary position of every index (TransformerLens' ids: counted over real tokens)."""
        if geo.key_valid is None:
            return torch.arange(seq, device=device)[None]
        return (geo.key_valid.long().cumsum(-1) - 1).clamp(min=0)

    def _rotate(self, x: Tensor, pos: Tensor, sign: float) -> Tensor:
        """Rotate ``x [..., d_head]`` by the angle of position ``pos`` (``x.shape[:-1]``);
        ``sign=-1`` undoes the rotation."""
        rd = self.cfg.rotary_dim
        cos, sin = self.rotary_cos[pos].to(x.dtype), self.rotary_sin[pos].to(x.dtype)
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        out = x_rot * cos + sign * self.rotate_every_two(x_rot) * sin
        return torch.cat([out, x_pass], -1)

    # ------------------------------------------------------------------ the compressor
    def _entries(
        self,
        x: Float[Tensor, "batch pos d_model"],
        content: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
        params: tuple[Tensor, Tensor, Tensor, Tensor],
    ) -> tuple[Float[Tensor, "batch kv_head block d_head"], Tensor]:
        w_z, proj, bias, weight = params
        series = self.series_of_slot  # [slot]: the projection series of each slot
        if x.ndim == 4:  # split-QKV input: one residual copy per KV head
            z = torch.einsum("bpgm,gsmd->bpgsd", x, w_z.to(x.dtype))
        else:
            z = torch.einsum("bpm,gsmd->bpgsd", x, w_z.to(x.dtype))
        zs = self._gather_slots(z.flatten(-2), geo).unflatten(-1, z.shape[-2:])
        slots = torch.arange(len(series), device=x.device)
        zs = zs[:, :, :, slots, series] + bias[None, :, None]  # each slot its series' gate
        valid = geo.slot_valid[..., None]
        alpha = torch.softmax(zs.masked_fill(~valid, torch.finfo(zs.dtype).min), dim=3) * valid
        cs = torch.einsum("bgnsd,gsde->bgnse", self._gather_slots(content, geo),
                          proj.index_select(1, series))  # fmt: skip
        pooled = (alpha * cs).sum(3)
        rms = pooled.pow(2).mean(-1, keepdim=True).add(RMS_EPS).rsqrt()
        return pooled * rms * weight[None, :, None], alpha

    def pool(self, x, k, v, geo):
        if x is None:
            raise ValueError(f"{self.design}'s gates need the layer input")
        rotary = self.cfg.positional_embedding_type == "rotary" and self.pool_rope == "pre"
        if rotary:  # pool pre-RoPE keys: undo each key's own rotation
            pos = self._positions(geo, k.shape[1], k.device)  # [batch or 1, pos]
            k = self._rotate(k, pos[:, :, None].expand(k.shape[0], -1, k.shape[2]), -1.0)
        k_blk, alpha = self._entries(x, k, geo, (self.W_z_K, self.P_K, self.B_K, self.w_K))
        v_blk, alpha_v = self._entries(x, v, geo, (self.W_z_V, self.P_V, self.B_V, self.w_V))
        if rotary:  # the entry takes the rotation of its block's current stride start
            start = (geo.block_last + 1 - self.stride).clamp(0, k.shape[1] - 1)  # [b, g, n]
            at = pos.expand(k.shape[0], -1).gather(1, start.flatten(1)).reshape(start.shape)
            k_blk = self._rotate(k_blk, at, 1.0)
        self.hook_block_weights(alpha_v)  # the value gates: [batch, kv_head, block, slot, d]
        return k_blk, v_blk, alpha_v.mean(-1)
