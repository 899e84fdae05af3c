"""One fused Q/K/V projection for training steps (TransformerLens projects Q, K and V with
three matmuls, one per weight).

Axes: ``batch, pos, head, d_model, d_head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

#: architectures whose QK-norm TransformerLens applies to whole projected vectors in ``forward``
OLMO_QK_NORM = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")


def fused_qkv(
    attn: nn.Module, x: Float[Tensor, "batch pos d_model"], key_input: Tensor, value_input: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``calculate_qkv_matrices`` as one matmul when the three inputs are one tensor (no split
    inputs, no grouped-query heads, no QK norm or clip, no 4-bit weights); ``hook_q/k/v`` still
    run.
    Falls back to TransformerLens' three projections otherwise."""
    c = attn.cfg
    if (
        x is not key_input
        or x is not value_input
        or x.ndim != 3
        or c.n_key_value_heads is not None
        or c.use_qk_norm
        or c.clip_qkv is not None
        or c.original_architecture in OLMO_QK_NORM
        or c.load_in_4bit
    ):
        return attn.calculate_qkv_matrices(x, key_input, value_input)
    w = torch.cat([attn.W_Q, attn.W_K, attn.W_V], dim=0)  # [3 * head, d_model, d_head]
    b = torch.cat([attn.b_Q, attn.b_K, attn.b_V], dim=0)  # [3 * head, d_head]
    h, dh = attn.W_Q.shape[0], attn.W_Q.shape[-1]
    out = F.linear(x, w.transpose(1, 2).reshape(-1, w.shape[1]), b.reshape(-1))
    q, k, v = out.view(x.shape[0], x.shape[1], 3, h, dh).unbind(2)
    return attn.hook_q(q), attn.hook_k(k), attn.hook_v(v)


__all__ = ["OLMO_QK_NORM", "fused_qkv"]
