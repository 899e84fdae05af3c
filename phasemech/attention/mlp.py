"""``mlp``: the NSA compressor, an MLP over each flattened block.

NSA paper; lucidrains ``native-sparse-attention``. Axes: ``batch, kv_head, block, slot, d_head``.
For keys (and, with separate weights, values)::

    K_b = mean_j k_j + MLP_K( flatten_j (k_j + pe_K[slot(j)]) ),   MLP: l*D -> l*D -> D, ReLU

with learned intra-block position embeddings ``pos_embed_k/v [kv_head, slot, d_head]``; the MLP is
shared by the KV heads. Missing slots (before position 0, padding) enter as zeros and are left
out of the mean. The MLP's output layer starts at zero, so the compressor starts as mean pooling
(as ``gated`` does) and learns what the MLP adds: with a randomly initialised output layer the
MLP's entries start as noise that the retrieval head must first learn to ignore, and models at
d = 4 stayed on the MQAR loss plateau for the whole 2000-step search budget (see
``docs/training.md``). The mean path is a linear function the MLP could represent anyway; it
changes where training starts, not what the design can compute.

Token attribution is NOT exact here: an MLP entry is not a convex mixture of tokens. The block
weights ``A[b, j]`` reported through ``hook_block_weights`` and used by ``hook_token_pattern`` are a
gradient x input attribution of the value entry along its own direction,
``|(v_j + pe_j) . d(u . V_b)/d(v_j)|`` with ``u = V_b / |V_b|``, normalised over the block's slots
(closed form, since the MLP is piecewise linear and the mean linear). ``token_pattern_exact``
is ``False``.
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
        bound = 1.0 / width**0.5
        mlp[0].weight.copy_(torch.rand(mlp[0].weight.shape, generator=gen) * 2 * bound - bound)
        mlp[0].bias.zero_()
        mlp[2].weight.zero_()  # the compressor starts as the mean of its block
        mlp[2].bias.zero_()
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

    def _inputs(
        self, x: Tensor, pe: Tensor, geo: Geometry
    ) -> tuple[Float[Tensor, "b g n flat"], Float[Tensor, "b g n d"]]:
        """The MLP's input (flattened slots plus position embeddings) and the block mean,
        from one gather of the block's slots (missing slots are zero)."""
        slots = self._gather_slots(x, geo)
        valid = geo.slot_valid[..., None].to(x.dtype)
        mean = slots.sum(3) / valid.sum(3).clamp(min=1)
        return ((slots + pe[None, :, None]) * valid).flatten(-2), mean

    def pool(self, x, k, v, geo):
        xk, k_mean = self._inputs(k, self.pos_embed_k, geo)
        xv, v_mean = self._inputs(v, self.pos_embed_v, geo)
        k_blk = k_mean + self.compress_k(xk)
        v_blk = v_mean + self.compress_v(xv)
        weights = None
        if self.hook_block_weights.has_hooks():
            # Read-only view: the MLP does not use these weights, so patching them changes nothing.
            weights = self.hook_block_weights(self._attribution(xv, v_blk, geo))
        return k_blk, v_blk, weights

    def block_attribution(self, x, k, v, geo):
        xv, v_mean = self._inputs(v, self.pos_embed_v, geo)
        return self._attribution(xv, v_mean + self.compress_v(xv), geo)

    def _attribution(
        self, xv: Tensor, v_blk: Tensor, geo: Geometry
    ) -> Float[Tensor, "batch kv_head block slot"]:
        lin1, lin2 = self.compress_v[0], self.compress_v[2]
        u = v_blk / v_blk.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        active = (xv @ lin1.weight.T + lin1.bias > 0).to(xv.dtype)
        grad = ((u @ lin2.weight) * active) @ lin1.weight  # d(u . MLP) / d(input)
        # the mean path: d(u . mean_j v_j) / d(v_j) = u / (valid slots), on every valid slot
        n = geo.slot_valid.sum(-1, keepdim=True).clamp(min=1).to(xv.dtype)
        mean_grad = (u[..., None, :] / n[..., None]) * geo.slot_valid[..., None]
        grad = grad + mean_grad.flatten(-2)
        rel = (xv * grad).unflatten(-1, (self.block_len, -1)).sum(-1).abs() * geo.slot_valid
        total = rel.sum(-1, keepdim=True)
        uniform = geo.slot_valid / geo.slot_valid.sum(-1, keepdim=True).clamp(min=1)
        return torch.where(total > 0, rel / total.clamp(min=1e-30), uniform).to(xv.dtype)
