"""The phase gap (best minus worst phase): raw and split-half debiased, with its cluster
bootstrap CI and permutation null; the design guard; paired comparisons of two settings' gaps;
and the paired test over the shifted copies of one content.

Axes: ``cluster``, ``phase``, ``replicate``, ``split``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps
from statsmodels.stats.contingency_tables import cochrans_q

from phasemech.core.validation import check_int
from phasemech.measure.stats.targets import (
    Targets,
    check_alpha,
    cluster_weights,
    content_seed_counts,
    depth_bins,
    half_masks,
    load_targets,
    percentile_ci,
    ratio_or_nan,
    raw_gap,
    split_gap,
)


def phase_gap_on_targets(
    t: Targets,
    n_perm: int,
    n_boot: int,
    n_splits: int,
    seed: Any,
    alpha: float,
    n_depth_bins: int,
) -> dict:
    """:func:`phase_gap` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
    # Independent streams, so changing n_perm does not move the bootstrap draws and vice versa.
    perm_rng, split_rng, boot_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    k, n = t.phase_counts()
    p = ratio_or_nan(k, n)
    raw = float(raw_gap(p))
    seen = n > 0
    argmax = int(np.argmax(np.where(seen, p, -np.inf)))
    argmin = int(np.argmin(np.where(seen, p, np.inf)))
    null_median, null_p95, p_perm = _permutation_null(t, n, raw, n_perm, n_depth_bins, perm_rng)
    kc, nc = t.cluster_counts()  # (C, d)
    debiased = _split_sample_gap(t, k, n, kc, nc, n_splits, split_rng)
    lo, hi = _bootstrap_split_gap(t, kc, nc, n_boot, n_splits, alpha, boot_rng)
    return {
        "raw_gap": raw,
        "argmax_phase": argmax,
        "argmin_phase": argmin,
        "null_median": null_median,
        "null_p95": null_p95,
        "p_perm": p_perm,
        "debiased_gap": debiased,
        "debiased_lo": lo,
        "debiased_hi": hi,
        "harmonic_p2p": _harmonic_p2p(k, n, p, t.stride),
        "n_perm": n_perm,
        "n_boot": n_boot,
    }


def _permutation_null(
    t: Targets,
    n: np.ndarray,
    raw: float,
    n_perm: int,
    n_depth_bins: int,
    rng: np.random.Generator,
) -> tuple[float, float, float]:
    """``(null_median, null_p95, p_perm)`` of the raw gap; NaN when ``n_perm == 0``.

    Shuffling phase labels within a (seed, depth bin) stratum keeps each stratum's phase counts
    and number correct, so a phase's correct count is the sum over strata of a multivariate
    hypergeometric draw: exact, and no target-level shuffling.
    """
    if not n_perm:
        return math.nan, math.nan, math.nan
    stratum = t.seed * n_depth_bins + depth_bins(t.depth, n_depth_bins)
    k_perm = np.zeros((n_perm, t.stride))  # (B, d)
    for s in np.unique(stratum):
        rows = stratum == s
        colors = np.bincount(t.phase[rows], minlength=t.stride)
        k_perm += rng.multivariate_hypergeometric(colors, int(t.correct[rows].sum()), size=n_perm)
    null = raw_gap(ratio_or_nan(k_perm, n))
    null_median, null_p95 = (float(q) for q in np.quantile(null, [0.5, 0.95]))
    # 1e-12: equal gaps differ by round-off; ties count against the observed gap.
    p_perm = float((1 + np.sum(null >= raw - 1e-12)) / (n_perm + 1))
    return null_median, null_p95, p_perm


def _split_sample_gap(
    t: Targets,
    k: np.ndarray,
    n: np.ndarray,
    kc: np.ndarray,
    nc: np.ndarray,
    n_splits: int,
    rng: np.random.Generator,
) -> float:
    """The split-sample gap on halves of the sequences (clusters never straddle halves)."""
    masks = half_masks(rng, t.cluster_seed, n_splits).astype(float)  # (splits, C)
    k_a, n_a = masks @ kc, masks @ nc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(np.nanmean(split_gap(k_a, n_a, k - k_a, n - n_a)))


def _bootstrap_split_gap(
    t: Targets,
    kc: np.ndarray,
    nc: np.ndarray,
    n_boot: int,
    n_splits: int,
    alpha: float,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Cluster-bootstrap interval of the split-sample gap; NaN when ``n_boot == 0``.

    Each replicate reweights clusters and is split afresh. Only n_inner = 2 splits per
    replicate, to keep the cost down; their mean varies more than a mean over n_splits splits,
    by E[Var(gap | data)] * (1/n_inner - 1/n_splits) (law of total variance). That split
    variance is estimated from the spread of the inner splits and the replicates are shrunk
    about their mean to remove it; left in, it made the interval ~1.7x too wide (d=8, 500
    targets per phase, no phase effect).
    """
    if not n_boot:
        return math.nan, math.nan
    n_inner = min(n_splits, 2)
    w = cluster_weights(rng, t.cluster_seed, n_boot).astype(float)  # (B, C)
    k_w, n_w = w @ kc, w @ nc  # (B, d)
    inner = np.empty((n_inner, n_boot))
    for j in range(n_inner):
        wa = w * half_masks(rng, t.cluster_seed, n_boot)  # (B, C)
        k_a, n_a = wa @ kc, wa @ nc
        inner[j] = split_gap(k_a, n_a, k_w - k_a, n_w - n_a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reps = np.nanmean(inner, axis=0)  # (B,)
        if n_inner < n_splits:
            split_var = np.nanmean(np.var(inner, axis=0, ddof=1))
            total_var = np.nanvar(reps)
            excess = split_var * (1 / n_inner - 1 / n_splits)
            if total_var > 0:
                shrink = math.sqrt(max(total_var - excess, 0.0) / total_var)
                reps = np.nanmean(reps) + shrink * (reps - np.nanmean(reps))
    lo, hi = (float(v) for v in percentile_ci(reps, alpha))
    return lo, hi


def _harmonic_p2p(k: np.ndarray, n: np.ndarray, p: np.ndarray, d: int) -> float:
    """``2 |A_1|`` with its noise floor removed; NaN if a phase has no target.

    E|A_1|^2 = |true A_1|^2 + E_noise under independent targets, E_noise = (4 / d^2) p_bar
    (1 - p_bar) sum_phi 1 / n_phi, which is 4 p_bar (1 - p_bar) / (d n) for equal counts n.
    """
    if not (n > 0).all():
        return math.nan
    a1 = (2 / d) * abs((p * np.exp(-2j * np.pi * np.arange(d) / d)).sum())
    p_bar = k.sum() / n.sum()
    noise = 4 / d**2 * p_bar * (1 - p_bar) * (1 / n).sum()
    return float(2 * math.sqrt(max(a1**2 - noise, 0.0)))


def phase_gap(
    df: pd.DataFrame,
    stride: int,
    *,
    n_perm: int = 1000,
    n_boot: int = 1000,
    n_splits: int = 20,
    seed: int = 0,
    alpha: float = 0.05,
    n_depth_bins: int = 5,
) -> dict:
    """The phase gap ``G = max_phi p - min_phi p``, its null, and two debiased versions.

    Keys:

    * ``raw_gap``, ``argmax_phase``, ``argmin_phase``: on all data (biased upward: noise alone
      makes ``max - min`` positive);
    * ``null_median``, ``null_p95``, ``p_perm``: the raw gap's permutation null, phase labels
      shuffled within (seed x depth bin) strata (``n_depth_bins`` equal-width bins), and the
      permutation p-value ``(1 + #{null >= G}) / (1 + n_perm)``;
    * ``debiased_gap``: split-sample gap, choose argmax / argmin phases on a random half of the
      sequences (split within seeds), measure them on the other half, swap, average; averaged
      over ``n_splits`` random splits. Centred near 0 with no phase effect; shrinks towards 0
      when the best / worst phases are hard to pick;
    * ``debiased_lo``, ``debiased_hi``: cluster-bootstrap percentile interval of the debiased
      gap (2 splits inside each replicate, to keep the cost down, with the extra split noise
      that leaves in the replicates removed by a variance correction);
    * ``harmonic_p2p``: ``2 |A_1|`` with its noise term removed,
      ``2 sqrt(max(|A_1|^2 - E_noise, 0))`` (NaN if a phase has no target);
    * ``n_perm``, ``n_boot``.

    ``n_perm=0`` / ``n_boot=0`` skip those parts (NaN).
    """
    where = "phase_gap"
    t = load_targets(df, stride, where)
    n_perm = check_int(where, "n_perm", n_perm, 0)
    n_boot = check_int(where, "n_boot", n_boot, 0)
    n_splits = check_int(where, "n_splits", n_splits, 1)
    n_depth_bins = check_int(where, "n_depth_bins", n_depth_bins, 1)
    alpha = check_alpha(where, alpha)
    return phase_gap_on_targets(t, n_perm, n_boot, n_splits, seed, alpha, n_depth_bins)


def design_guard_on_targets(t: Targets, n_bins: int) -> dict:
    """:func:`design_guard` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
    d = t.stride
    counts = np.bincount(t.phase, minlength=d)
    uniform_p = float(sps.chisquare(counts).pvalue)
    table = np.zeros((d, n_bins), dtype=np.int64)  # (phase, depth bin)
    np.add.at(table, (t.phase, depth_bins(t.depth, n_bins)), 1)
    table = table[table.sum(1) > 0][:, table.sum(0) > 0]  # drop empty phases and depth bins
    note = None
    if min(table.shape) < 2:
        independence_p = math.nan
        note = f"phase x depth table is {table.shape[0]} x {table.shape[1]} after dropping empties"
    else:
        independence_p = float(sps.chi2_contingency(table, correction=False).pvalue)
    return {
        "uniform_p": uniform_p,
        "independence_p": independence_p,
        "counts": [int(c) for c in counts],
        "note": note,
    }


def design_guard(df: pd.DataFrame, stride: int, n_bins: int = 5) -> dict:
    """Is the design fair? Target phases should be uniform and independent of depth.

    ``uniform_p``: chi-square goodness of fit of the phase counts to uniform; ``independence_p``:
    chi-square test of the phase x depth-bin table (``n_bins`` equal-width bins, empty rows and
    columns dropped; NaN with a ``note`` if fewer than 2 remain); ``counts``: targets per phase.
    Small p-values flag a design whose phase effect could be a depth or sampling artefact.
    With tens of thousands of targets even harmless imbalances give small p: read the counts.
    """
    t = load_targets(df, stride, "design_guard", ("phase", "depth"))
    return design_guard_on_targets(t, check_int("design_guard", "n_bins", n_bins, 1))


#: the quantities :func:`compare_gaps` gives a bootstrap interval for
_CI_KEYS = ("accuracy_diff", "gap_other", "reduction")


def compare_gaps(
    baseline: pd.DataFrame,
    other: pd.DataFrame,
    stride: int,
    *,
    n_boot: int = 1000,
    n_splits: int = 20,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """Does ``other`` (a fix) shrink the phase gap of ``baseline``, and at what cost in accuracy?

    Both frames hold targets of the *same* test set scored by different models: columns
    ``correct``, ``phase``, ``seq_id`` (the test content, shared by both frames: a content seen
    at several shifts is one cluster) and optionally ``seed`` (the trained model). Returns the
    mean accuracies and their difference ``other - baseline``, the debiased (split-sample) gaps
    and the relative reduction ``1 - gap_other / gap_baseline``, with percentile intervals from
    a paired cluster bootstrap: contents are resampled once for both frames (they share the test
    set), seeds independently for each (different models). Each replicate uses 2 random halves
    for its split gap, which widens the interval slightly (conservative). ``reduction_dropped``:
    the share of replicates whose baseline gap was not positive (no reduction defined; the
    interval is over the rest); the interval is NaN when the point estimate is.
    """
    where = "compare_gaps"
    stride = check_int(where, "stride", stride, 2)
    n_boot = check_int(where, "n_boot", n_boot, 0)
    n_splits = check_int(where, "n_splits", n_splits, 1)
    alpha = check_alpha(where, alpha)
    ka, na, kb, nb = _paired_counts(baseline, other, stride, where)
    split_rng, boot_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    acc_a, gap_a = _point_split_gap(ka, na, n_splits, split_rng)
    acc_b, gap_b = _point_split_gap(kb, nb, n_splits, split_rng)
    out = {
        "accuracy_baseline": acc_a,
        "accuracy_other": acc_b,
        "accuracy_diff": acc_b - acc_a,
        "gap_baseline": gap_a,
        "gap_other": gap_b,
        "reduction": 1 - gap_b / gap_a if gap_a > 0 else math.nan,
        "n_boot": n_boot,
    }
    if not n_boot:
        return out | {f"{key}_{end}": math.nan for key in _CI_KEYS for end in ("lo", "hi")}
    reps = _paired_bootstrap(ka, na, kb, nb, n_boot, boot_rng)
    return out | _paired_intervals(reps, out["reduction"], alpha)


def _paired_counts(
    baseline: pd.DataFrame, other: pd.DataFrame, stride: int, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Check both frames; ``k, n`` per (seed, content, phase) of each, ``(S, C, d)``, with
    content codes shared by the two frames."""
    cols = ("correct", "phase", "seq_id")
    ta = load_targets(baseline, stride, f"{where} (baseline)", cols)
    tb = load_targets(other, stride, f"{where} (other)", cols)
    only = set(baseline["seq_id"]) ^ set(other["seq_id"])
    if only:
        raise ValueError(
            f"{where}: the frames must score the same test set (the bootstrap pairs them by "
            f"seq_id), but {len(only)} seq_id value(s) are in only one, e.g. {sorted(only)[:3]}"
        )
    codes, uniq = pd.factorize(pd.concat([baseline["seq_id"], other["seq_id"]]), sort=True)
    ca, cb = codes[: len(baseline)], codes[len(baseline) :]
    n_contents = len(uniq)
    counts = [*content_seed_counts(ta, ca), *content_seed_counts(tb, cb)]
    ka, na, kb, nb = (np.pad(x, ((0, 0), (0, n_contents - x.shape[1]), (0, 0))) for x in counts)
    return ka, na, kb, nb


def _split_gaps(
    w_seed: np.ndarray, w_content: np.ndarray, k: np.ndarray, n: np.ndarray, masks: np.ndarray
) -> np.ndarray:
    """The split gap of each replicate: ``w_seed (B, S)``, ``w_content`` and ``masks (B, C)``,
    counts ``k, n (S, C, d)``."""
    full_k = np.einsum("bs,bc,scp->bp", w_seed, w_content, k)
    full_n = np.einsum("bs,bc,scp->bp", w_seed, w_content, n)
    half_k = np.einsum("bs,bc,scp->bp", w_seed, w_content * masks, k)
    half_n = np.einsum("bs,bc,scp->bp", w_seed, w_content * masks, n)
    return split_gap(half_k, half_n, full_k - half_k, full_n - half_n)


def _point_split_gap(
    k: np.ndarray, n: np.ndarray, n_splits: int, rng: np.random.Generator
) -> tuple[float, float]:
    """``(accuracy, split gap averaged over n_splits random halves of the contents)``."""
    # contents are split as one pool: the masks ignore seeds (every seed is split alike)
    one_seed = np.zeros(k.shape[1], dtype=np.int64)
    masks = half_masks(rng, one_seed, n_splits).astype(float)
    ones_s = np.ones((n_splits, k.shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gap = float(np.nanmean(_split_gaps(ones_s, np.ones_like(masks), k, n, masks)))
    return float(k.sum() / n.sum()), gap


def _paired_bootstrap(
    ka: np.ndarray,
    na: np.ndarray,
    kb: np.ndarray,
    nb: np.ndarray,
    n_boot: int,
    rng: np.random.Generator,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(accuracy, split gap)]`` replicates ``(B,)`` of baseline and other: contents drawn once
    for both (they share the test set), seeds independently for each (different models)."""
    n_contents = ka.shape[1]
    one_seed = np.zeros(n_contents, dtype=np.int64)
    w_c = rng.multinomial(n_contents, np.full(n_contents, 1 / n_contents), size=n_boot).astype(
        float
    )
    reps = []
    for k, n in ((ka, na), (kb, nb)):
        s = k.shape[0]
        w_s = rng.multinomial(s, np.full(s, 1 / s), size=n_boot).astype(float)
        gaps = [_split_gaps(w_s, w_c, k, n, half_masks(rng, one_seed, n_boot)) for _ in range(2)]
        acc = np.einsum("bs,bc,scp->b", w_s, w_c, k) / np.einsum("bs,bc,scp->b", w_s, w_c, n)
        reps.append((acc, np.mean(gaps, axis=0)))
    return reps


def _paired_intervals(
    reps: list[tuple[np.ndarray, np.ndarray]], reduction: float, alpha: float
) -> dict:
    """``reduction_dropped`` and the percentile intervals ``{key}_lo, {key}_hi`` of
    ``_CI_KEYS`` from the baseline and other replicates of :func:`_paired_bootstrap`."""
    (acc_a, gap_a), (acc_b, gap_b) = reps
    with np.errstate(divide="ignore", invalid="ignore"):
        red = np.where(gap_a > 0, 1 - gap_b / gap_a, np.nan)
    # a replicate without a positive baseline gap has no reduction: the interval is
    # conditional on the others, so say how many were left out
    out = {"reduction_dropped": float(np.mean(np.isnan(red)))}
    if not np.isfinite(reduction):
        red = np.full_like(red, np.nan)
    for key, x in zip(_CI_KEYS, (acc_b - acc_a, gap_b, red), strict=True):
        out[f"{key}_lo"], out[f"{key}_hi"] = (float(v) for v in percentile_ci(x, alpha))
    return out


def paired_phase_test(df: pd.DataFrame, stride: int) -> dict:
    """Cochran's Q: does accuracy depend on phase when each target is seen at every phase?

    Needs a ``pair_id`` column naming the *block* of one target measured at several phases,
    e.g. the ``stride`` shifted copies of one needle in a phase-balanced set (a block seen ``m``
    times per phase is split into ``m`` blocks). Blocks that do not hold exactly one target at
    every phase are dropped (counted in ``dropped``). This is the
    exact within-content test: content, depth and distance are identical inside a block, so
    only the phase (and the absolute position) differs. Returns ``statistic, dof, p, blocks,
    dropped, discordant, note``; p is NaN without ``pair_id`` and 1 when no block is discordant.
    """
    t = load_targets(df, stride, "paired_phase_test", ("correct", "phase"))
    return paired_phase_test_on_targets(
        t, df["pair_id"].to_numpy() if "pair_id" in df.columns else None
    )


def paired_phase_test_on_targets(t: Targets, pair_id: np.ndarray | None) -> dict:
    """:func:`paired_phase_test` on checked :func:`load_targets` output; ``pair_id``:
    per row, or ``None`` where the frame has none."""
    d = t.stride
    out = {
        "statistic": math.nan,
        "dof": d - 1,
        "p": math.nan,
        "blocks": 0,
        "dropped": 0,
        "discordant": 0,
        "note": None,
    }
    if pair_id is None:
        out["note"] = "no pair_id column: no paired design"
        return out
    # A block seen twice per phase (8 shifts on a stride-4 grid) is split into sub-blocks:
    # the j-th copy at each phase goes to sub-block j.
    frame = pd.DataFrame({"pair": pair_id, "phase": t.phase})
    sub = frame.groupby(["pair", "phase"]).cumcount().to_numpy()
    block = pd.factorize(pd.MultiIndex.from_arrays([frame["pair"], sub]), sort=True)[0]
    n_blocks = int(block.max()) + 1
    seen = np.zeros((n_blocks, d), dtype=np.int64)
    np.add.at(seen, (block, t.phase), 1)
    complete = (seen == 1).all(axis=1)
    x = np.zeros((n_blocks, d))
    np.add.at(x, (block, t.phase), t.correct)
    x = x[complete]
    out["blocks"], out["dropped"] = int(complete.sum()), int((~complete).sum())
    row = x.sum(axis=1)
    discordant = (row > 0) & (row < d)
    out["discordant"] = int(discordant.sum())
    if out["blocks"] == 0:
        out["note"] = "no complete block (one target at every phase)"
    elif out["discordant"] == 0:
        out.update(statistic=0.0, p=1.0, note="every block is all right or all wrong")
    else:
        res = cochrans_q(x[discordant])
        out.update(statistic=float(res.statistic), p=float(res.pvalue))
    return out


__all__ = [
    "compare_gaps",
    "design_guard",
    "design_guard_on_targets",
    "paired_phase_test",
    "paired_phase_test_on_targets",
    "phase_gap",
    "phase_gap_on_targets",
]
