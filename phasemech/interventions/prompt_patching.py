"""Head ablation and cross-phase patching on real prompts, through the lab's engines.

Axes: ``layer``, ``head``, ``d_head``, ``pos`` (rows a run computes), ``copy``.

Each function takes :class:`~phasemech.interventions.prompts.PromptRun` s and calls the lab's
engines under :func:`~phasemech.interventions.prompts.bound`; nothing here re-implements a
patch:

* :func:`ablate_prompt`: zero and mean ablation of every head, as
  :func:`~phasemech.interventions.patching_fast.patch_heads` with a zero or mean ``source``
  (a head's output replaced at every row the run computes), read as the answer's margin at the
  first answer token (its logit minus the best other logit: > 0 iff greedy decoding emits it);
* :func:`patch_pair`: a clean prompt (the content at its strong phase) into a corrupted one
  (the same content at its weak phase): every head's output (``patch_heads``), every layer's
  residual stream, and attribution patching over all heads
  (:func:`~phasemech.interventions.attribution.attribution_patch`), and for a selecting design
  each layer's selection (:func:`~phasemech.interventions.oracle.copy_selection`); the metric
  is the answer's logit difference against the corrupted run's best wrong token.
* :func:`z_sums`: per-head sums of ``hook_z`` over a run's rows (the mean ablation's means).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from phasemech.attention.selection import SelectingAttention
from phasemech.interventions.attribution import attribution_patch
from phasemech.interventions.contrasts import metric_values
from phasemech.interventions.oracle import copy_selection
from phasemech.interventions.patching_fast import mean_source, patch_heads, zero_source
from phasemech.interventions.prompts import (
    PromptRun,
    aligned,
    bound,
    clean_run,
    cross_source,
    self_contrast,
)


def _z(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


@torch.inference_mode()
def z_sums(model, run: PromptRun) -> tuple[Float[Tensor, "layer head d_head"], int]:
    """Per layer and head, the sum of ``hook_z`` over the run's rows, and the number of rows."""
    names = [_z(i) for i in range(model.cfg.n_layers)]
    with bound(model, run):
        _, cache = model.run_with_cache(run.tokens, names_filter=lambda n: n in set(names))
    sums = torch.stack([cache[n][0].double().sum(0) for n in names])
    return sums, int(run.tokens.shape[1])


def ablate_prompt(
    model, run: PromptRun, stride: int, means: Float[Tensor, "layer head d_head"] | None
) -> dict[str, Any]:
    """``{"base": margin, "zero": [layer, head], "mean": [layer, head]}`` (``mean`` only with
    ``means``): the answer's margin with each head's output replaced."""
    c = self_contrast(run, stride)
    out: dict[str, Any] = {}
    sources = {"zero": zero_source}
    if means is not None:
        sources["mean"] = mean_source({_z(i): means[i] for i in range(model.cfg.n_layers)})
    for mode, source in sources.items():
        with bound(model, run):
            res = patch_heads(model, c, metric="margin", source=source)
        out["base"] = float(res.corrupted[0])
        out[mode] = res.values[:, 0, :, 0].tolist()
    return out


@torch.inference_mode()
def resid_patch(model, clean, corrupt: PromptRun, answer: int, foil: int) -> list[float]:
    """The metric with the clean residual stream (aligned) entering each layer."""
    n = model.cfg.n_layers
    out = []
    with bound(model, corrupt):
        _, cache = model.run_with_cache(
            corrupt.tokens, names_filter=lambda x: x.endswith("hook_resid_pre")
        )
        for layer in range(n):
            name = f"blocks.{layer}.hook_resid_pre"
            x = aligned(clean.acts[name], cache[name])
            resid = model(x, start_at_layer=layer, stop_at_layer=n)
            lg = model.unembed(model.ln_final(resid[:, corrupt.row]))
            out.append(_metric(lg, answer, foil))
    return out


def _metric(logits: Tensor, answer: int, foil: int) -> float:
    ans, fo = torch.tensor([answer]), torch.tensor([foil])
    return float(metric_values(logits.float().cpu(), ans, fo, "logit_diff")[0])


def _selection_patch(model, clean, corrupt: PromptRun, answer: int, foil: int) -> dict[str, Any]:
    """The metric with the clean selection in each selecting layer (NaN elsewhere), in all of
    them (``selection_all``), and the blocks kept per query and head under each copy."""
    labels, logits, kept = copy_selection(model, clean, corrupt)
    got = [_metric(lg[None], answer, foil) for lg in logits]
    per_layer = [float("nan")] * model.cfg.n_layers
    kept_layer = list(per_layer)
    for label, v, k in zip(labels[:-1], got[:-1], kept[:-1].tolist(), strict=True):
        layer = int(label.split()[1])
        per_layer[layer], kept_layer[layer] = v, k
    return dict(selection=per_layer, selection_all=got[-1], selection_kept=kept_layer,
                selection_kept_all=float(kept[-1]))  # fmt: skip


def patch_pair(
    model, clean: PromptRun, corrupt: PromptRun, stride: int, atp: bool = True
) -> dict[str, Any]:
    """The clean prompt patched into the corrupted one (same content, other phase): ``clean``,
    ``corrupted`` (metrics of the two runs), ``foil``, ``heads`` ``[layer, head]`` (exact),
    ``resid`` ``[layer]``, for a selecting design ``selection`` ``[layer]`` (NaN in layers that
    select nothing) and ``selection_all``, and, with ``atp``, ``atp`` ``[layer, head]``
    (first-order estimates of the head patches, summed over rows)."""
    n = model.cfg.n_layers
    names = [_z(i) for i in range(n)] + [f"blocks.{i}.hook_resid_pre" for i in range(n)]
    cl = clean_run(model, clean, names)
    c = self_contrast(corrupt, stride)
    with bound(model, corrupt), torch.inference_mode():
        res = patch_heads(model, c, metric="logit_diff", source=cross_source(cl))
    foil = int(res.pairs["foil"].iloc[0])
    answer = int(corrupt.answer[0])
    out = {
        "clean": cl.metric(answer, foil),
        "corrupted": float(res.corrupted[0]),
        "foil": foil,
        "heads": res.values[:, 0, :, 0].tolist(),
        "resid": resid_patch(model, cl, corrupt, answer, foil),
    }
    if any(isinstance(b.attn, SelectingAttention) for b in model.blocks):
        out |= _selection_patch(model, clean, corrupt, answer, foil)
    if atp:
        with bound(model, corrupt):
            est = attribution_patch(model, c, metric="logit_diff", source=cross_source(cl))
        out["atp"] = np.asarray(est.values[:, :, :, 0].sum(1)).tolist()
    return out


__all__ = ["ablate_prompt", "patch_pair", "resid_patch", "z_sums"]
