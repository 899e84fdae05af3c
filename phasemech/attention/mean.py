"""``mean``: mean pooling of K and V per block (fla-org NSA compressed branch, MoBA's block key).

Axes: ``batch, kv_head, block, slot``. ``K_b = mean_j k_j`` and ``V_b = mean_j v_j`` over the
block's real tokens; keys are pooled after RoPE for rotary models (fla-org). No parameters, so it
applies post hoc to any pretrained model. Token attribution is exact: ``A[b, j] = 1/|b|``.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from phasemech.attention.base import CompressedAttentionMixin
from phasemech.core.grid import Geometry


def mean_weights(geo: Geometry) -> Float[Tensor, "batch kv_head block slot"]:
    """Uniform weights over each block's real tokens."""
    valid = geo.slot_valid.float()
    # A block of only padding gets all-zero weights (count clamped: no 0/0).
    return valid / valid.sum(-1, keepdim=True).clamp(min=1.0)


class MeanPoolAttention(CompressedAttentionMixin):
    design = "mean"

    def pooling_weights(
        self, x: Tensor | None, geo: Geometry
    ) -> Float[Tensor, "batch kv_head block slot"]:
        return mean_weights(geo)
