"""Attribution patching (AtP): a first-order estimate of every head x position patch from one
forward and one backward, and how it compares with exact patching.

Axes: ``layer``, ``pos``, ``head``, ``batch`` (pairs), ``key``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from phasemech.core.device import model_device
from phasemech.interventions.contrasts import Contrast, metric_values
from phasemech.interventions.patching import baseline_runs, check_patch_inputs, shifted_grid
from phasemech.interventions.patching_result import PatchResult


@dataclass(frozen=True)
class Attribution:
    """First-order estimates of every head x position ``hook_z`` patch.

    ``values`` ``[layer, pos, head, batch]``: estimated patched minus corrupted metric,
    ``(z_clean - z_corr) . d metric / d z`` at the corrupted run (zero after the answer);
    ``saturation`` ``[batch]``: the largest attention probability any last-layer head puts on one
    entry at the answer position in the corrupted run (AtP's known blind spot: a saturated
    softmax has almost no gradient, so first order misses patches that move it).
    """

    values: np.ndarray
    saturation: np.ndarray
    corrupted: np.ndarray
    pairs: pd.DataFrame
    metric: str


def attribution_patch(
    model: HookedTransformer,
    contrast: Contrast,
    *,
    metric: str = "logit_diff",
    batch_size: int = 128,
    progress: bool = False,
    source: Callable[[str, Tensor], Tensor] | None = None,
) -> Attribution:
    """Attribution patching (AtP): one forward and one backward per batch of pairs estimate the
    effect of patching every (layer, position, head) output. ``source(hook_name, corrupted_z)``
    replaces the clean run's ``z`` (as in :func:`~phasemech.interventions.patching_fast.
    patch_heads`)."""
    check_patch_inputs(model, contrast, metric)
    contrast = contrast.to(model_device(model))  # built on the CPU; the model may sit on a GPU
    model.eval()
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    batch, seq = contrast.corrupted_tokens.shape
    z_names = [f"blocks.{lay}.attn.hook_z" for lay in range(n_layers)]
    with torch.no_grad():  # not inference_mode: these tensors meet autograd below
        runs = baseline_runs(model, contrast, metric, z_names)
    if source is not None:
        runs.src.update({n: source(n, runs.corr[n]) for n in z_names})
    values = np.zeros((n_layers, seq, n_heads, batch))
    saturation = np.zeros(batch)
    # the last layer's attention at the answer (its saturation); nsa has three patterns and no
    # hook_pattern: its effective attention on tokens stands in
    last = model.blocks[n_layers - 1].attn
    pattern = "hook_token_pattern" if hasattr(last, "hook_branch_gate") else "hook_pattern"
    last_pattern = f"blocks.{n_layers - 1}.attn.{pattern}"
    bar = tqdm(total=batch, desc="attribution patching", disable=not progress)
    for start in range(0, batch, batch_size):
        sl = slice(start, min(start + batch_size, batch))
        ar = torch.arange(sl.stop - sl.start, device=contrast.query_pos.device)
        store: dict[str, Tensor] = {}

        def keep(act: Tensor, hook, store: dict[str, Tensor] = store) -> Tensor:
            store[hook.name] = act
            return act

        def leaf(act: Tensor, hook) -> Tensor:
            # a graph even when the weights are frozen
            return act.detach().requires_grad_(True)

        hooks = [("blocks.0.hook_resid_pre", leaf)] + [(n, keep) for n in z_names]
        hooks.append((last_pattern, keep))
        with (
            torch.enable_grad(),
            shifted_grid(model, contrast.corrupted_grid[sl]),
            model.hooks(fwd_hooks=hooks),
        ):
            logits = model(contrast.corrupted_tokens[sl])
            qpos = runs.qpos[sl]
            m = metric_values(logits[ar, qpos], contrast.answer[sl], runs.foil[sl], metric)
            grads = torch.autograd.grad(m.sum(), [store[n] for n in z_names])
        upto = (torch.arange(seq, device=qpos.device)[None, :] <= qpos[:, None])[..., None]
        for lay, (name, g) in enumerate(zip(z_names, grads, strict=True)):
            dz = runs.src[name][sl] - runs.corr[name][sl]
            est = ((dz * g).sum(-1) * upto).detach()  # [b, pos, head]
            values[lay, :, :, sl] = est.permute(1, 2, 0).double().cpu().numpy()
        pat = store[last_pattern].detach()[ar, :, qpos]  # [b, head, key]
        saturation[sl] = pat.amax((-1, -2)).double().cpu().numpy()
        bar.update(sl.stop - sl.start)
    bar.close()
    pairs = contrast.pairs.copy()
    pairs["saturation"] = saturation
    corrupted = runs.corrupted.double().cpu().numpy()
    return Attribution(values, saturation, corrupted, pairs, metric)


def compare_attribution(
    attribution: Attribution, exact: PatchResult, saturated: float = 0.95
) -> pd.DataFrame:
    """How well AtP tracks exact ``_by_pos`` patching: Pearson and Spearman correlations over
    (layer, pos, head) of pair-mean effects, and over single (pair, layer, pos, head) patches,
    overall and split by whether the pair's last-layer attention is saturated
    (``saturation >= saturated``). Entries exactly zero in both are left out."""
    from scipy.stats import pearsonr, spearmanr

    if exact.site != "z" or not exact.by_pos:
        raise ValueError("exact must come from patch_heads(..., by_pos=True)")
    if exact.values.shape[-1] != attribution.values.shape[-1]:
        raise ValueError("attribution and exact patching were run on different pairs")
    layers = list(exact.layers)
    true = exact.values[layers] - exact.corrupted  # [L', pos, head, batch]
    est = attribution.values[layers]
    rows = []

    def corr(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        keep = (x != 0) | (y != 0)
        x, y = x[keep], y[keep]
        if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
            return np.nan, np.nan
        return float(pearsonr(x, y)[0]), float(spearmanr(x, y)[0])

    sat = attribution.saturation >= saturated
    for label, sel in (("all", np.ones_like(sat)), ("saturated", sat), ("unsaturated", ~sat)):
        if not sel.any():
            continue
        for li, lay in [(None, "all")] + list(enumerate(layers)):
            t = true[..., sel] if li is None else true[li][None][..., sel]
            e = est[..., sel] if li is None else est[li][None][..., sel]
            pm_r, pm_rho = corr(t.mean(-1).ravel(), e.mean(-1).ravel())
            pp_r, pp_rho = corr(t.ravel(), e.ravel())
            rows.append(
                {
                    "pairs": label,
                    "layer": str(lay),
                    "n_pairs": int(sel.sum()),
                    "pearson_mean": pm_r,
                    "spearman_mean": pm_rho,
                    "pearson_single": pp_r,
                    "spearman_single": pp_rho,
                    "mean_abs_error": float(np.abs(t - e).mean()),
                }
            )
    return pd.DataFrame(rows)


def attribution_by_position(
    attribution: Attribution, exact: PatchResult, contrast: Contrast
) -> pd.DataFrame:
    """Where AtP's error sits: per (layer, position class) the number of patches, mean exact
    and estimated effects, mean absolute error, the share of all absolute error and Pearson r.
    Position classes relative to each pair: ``source`` (the needle token), ``query`` (the
    answer position), ``before`` the needle, ``between`` the two. Patches exactly zero in both
    are left out (nothing to estimate)."""
    if exact.values.shape != attribution.values.shape:
        raise ValueError("attribution and exact patching have different shapes: same pairs?")
    true = exact.values - exact.corrupted
    est = attribution.values
    n_layers, n_pos = true.shape[:2]
    src = contrast.pairs["source_pos"].to_numpy() + (
        contrast.shift if contrast.kind == "content" else 0
    )
    pos = np.arange(n_pos)[None, :, None, None]
    where = np.where(
        pos == src,
        "source",
        np.where(
            pos == contrast.corrupted_query_pos.cpu().numpy(),
            "query",
            np.where(pos < src, "before", "between"),
        ),
    )
    where = np.broadcast_to(where, true.shape)
    layer = np.broadcast_to(np.arange(n_layers)[:, None, None, None], true.shape)
    keep = ((true != 0) | (est != 0)) & np.isin(layer, exact.layers)
    df = pd.DataFrame(
        {"layer": layer[keep], "where": where[keep], "exact": true[keep], "atp": est[keep]}
    )
    df["abs_error"] = (df.exact - df.atp).abs()
    total = df.abs_error.sum()
    grouped = df.groupby(["layer", "where"])
    out = grouped.agg(
        n=("exact", "size"),
        mean_exact=("exact", "mean"),
        mean_atp=("atp", "mean"),
        mean_abs_error=("abs_error", "mean"),
    )
    out["share_of_error"] = grouped.abs_error.sum() / total if total > 0 else np.nan
    out["pearson"] = grouped.apply(
        lambda g: g.exact.corr(g.atp) if len(g) > 2 else np.nan, include_groups=False
    )
    return out.reset_index()


__all__ = ["Attribution", "attribution_by_position", "attribution_patch", "compare_attribution"]
