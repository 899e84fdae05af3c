"""Exact head-output patching, fast: the same numbers as the generic engine's ``z`` site.

Axes: ``batch`` (pairs), ``pos``, ``layer``, ``head``, ``d_head``, ``d_model``, ``copy``.

:func:`patch_heads` returns exactly what ``transformer_lens.patching.
get_act_patch_attn_head_out_all_pos`` / ``_by_pos`` return for the same pairs (tested to 1e-5),
much faster:

* the output projection is linear per head, so patching head ``h`` at layer ``L`` adds
  ``(z_clean - z_corr) W_O[h]`` to the corrupted residual: no re-run of layer ``L``;
* a patch whose clean and corrupted activations are identical, or that sits after the answer
  position, cannot change the metric (causality) and is not run;
* the remaining patches run as copies in the batch dimension, from layer ``L + 1``, on positions
  up to the answer only, unembedding only the answer row; under ``torch.inference_mode``;
* after the last layer nothing but the final norm and unembedding follows, so its patches are a
  closed form on the answer rows (and only the answer position matters for ``_by_pos``).

Where the delta trick does not hold (parallel attention and MLP, post-norm blocks) it falls
back to the hook-based ``patch_sites(site="z")``.

``source=`` replaces what a patch copies in (the clean run's ``z``) by any activation of the
same shape: zeros or a mean make the same engine an ablation (:data:`zero_source`,
:func:`mean_source`), and a clean run computed elsewhere (another prompt's prefill,
:mod:`phasemech.interventions.prompts`) makes it a cross-prompt patch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.attention import CompressedAttentionMixin
from phasemech.core.device import model_device
from phasemech.interventions.contrasts import Contrast, metric_values
from phasemech.interventions.patching import (
    baseline_runs,
    check_layers,
    check_patch_inputs,
    patch_result,
    patch_sites,
    shifted_grid,
    unembed_rows,
)
from phasemech.interventions.patching_result import PatchResult
from phasemech.model.transformer import PhaseTransformer


def _fast_block(model: HookedTransformer) -> bool:
    """Blocks whose attention output is added straight to the residual (the delta trick)."""
    cfg = model.cfg
    from transformer_lens.components.transformer_block import POST_NORM_ARCHITECTURES

    return not (
        cfg.parallel_attn_mlp
        or cfg.use_normalization_before_and_after
        or cfg.original_architecture in POST_NORM_ARCHITECTURES
    )


def _finish_block(model: HookedTransformer, layer: int, mid: Tensor) -> Tensor:
    """``resid_post`` from a patched ``resid_mid`` (the layer's MLP, if any)."""
    if model.cfg.attn_only:
        return mid
    block = model.blocks[layer]
    mid = mid.contiguous()  # TL's MLP views its input flat
    return mid + block.apply_mlp(block.ln2(mid))


def _rows_ok(model: HookedTransformer) -> bool:
    """Whether the last layer can be computed at the answer rows alone (:func:`_last_rows`):
    standard blocks, no hooks on it, and attention features this file reimplements."""
    cfg = model.cfg
    block = model.blocks[-1]
    if (
        cfg.use_split_qkv_input
        or cfg.use_attn_in
        or cfg.positional_embedding_type
        not in (
            "standard",
            "rotary",
        )
    ):
        return False
    if any(isinstance(m, HookPoint) and m.has_hooks() for m in block.modules()):
        return False
    if getattr(model, "bound_prefill", None) is not None:  # its keys sit in a KV cache
        return False
    if isinstance(block.attn, CompressedAttentionMixin):
        return True
    return (
        block.attn.attn_type == "global"
        and cfg.attention_dir == "causal"
        and cfg.clip_qkv is None
        and not cfg.use_attention_sinks
        and not cfg.use_logn_attn
        and not (cfg.original_architecture or "").startswith("Olmo")
    )


def _dense_rows(attn: Any, x: Tensor, rows: Tensor) -> Float[Tensor, "batch d_model"]:
    """TransformerLens attention's output at one query row per sequence (causal, no mask)."""
    ar = torch.arange(x.shape[0], device=x.device)
    q, k, v = attn.calculate_qkv_matrices(x, x, x)
    if attn.cfg.positional_embedding_type == "rotary":
        q, k = attn.apply_rotary(q, 0, None), attn.apply_rotary(k, 0, None)
    rep = q.shape[2] // k.shape[2]  # grouped-query attention shares K/V across heads
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bhd,bkhd->bhk", q[ar, rows], k) / attn.attn_scale
    scores = apply_softcap(scores, attn.cfg.attn_scores_soft_cap)
    causal = torch.arange(x.shape[1], device=x.device)[None, None, :] <= rows[:, None, None]
    pattern = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    z = torch.einsum("bhk,bkhd->bhd", pattern.nan_to_num(0.0), v)
    return torch.einsum("bhd,hdm->bm", z, attn.W_O) + attn.b_O


def _last_rows(model: HookedTransformer, x: Tensor, rows: Tensor) -> Float[Tensor, "batch d_model"]:
    """The final residual at one position per sequence: the last block run for that query
    row only (its keys and values still come from every position)."""
    last = model.cfg.n_layers - 1
    block = model.blocks[last]
    normed = block.ln1(x)
    if isinstance(block.attn, CompressedAttentionMixin):
        model.grid_state.begin_forward(False)
        attn_out = block.attn.forward_rows(normed, rows)
    else:
        attn_out = _dense_rows(block.attn, normed, rows)
    mid = x[torch.arange(x.shape[0], device=x.device), rows] + attn_out
    return _finish_block(model, last, mid[:, None])[:, 0]


@dataclass
class _Layer:
    """One layer's patch inputs: the head-output change per pair and position, masked after
    the answer (``dz``), where it is nonzero (``differs``), and the corrupted residuals."""

    dz: Tensor  # [batch, pos, head, d_head]
    differs: Tensor  # [batch, pos, head]
    w_o: Tensor  # [head, d_head, d_model]
    resid_mid: Tensor  # [batch, pos, d_model]
    resid_post: Tensor  # [batch, pos, d_model]


def _layer_inputs(model: HookedTransformer, runs, layer: int, mid: str) -> _Layer:
    z_src, z_corr = (
        runs.src[f"blocks.{layer}.attn.hook_z"],
        runs.corr[f"blocks.{layer}.attn.hook_z"],
    )
    # causal: a patch after the answer position cannot reach it; identical z changes nothing
    pos = torch.arange(z_src.shape[1], device=z_src.device)
    upto = pos[None, :] <= runs.qpos[:, None]  # [batch, pos]
    return _Layer(
        dz=(z_src - z_corr) * upto[..., None, None],
        differs=(z_src != z_corr).any(-1) & upto[..., None],
        w_o=model.blocks[layer].attn.W_O,
        resid_mid=runs.corr[f"blocks.{layer}.{mid}"],
        resid_post=runs.corr[f"blocks.{layer}.hook_resid_post"],
    )


def _patch_last_layer(model, contrast: Contrast, runs, L: _Layer, by_pos: bool, out) -> int:
    """Closed form after the last layer: only the answer row matters. Writes ``out[0 or pos,
    head, pair]``; returns the number of patches that change anything."""
    batch, n_heads = L.dz.shape[0], L.dz.shape[2]
    ar = torch.arange(batch, device=L.dz.device)
    row_mid = L.resid_mid[ar, runs.qpos]  # [batch, d_model]
    d_row = torch.einsum("bhd,hdm->bhm", L.dz[ar, runs.qpos], L.w_o)
    rows = _finish_block(model, model.cfg.n_layers - 1, row_mid[:, None] + d_row)
    logits = unembed_rows(model, rows.reshape(batch * n_heads, -1))
    answer, foil = contrast.answer.repeat_interleave(n_heads), runs.foil.repeat_interleave(n_heads)
    got = metric_values(logits, answer, foil, runs.metric).reshape(batch, n_heads)
    changed = L.differs[ar, runs.qpos]
    got = torch.where(changed, got, runs.corrupted[:, None]).double().cpu().numpy()
    if by_pos:
        out[runs.qpos.cpu().numpy(), :, ar.cpu().numpy()] = got
    else:
        out[0] = got.T
    return int(changed.sum())


def _patch_inner_layer(
    model, contrast: Contrast, runs, layer: int, L: _Layer, by_pos: bool, max_copies: int, out
) -> int:
    """Patches of a layer before the last, as batched copies run from ``layer + 1``: ``(pair,
    head[, pos])`` whose patch can change the metric. Returns the number run."""
    if by_pos:
        b_idx, p_idx, h_idx = L.differs.nonzero(as_tuple=True)
    else:
        b_idx, h_idx = L.differs.any(1).nonzero(as_tuple=True)
        p_idx = torch.zeros_like(b_idx)
    # longest answer position first: each chunk runs only up to its own longest
    order = torch.argsort(runs.qpos[b_idx], descending=True, stable=True)
    b_idx, p_idx, h_idx = b_idx[order], p_idx[order], h_idx[order]
    for start in range(0, len(b_idx), max_copies):
        b, p, h = (t[start : start + max_copies] for t in (b_idx, p_idx, h_idx))
        x = _patched_residual(model, layer, L, b, p, h, int(runs.qpos[b].max()) + 1, by_pos)
        final = _final_rows(model, contrast, runs, layer, x, b)
        got = metric_values(
            unembed_rows(model, final), contrast.answer[b], runs.foil[b], runs.metric
        )
        out[p.cpu().numpy(), h.cpu().numpy(), b.cpu().numpy()] = got.double().cpu().numpy()
    return len(b_idx)


def _patched_residual(model, layer: int, L: _Layer, b, p, h, upto_len: int, by_pos: bool):
    """``resid_post`` of the copies: the corrupted one plus head ``h``'s output change through
    ``W_O`` (the output projection is linear per head: no re-run of the layer)."""
    if by_pos:
        mid_rows = L.resid_mid[b, p] + torch.einsum("cd,cdm->cm", L.dz[b, p, h], L.w_o[h])
        x = L.resid_post[b, :upto_len].clone()
        x[torch.arange(len(b), device=b.device), p] = _finish_block(model, layer, mid_rows)
        return x
    delta = torch.einsum("cpd,cdm->cpm", L.dz[b, :upto_len, h], L.w_o[h])
    return _finish_block(model, layer, L.resid_mid[b, :upto_len] + delta)


def _final_rows(model, contrast: Contrast, runs, layer: int, x: Tensor, b: Tensor) -> Tensor:
    """The copies' final residual at their answer rows, run from ``layer + 1``."""
    n_layers = model.cfg.n_layers
    with shifted_grid(model, contrast.corrupted_grid[b]):
        if _rows_ok(model) and isinstance(model, PhaseTransformer):
            if layer + 1 < n_layers - 1:
                x = model(x, start_at_layer=layer + 1, stop_at_layer=n_layers - 1, return_type=None)
            return _last_rows(model, x, runs.qpos[b])  # the last layer at the answer rows only
        out = model(x, start_at_layer=layer + 1, stop_at_layer=n_layers, return_type=None)
        return out[torch.arange(len(b), device=b.device), runs.qpos[b]]


@torch.inference_mode()
def patch_heads(
    model: HookedTransformer,
    contrast: Contrast,
    *,
    metric: str = "logit_diff",
    by_pos: bool = False,
    layers: Iterable[int] | None = None,
    max_copies: int = 1024,
    progress: bool = False,
    source: Callable[[str, Tensor], Tensor] | None = None,
) -> PatchResult:
    """Patch each head's output (``hook_z``) from the clean into the corrupted run, at all
    positions or one position at a time. Exact; equal to TransformerLens'
    ``get_act_patch_attn_head_out_all_pos`` / ``_by_pos`` on the same pairs, and to the
    hook-based ``patch_sites(site="z")`` it falls back to where the delta trick does not hold.
    ``source(hook_name, corrupted_z)``: what each patch copies in instead of the clean ``z``
    (same shape); the result's ``clean`` is then still the clean run's metric."""
    check_patch_inputs(model, contrast, metric)
    layers = check_layers(model, layers)
    if isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 1:
        raise ValueError(f"max_copies={max_copies!r} is invalid: expected an int >= 1")
    if not _fast_block(model):
        if source is not None:
            raise ValueError("source= needs blocks whose head outputs add to the residual")
        kw = dict(metric=metric, by_pos=by_pos, layers=layers, progress=progress)
        return patch_sites(model, contrast, site="z", max_copies=max_copies, **kw)
    contrast = contrast.to(model_device(model))  # built on the CPU; the model may sit on a GPU
    model.eval()
    mid = "hook_resid_post" if model.cfg.attn_only else "hook_resid_mid"
    names = [f"blocks.{x}.{h}" for x in layers for h in ("attn.hook_z", mid, "hook_resid_post")]
    runs = baseline_runs(model, contrast, metric, list(dict.fromkeys(names)))
    if source is not None:
        for name in (f"blocks.{x}.attn.hook_z" for x in layers):
            runs.src[name] = source(name, runs.corr[name])
    batch, seq = contrast.corrupted_tokens.shape
    values = np.full((model.cfg.n_layers, seq if by_pos else 1, model.cfg.n_heads, batch), np.nan)
    values[list(layers)] = runs.corrupted.double().cpu().numpy()  # "no change" until overwritten
    n_run = 0
    for lay in tqdm(layers, desc="patching heads", disable=not progress):
        L = _layer_inputs(model, runs, lay, mid)
        if lay == model.cfg.n_layers - 1:
            n_run += _patch_last_layer(model, contrast, runs, L, by_pos, values[lay])
        else:
            n_run += _patch_inner_layer(
                model, contrast, runs, lay, L, by_pos, max_copies, values[lay]
            )
    return patch_result("z", by_pos, metric, contrast, values, runs, layers, n_run)


def zero_source(name: str, z: Tensor) -> Tensor:
    """Zero ablation through :func:`patch_heads`: every head's output replaced by 0."""
    return torch.zeros_like(z)


def mean_source(means: dict[str, Float[Tensor, "head d_head"]]) -> Callable:
    """Mean ablation through :func:`patch_heads`: each head's output replaced by its mean
    (``means[hook_name]``, one vector per head, at every position)."""

    def source(name: str, z: Tensor) -> Tensor:
        return means[name].to(z.device, z.dtype).expand_as(z).clone()

    return source


__all__ = ["mean_source", "patch_heads", "zero_source"]
