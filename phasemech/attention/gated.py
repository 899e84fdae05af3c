"""``gated``: softmax-gated pooling with a learned intra-block position bias.

DeepSeek-V4 HCA/CSA compressor, GLM-5.3 k-pool indexer. Axes: ``batch, pos, kv_head, block,
slot, d_head``. For block ``b`` and its real tokens ``j``::

    alpha[b, j] = softmax_j( z_j + B[slot(j)] ),   z_j = x_j . W_gate
    K_b = sum_j alpha[b, j] k_j,   V_b = sum_j alpha[b, j] v_j

``gate="scalar"`` (default): one gate per KV head (``W_gate [kv_head, d_model]``,
``phase_bias [kv_head, slot]``), so ``alpha`` is a convex mass over tokens and token attribution
is exact. ``gate="channel"``: one per channel (``[kv_head, d_model, d_head]``,
``[kv_head, slot, d_head]``) as real systems do; token attribution then uses the channel mean of
``alpha`` and is flagged approximate. ``phase_bias`` is literally the learned phase preference.
Both start at zero or small: pooling starts (near) uniform, i.e. as ``mean``.
"""

from __future__ import annotations

import einops
import torch
import torch.nn as nn
from torch import Tensor

from phasemech.attention.base import CompressedAttentionMixin
from phasemech.core.grid import Geometry


class GatedPoolAttention(CompressedAttentionMixin):
    design = "gated"

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        g, m, dh, sl = self.n_kv_heads, self.cfg.d_model, self.cfg.d_head, self.block_len
        channel = self.cfg.compression.gate == "channel"
        self.token_pattern_exact = not channel
        gen = self._generator()
        gate_shape = (g, m, dh) if channel else (g, m)
        std = self.cfg.initializer_range if self.cfg.initializer_range > 0 else 0.02
        self.W_gate = nn.Parameter(
            (torch.randn(gate_shape, generator=gen) * std).to(self.cfg.dtype)
        )
        self.phase_bias = nn.Parameter(
            torch.zeros((g, sl, dh) if channel else (g, sl), dtype=self.cfg.dtype)
        )

    def gate_logits(self, x: Tensor) -> Tensor:
        """``z_j`` per KV head: ``[batch, pos, kv_head]`` (or ``[..., d_head]`` per channel)."""
        w = self.W_gate.to(x.dtype)
        if x.ndim == 4:  # split-QKV input: one residual copy per KV head
            eq = "b p g m, g m d -> b p g d" if w.ndim == 3 else "b p g m, g m -> b p g"
        else:
            eq = "b p m, g m d -> b p g d" if w.ndim == 3 else "b p m, g m -> b p g"
        return einops.einsum(x, w, eq)

    def pooling_weights(self, x: Tensor | None, geo: Geometry) -> Tensor:
        if x is None:
            raise ValueError("gated pooling needs the layer input")
        z = self.gate_logits(x)  # [batch, pos, kv_head(, d)]
        if z.ndim == 3:
            z = z[..., None]
        zs = self._gather_slots(z, geo)  # [batch, kv_head, block, slot, 1 or d]
        bias = self.phase_bias if self.phase_bias.ndim == 3 else self.phase_bias[..., None]
        logits = zs + bias[None, :, None]
        valid = geo.slot_valid[..., None]
        alpha = torch.softmax(logits.masked_fill(~valid, torch.finfo(logits.dtype).min), dim=3)
        alpha = alpha * valid  # padding-only blocks: all zero, no NaN
        return alpha if self.phase_bias.ndim == 3 else alpha[..., 0]
