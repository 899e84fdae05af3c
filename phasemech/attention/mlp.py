"""``mlp``: the NSA compressor, an MLP over each flattened block.

NSA paper; lucidrains ``native-sparse-attention``. Axes: ``batch, kv_head, block, slot, d_head``.
For keys (and, with separate weights, values)::

    K_b = MLP_K( flatten_j (k_j + pe_K[slot(j)]) ),   MLP: l*D -> l*D -> D, ReLU

with learned intra-block position embeddings ``pos_embed_k/v [kv_head, slot, d_head]``; the MLP is
shared by the KV heads. Missing slots (before position 0, padding) enter as zeros.

Token attribution is NOT exact here: an MLP entry is not a convex mixture of tokens. The block
weights ``A[b, j]`` reported through ``hook_block_weights`` and used by ``hook_token_pattern`` are a
gradient x input attribution of the value entry along its own direction,
``|(v_j + pe_j) . d(u . V_b)/d(v_j)|`` with ``u = V_b / |V_b|``, normalised over the block's slots
(closed form, since the MLP is piecewise linear). ``token_pattern_exact`` is ``False``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from phasemech.attention.base import CompressedAttentionMixin
from phasemech.core.grid import Geometry


def _compressor(width: int, d_head: int, gen: torch.Generator, dtype: torch.dtype) -> nn.Sequential:
    mlp = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, d_head))
    with torch.no_grad():
        for lin in (mlp[0], mlp[2]):
            bound = 1.0 / lin.in_features**0.5
            lin.weight.copy_(torch.rand(lin.weight.shape, generator=gen) * 2 * bound - bound)
            lin.bias.zero_()
    return mlp.to(dtype)


class MLPCompressorAttention(CompressedAttentionMixin):
    design = "mlp"
    token_pattern_exact = False

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        g, dh, sl = self.n_kv_heads, self.cfg.d_head, self.block_len
        gen = self._generator()
        self.compress_k = _compressor(sl * dh, dh, gen, self.cfg.dtype)
        self.compress_v = _compressor(sl * dh, dh, gen, self.cfg.dtype)
        std = self.cfg.initializer_range if self.cfg.initializer_range > 0 else 0.02
        self.pos_embed_k = nn.Parameter(
            (torch.randn(g, sl, dh, generator=gen) * std).to(self.cfg.dtype)
        )
        self.pos_embed_v = nn.Parameter(
            (torch.randn(g, sl, dh, generator=gen) * std).to(self.cfg.dtype)
        )

    def _inputs(self, x: Tensor, pe: Tensor, geo: Geometry) -> Float[Tensor, "b g n flat"]:
        slots = (self._gather_slots(x, geo) + pe[None, :, None]) * geo.slot_valid[..., None]
        return slots.flatten(-2)

    def pool(self, x, k, v, geo):
        xk = self._inputs(k, self.pos_embed_k, geo)
        xv = self._inputs(v, self.pos_embed_v, geo)
        k_blk, v_blk = self.compress_k(xk), self.compress_v(xv)
        weights = None
        if self.hook_block_weights.has_hooks():
            # Read-only view: the MLP does not use these weights, so patching them changes nothing.
            weights = self.hook_block_weights(self._attribution(xv, v_blk, geo))
        return k_blk, v_blk, weights

    def block_attribution(self, x, k, v, geo):
        xv = self._inputs(v, self.pos_embed_v, geo)
        return self._attribution(xv, self.compress_v(xv), geo)

    def _attribution(
        self, xv: Tensor, v_blk: Tensor, geo: Geometry
    ) -> Float[Tensor, "batch kv_head block slot"]:
        lin1, lin2 = self.compress_v[0], self.compress_v[2]
        u = v_blk / v_blk.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        active = (xv @ lin1.weight.T + lin1.bias > 0).to(xv.dtype)
        grad = ((u @ lin2.weight) * active) @ lin1.weight  # d(u . V_b) / d(input)
        rel = (xv * grad).unflatten(-1, (self.block_len, -1)).sum(-1).abs() * geo.slot_valid
        total = rel.sum(-1, keepdim=True)
        uniform = geo.slot_valid / geo.slot_valid.sum(-1, keepdim=True).clamp(min=1)
        return torch.where(total > 0, rel / total.clamp(min=1e-30), uniform).to(xv.dtype)
