"""Activation patching, the generic engine: one unit of one site at a time, as batched copies.

Axes: ``batch`` (one clean/corrupted pair), ``pos``, ``layer``, ``head``, ``kv_head``,
``block``, ``unit`` (a head or KV head), ``copy`` (one patched run of one pair).

As TransformerLens' ``generic_activation_patch`` with its setters: a :class:`Site` names the
hooks that hold an activation and a *setter* that copies one unit of it from the clean run into
a corrupted copy; :func:`patch_sites` runs any site. Sites: ``z``, ``q`` (per head), ``k``,
``v`` (per KV head), ``pattern`` (per head, answer contrast only), ``kv_block`` (a KV head's
compressed entries, answer contrast only: under a shifted grid or content entry ``i`` covers
other tokens). A patch whose clean and corrupted slices are identical, or that sits after the
answer position, cannot change the metric (causality) and is not run; the rest run as copies in
the batch dimension from the patched layer's cached input. The sites and their setters live in
:mod:`phasemech.interventions.patching_sites`, the result in
:mod:`phasemech.interventions.patching_result`; both stay importable from here.

Effects are reported raw (patched minus corrupted) and normalised, ``(patched - corrupted) /
(clean - corrupted)`` on group means, 1 = fully restored (:class:`PatchResult`). The fast
engine for head outputs is :mod:`phasemech.interventions.patching_fast`; attribution patching
is :mod:`phasemech.interventions.attribution`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.core.device import model_device
from phasemech.interventions.contrasts import (
    METRICS,
    Contrast,
    check_choice,
    metric_values,
)
from phasemech.interventions.patching_result import PatchResult
from phasemech.interventions.patching_sites import (
    SITES,
    Site,
    block_entry_setter,
    head_pattern_setter,
    head_vector_setter,
)
from phasemech.model.transformer import PhaseTransformer


def unembed_rows(model: HookedTransformer, rows: Float[Tensor, "copy d_model"]) -> Tensor:
    """Logits of residual-stream ``rows``: the final norm (if any), unembed, soft cap."""
    if model.cfg.normalization_type is not None:
        rows = model.ln_final(rows)
    return apply_softcap(model.unembed(rows[:, None])[:, 0], model.cfg.output_logits_soft_cap)


def shifted_grid(model: HookedTransformer, shift: Tensor):
    """``shift_grid`` on a PhaseTransformer; nothing on a plain HookedTransformer."""
    if isinstance(model, PhaseTransformer):
        return model.shift_grid(shift)
    if bool((shift != 0).any()):
        raise ValueError("a grid contrast needs a PhaseTransformer (a plain model has no grid)")
    return contextlib.nullcontext()


@dataclass
class _Runs:
    """Cached clean and corrupted activations (corrupted positions; clean content-aligned)."""

    clean: Tensor  # [batch] metric
    corrupted: Tensor  # [batch]
    foil: Tensor  # [batch]
    qpos: Tensor  # [batch] answer position in the corrupted run
    metric: str
    src: dict[str, Tensor]  # hook name -> clean activation aligned to corrupted positions
    corr: dict[str, Tensor]  # hook name -> corrupted activation


def _align(clean: Tensor, corr: Tensor, shift: int, pos_dim: int = 1) -> Tensor:
    """Clean activation laid on corrupted positions (``p -> p + shift``); the first ``shift``
    positions have no clean counterpart and keep the corrupted value (not patched)."""
    if shift == 0:
        return clean
    out = corr.clone()
    n = clean.shape[pos_dim] - shift
    out.narrow(pos_dim, shift, n).copy_(clean.narrow(pos_dim, 0, n))
    return out


def baseline_runs(model: HookedTransformer, c: Contrast, metric: str, names: list[str]) -> _Runs:
    """The clean and corrupted runs of ``c``: their metric, the foil, and the activations at
    hooks ``names`` (clean ones aligned to corrupted positions for a content contrast)."""
    want = set(names)
    with shifted_grid(model, c.clean_grid):
        logits, clean_cache = model.run_with_cache(c.clean_tokens, names_filter=lambda n: n in want)
    ar = torch.arange(len(c), device=c.query_pos.device)
    clean_rows = logits[ar, c.query_pos]
    with shifted_grid(model, c.corrupted_grid):
        logits, corr_cache = model.run_with_cache(
            c.corrupted_tokens, names_filter=lambda n: n in want
        )
    qpos = c.corrupted_query_pos
    corr_rows = logits[ar, qpos]
    foil = c.foil.clone()
    if bool((foil < 0).any()):  # the corrupted run's best wrong token
        best_wrong = corr_rows.scatter(-1, c.answer[:, None], -torch.inf).argmax(-1)
        foil = torch.where(foil < 0, best_wrong, foil)
    src, corr = {}, {}
    for name in names:
        if name not in corr_cache.cache_dict:
            continue  # a hook this design never calls (route has no hook_v_block)
        corr[name] = corr_cache[name]
        pos_dim = 2 if name.endswith("hook_pattern") else 1
        src[name] = (
            _align(clean_cache[name], corr_cache[name], c.shift, pos_dim)
            if c.kind == "content"
            else clean_cache[name]
        )
    return _Runs(
        clean=metric_values(clean_rows, c.answer, foil, metric),
        corrupted=metric_values(corr_rows, c.answer, foil, metric),
        foil=foil,
        qpos=qpos,
        metric=metric,
        src=src,
        corr=corr,
    )


def check_patch_inputs(model: HookedTransformer, c: Contrast, metric: str) -> None:
    """Refuse a metric, contrast or model that cannot be patched together, before any run."""
    check_choice("metric", metric, METRICS)
    if not isinstance(c, Contrast):
        raise ValueError(f"contrast={type(c).__name__} is invalid: build one with make_contrast")
    if c.clean_tokens.shape[1] > model.cfg.n_ctx:
        raise ValueError(
            f"pairs have {c.clean_tokens.shape[1]} positions: the model takes n_ctx="
            f"{model.cfg.n_ctx}"
        )
    top = int(max(c.clean_tokens.max(), c.corrupted_tokens.max()))
    if top >= model.cfg.d_vocab:
        raise ValueError(f"token id {top} is out of the model's vocabulary ({model.cfg.d_vocab})")
    if c.kind == "grid":
        # a grid contrast must move the needle's phase on the grid the model compresses with
        comp = model.cfg.compression if isinstance(model, PhaseTransformer) else None
        if comp is None or not comp.enabled:
            raise ValueError(
                "the grid contrast needs a model with compressed layers: on a dense model the "
                "clean and corrupted runs are identical (use the answer or content contrast)"
            )
        if c.shift % comp.stride == 0:
            raise ValueError(
                f"grid shift {c.shift} is a multiple of the model's stride {comp.stride}: the "
                "corrupted grid equals the clean one (build the contrast with the model's stride)"
            )


def check_layers(model: HookedTransformer, layers: Iterable[int] | None) -> tuple[int, ...]:
    """``layers`` as sorted distinct valid layer indices (every layer when ``None``)."""
    n = model.cfg.n_layers
    if layers is None:
        return tuple(range(n))
    layers = tuple(layers)
    bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n]
    if bad or not layers:
        raise ValueError(
            f"layers={list(layers)!r} is invalid: expected layer indices in 0..{n - 1}"
        )
    return tuple(sorted(set(layers)))


def patch_result(
    site: str,
    by_pos: bool,
    metric: str,
    c: Contrast,
    values: np.ndarray,
    runs: _Runs,
    layers: tuple[int, ...],
    n_run: int,
) -> PatchResult:
    """The :class:`PatchResult` of patched ``values``, with the pairs' foil and clean and
    corrupted metrics."""
    pairs = c.pairs.copy()
    pairs["foil"] = runs.foil.cpu().numpy()
    pairs["clean"] = runs.clean.double().cpu().numpy()
    pairs["corrupted"] = runs.corrupted.double().cpu().numpy()
    return PatchResult(
        site=site,
        by_pos=by_pos,
        metric=metric,
        contrast=c.kind,
        stride=c.stride,
        values=values,
        clean=pairs["clean"].to_numpy(),
        corrupted=pairs["corrupted"].to_numpy(),
        pairs=pairs,
        layers=layers,
        n_run=n_run,
    )


def _site_layers(
    model: HookedTransformer, site: Site, contrast: Contrast, by_pos: bool, layers: Any
) -> tuple[int, ...]:
    """Check ``site`` against the contrast and ``by_pos``; the layers to patch."""
    if by_pos and not site.positional:
        raise ValueError(f"by_pos=True is invalid for site={site.name!r}: it has no position")
    if site.answer_contrast_only and contrast.kind != "answer":
        raise ValueError(
            f"site={site.name!r} needs the answer contrast (the same grid and positions in both "
            f"runs); under the {contrast.kind} contrast its entries cover different tokens and "
            "patching them would leak later tokens into earlier queries"
        )
    if not site.compressed_only:
        return check_layers(model, layers)
    compressed = sorted(model.compressed_layers()) if isinstance(model, PhaseTransformer) else []
    layers = check_layers(model, compressed if layers is None else layers)
    bad = [x for x in layers if x not in compressed]
    if bad:
        raise ValueError(
            f"layers {bad} have no compressed entries: compressed layers are {compressed}"
        )
    return layers


def _copies(site: Site, runs: _Runs, hooks: list[str], upto: Tensor, by_pos: bool):
    """``(pair, unit, pos or None)`` of every patch whose clean and corrupted slices differ (and,
    position by position, that sits at or before the answer): the others cannot change the
    metric, so they are not run."""
    diff = None
    for name in hooks:
        d = site.differs(runs.src[name] != runs.corr[name])  # [batch, unit, pos]
        d = d & upto[:, None, :] if by_pos else d.flatten(2).any(-1)
        diff = d if diff is None else diff | d
    idx = diff.nonzero(as_tuple=True)
    return idx[0], idx[1], (idx[2] if by_pos else None)


def _run_copies(
    model: HookedTransformer, contrast: Contrast, runs: _Runs, site: Site, layer: int, copy
) -> Tensor:
    """The metric of a chunk of patched copies ``(b, u, p)``, each run from the layer's cached
    corrupted input with the site's hooks overwritten."""
    b, u, p = copy
    rows = torch.arange(len(b), device=b.device)

    def put(act: Tensor, hook) -> Tensor:
        act = act.clone()
        site.setter(act, runs.src[hook.name], rows, b, u, p)
        return act

    hooks = [(name, put) for name in site.hooks(model, layer) if name in runs.corr]
    resid = runs.corr[f"blocks.{layer}.hook_resid_pre"][b]
    with shifted_grid(model, contrast.corrupted_grid[b]), model.hooks(fwd_hooks=hooks):
        out = model(resid, start_at_layer=layer, stop_at_layer=model.cfg.n_layers, return_type=None)
    logits = unembed_rows(model, out[rows, runs.qpos[b]])
    return metric_values(logits, contrast.answer[b], runs.foil[b], runs.metric)


def _check_fired(model: HookedTransformer, site: Site, layers: tuple[int, ...], runs) -> None:
    """A layer whose forward runs none of the site's hooks (``kv_block`` on a design that keeps
    no entries, ``pattern`` on ``nsa``) would patch nothing: refuse it instead."""
    silent = [x for x in layers if not any(n in runs.corr for n in site.hooks(model, x))]
    if silent:
        design = getattr(getattr(model.cfg, "compression", None), "design", "none")
        raise ValueError(
            f"site={site.name!r} is not defined for design {design!r}: layer(s) {silent} never "
            f"run {list(site.hooks(model, silent[0]))}, so patching would change nothing"
        )


@torch.inference_mode()
def patch_sites(
    model: HookedTransformer,
    contrast: Contrast,
    *,
    site: str | Site = "kv_block",
    metric: str = "logit_diff",
    by_pos: bool = False,
    layers: Iterable[int] | None = None,
    max_copies: int = 256,
    progress: bool = False,
) -> PatchResult:
    """The generic engine: patch one unit of ``site`` at a time, as batched copies run from the
    patched layer's cached input with hooks. ``site`` is a :class:`Site` or a name in
    :data:`SITES`: ``z`` / ``q`` (a head's output / query), ``k`` / ``v`` (a KV head's keys /
    values), ``pattern`` (a head's attention pattern; ``by_pos``: one query row), ``kv_block``
    (a KV head's compressed entries, every block at once). Copies whose clean and corrupted
    slices are identical, or (position-resolved) sit after the answer, are not run: they cannot
    change the metric. ``z`` is the hook-based reference of the faster :func:`patch_heads`."""
    check_patch_inputs(model, contrast, metric)
    if not isinstance(site, Site):
        check_choice("site", site, SITES)
        site = SITES[site]
    if isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 1:
        raise ValueError(f"max_copies={max_copies!r} is invalid: expected an int >= 1")
    layers = _site_layers(model, site, contrast, by_pos, layers)
    contrast = contrast.to(model_device(model))  # built on the CPU; the model may sit on a GPU
    model.eval()
    names = [n for lay in layers for n in site.hooks(model, lay)]
    runs = baseline_runs(
        model, contrast, metric, names + [f"blocks.{x}.hook_resid_pre" for x in layers]
    )
    _check_fired(model, site, layers, runs)
    batch, seq = contrast.corrupted_tokens.shape
    values = np.full((model.cfg.n_layers, seq if by_pos else 1, site.n_units(model), batch), np.nan)
    values[list(layers)] = runs.corrupted.double().cpu().numpy()
    upto = torch.arange(seq, device=runs.qpos.device)[None, :] <= runs.qpos[:, None]  # [batch, pos]
    n_run = 0
    for lay in tqdm(layers, desc=f"patching {site.name}", disable=not progress):
        hooks = [n for n in site.hooks(model, lay) if n in runs.corr]
        b_idx, u_idx, p_idx = _copies(site, runs, hooks, upto, by_pos)
        for start in range(0, len(b_idx), max_copies):
            chunk = slice(start, start + max_copies)
            b, u = b_idx[chunk], u_idx[chunk]
            p = None if p_idx is None else p_idx[chunk]
            got = _run_copies(model, contrast, runs, site, lay, (b, u, p))
            pos_idx = np.zeros(len(b), dtype=int) if p is None else p.cpu().numpy()
            values[lay, pos_idx, u.cpu().numpy(), b.cpu().numpy()] = got.double().cpu().numpy()
            n_run += len(b)
    return patch_result(site.name, by_pos, metric, contrast, values, runs, layers, n_run)


#: TransformerLens-style shorthands of the engine
patch_kv_blocks = partial(patch_sites, site="kv_block")
patch_patterns = partial(patch_sites, site="pattern")


__all__ = [
    "SITES",
    "PatchResult",
    "Site",
    "block_entry_setter",
    "head_pattern_setter",
    "head_vector_setter",
    "patch_kv_blocks",
    "patch_patterns",
    "patch_sites",
    "baseline_runs",
    "check_layers",
    "check_patch_inputs",
    "shifted_grid",
    "unembed_rows",
    "patch_result",
]
