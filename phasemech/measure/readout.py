"""Reading a model's answers: logits at the answer positions only.

Axes: ``batch`` (sequences), ``pos`` (token positions), ``target`` (answers per sequence),
``vocab``.
"""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.utilities import apply_softcap

from phasemech.model.transformer import PhaseTransformer


def answer_logits(
    model: PhaseTransformer,
    tokens: Int[Tensor, "batch pos"],
    query_pos: Int[Tensor, "batch target"],
) -> Float[Tensor, "batch target vocab"]:
    """Logits at the answer positions only (the unembedding runs on those rows alone)."""
    resid = model(tokens, return_type=None, stop_at_layer=model.cfg.n_layers)
    query_pos = query_pos.to(resid.device)  # the logits live where the model does
    picked = resid.gather(1, query_pos[..., None].expand(-1, -1, resid.shape[-1]))
    if model.cfg.normalization_type is not None:  # per-position norms: same as on all positions
        picked = model.ln_final(picked)
    return apply_softcap(model.unembed(picked), model.cfg.output_logits_soft_cap)


__all__ = ["answer_logits"]
