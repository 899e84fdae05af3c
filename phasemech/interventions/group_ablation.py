"""Ablation of GROUPS of heads on a real prompt: several heads' outputs replaced in one
forward, so that heads which back each other up are knocked out together.

Axes: ``layer``, ``head``, ``d_head``, ``d_model``, ``pos`` (the rows a run computes),
``copy`` (one per mode, batched in one forward), ``unit`` (a group of heads).

A group is a tuple of ``(layer, head)``. Each layer of it gets one hook on its ``hook_z``
that writes its heads' replacements (the write of the lab's head ablation,
:mod:`~phasemech.interventions.ablation_hooks`: clone, set the head's slice; one hook per layer,
not one context per head, since every hook context's exit walks all of the model's hook
points), and the forward starts from the unablated run's residual entering the group's first
layer (``start_at_layer``: the layers before it are what they were). The modes
(:data:`GROUP_MODES`) are copies of one forward, each copy's heads replaced by:

* ``zero``: 0 at every row the run computes;
* ``mean``: the head's mean output (over every prompt's rows, as the single-head mean
  ablation of :func:`~phasemech.interventions.prompt_patching.ablate_prompt`);
* ``resample``: the head's output on ANOTHER prompt (the design model's ``hook_z`` on it, its
  own prefill bound), laid on this run's rows from the end as cross-prompt patching lays them
  (:func:`~phasemech.interventions.prompts.aligned`); rows without a counterpart keep the
  unablated run's value. Resampling from the prompt itself is the unablated run.

The read-out is :func:`~phasemech.interventions.prompt_patching.ablate_prompt`'s: the
answer's margin at the first answer token (its logit minus the best other logit; > 0 iff
greedy decoding emits it). Everything runs under :func:`~phasemech.interventions.prompts.
bound` (the decode regime's prefill shared by every copy).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from phasemech.interventions.contrasts import metric_values
from phasemech.interventions.patching import unembed_rows
from phasemech.interventions.prompts import PromptRun, aligned, bound

#: the modes of a group ablation, in the order of the copies of its forward
GROUP_MODES = ("zero", "mean", "resample")

Group = tuple[tuple[int, int], ...]


def _z(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


def check_groups(model, groups: list[Group]) -> list[Group]:
    """``groups`` as tuples of ``(layer, head)`` pairs, each non-empty and inside ``model``."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    out = []
    for g in groups:
        heads = tuple((int(a), int(b)) for a, b in g)
        bad = [u for u in heads if not (0 <= u[0] < n_layers and 0 <= u[1] < n_heads)]
        if not heads or bad or len(set(heads)) != len(heads):
            raise ValueError(
                f"group_ablate: group {list(g)!r} is invalid: expected distinct (layer, head) "
                f"pairs with layer in 0..{n_layers - 1}, head in 0..{n_heads - 1}"
            )
        out.append(heads)
    return out


@torch.inference_mode()
def _cached(model, run: PromptRun) -> tuple[dict[str, Tensor], float]:
    """The unablated run's ``hook_z`` and ``hook_resid_pre`` of every layer, and its margin."""
    n = model.cfg.n_layers
    names = {_z(i) for i in range(n)} | {f"blocks.{i}.hook_resid_pre" for i in range(n)}
    with bound(model, run):
        resid, cache = model.run_with_cache(
            run.tokens, names_filter=lambda x: x in names, stop_at_layer=n
        )
    return {k: cache[k] for k in names}, _margins(model, resid, run)[0]


def _margins(model, resid: Float[Tensor, "copy pos d_model"], run: PromptRun) -> list[float]:
    # the single-head ablation's read-out (final norm, unembed, soft cap)
    logits = unembed_rows(model, resid[:, run.row]).float()
    answer = run.answer[:1].expand(len(logits))
    return metric_values(logits.cpu(), answer.cpu(), answer.cpu(), "margin").tolist()


@torch.inference_mode()
def source_z(model, source: PromptRun) -> dict[str, Float[Tensor, "1 pos head d_head"]]:
    """The design model's ``hook_z`` of every layer on ``source`` (its prefill bound): what a
    ``resample`` ablation copies in."""
    names = {_z(i) for i in range(model.cfg.n_layers)}
    with bound(model, source):
        _, cache = model.run_with_cache(
            source.tokens, names_filter=lambda x: x in names, stop_at_layer=model.cfg.n_layers
        )
    return {k: cache[k] for k in names}


def _replacements(
    own: dict[str, Tensor], modes: list[str], means: Tensor | None, other: dict | None, unit
) -> Float[Tensor, "copy pos d_head"]:
    """One head's replacement in each copy (mode) of the forward."""
    layer, head = unit
    z = own[_z(layer)][:, :, head]  # [1, pos, d_head]
    out = []
    for mode in modes:
        if mode == "zero":
            out.append(torch.zeros_like(z))
        elif mode == "mean":
            out.append(means[layer, head].to(z.device, z.dtype).expand_as(z))
        else:
            src = other[_z(layer)][:, :, head].to(z.dtype)
            out.append(aligned(src, z))
    return torch.cat(out)


def _layer_hooks(own, modes, means, other, group: Group) -> list[tuple[str, Any]]:
    """One hook per layer of ``group``: its heads' ``hook_z`` replaced in each copy by that
    copy's mode (the lab's head ablation's write, ``ablation_hooks``: clone, then set the
    head's slice; several heads of a layer in one hook, so a group costs one hook context)."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in group:
        by_layer.setdefault(layer, []).append(head)
    hooks = []
    for layer, heads in by_layer.items():
        rep = torch.stack([_replacements(own, modes, means, other, (layer, h)) for h in heads], 2)

        def hook(z: Tensor, hook: Any, heads=heads, rep=rep) -> Tensor:
            z = z.clone()  # never write into a tensor a later hook may still hold
            z[:, :, heads] = rep.to(z.device, z.dtype)
            return z

        hooks.append((_z(layer), hook))
    return hooks


@torch.inference_mode()
def group_ablate(
    model,
    run: PromptRun,
    groups: list[Group],
    means: Float[Tensor, "layer head d_head"] | None = None,
    source: PromptRun | None = None,
) -> dict[str, Any]:
    """``{"base": margin, mode: [margin per group], ...}``: the answer's margin with each
    group's heads replaced together, in every mode the inputs allow (``zero``; ``mean`` with
    ``means``; ``resample`` with ``source``, another prompt of the same task)."""
    groups = check_groups(model, groups)
    modes = [m for m, ok in zip(GROUP_MODES, (True, means is not None, source is not None),
                                strict=True) if ok]  # fmt: skip
    own, base = _cached(model, run)
    other = source_z(model, source) if source is not None else None
    out: dict[str, Any] = {"base": base} | {m: [] for m in modes}
    n = model.cfg.n_layers
    with bound(model, run):
        for g in groups:
            start = min(layer for layer, _ in g)
            x = own[f"blocks.{start}.hook_resid_pre"].expand(len(modes), -1, -1)
            with model.hooks(fwd_hooks=_layer_hooks(own, modes, means, other, g)):
                resid = model(x, start_at_layer=start, stop_at_layer=n)
            for mode, v in zip(modes, _margins(model, resid, run), strict=True):
                out[mode].append(v)
    return out


__all__ = ["GROUP_MODES", "Group", "check_groups", "group_ablate", "source_z"]
