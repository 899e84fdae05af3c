"""Accuracy with intervals: Wilson and Newcombe intervals, per phase with cluster-bootstrap CIs,
and by depth bin.

Axes: ``phase``, ``replicate`` (bootstrap draws), ``cluster``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from statsmodels.stats.proportion import confint_proportions_2indep, proportion_confint

from phasemech.core.validation import check_int
from phasemech.measure.stats.targets import (
    Targets,
    check_alpha,
    cluster_weights,
    depth_bins,
    load_targets,
    percentile_ci,
    ratio_or_nan,
)


def wilson_ci(k: Any, n: Any, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for ``k`` successes of ``n`` (broadcasting); NaN where ``n == 0``."""
    alpha = check_alpha("wilson_ci", alpha)
    k, n = np.broadcast_arrays(np.asarray(k, dtype=float), np.asarray(n, dtype=float))
    if (k < 0).any() or (k > n).any():
        raise ValueError("wilson_ci: need 0 <= k <= n")
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = proportion_confint(k, n, alpha=alpha, method="wilson")
    empty = n == 0
    return np.where(empty, np.nan, lo), np.where(empty, np.nan, hi)


def newcombe_diff(
    k1: int, n1: int, k2: int, n2: int, alpha: float = 0.05
) -> tuple[float, float, float]:
    """``(p1 - p2, lo, hi)`` with Newcombe's hybrid score interval (his method 10).

    For a pre-specified pair of phases. Targets are treated as independent.
    """
    alpha = check_alpha("newcombe_diff", alpha)
    for name, v in (("n1", n1), ("n2", n2)):
        check_int("newcombe_diff", name, v, 1)
    if not (0 <= k1 <= n1 and 0 <= k2 <= n2):
        raise ValueError(f"newcombe_diff: need 0 <= k <= n, got {k1}/{n1} and {k2}/{n2}")
    lo, hi = confint_proportions_2indep(
        k1, n1, k2, n2, method="newcomb", compare="diff", alpha=alpha
    )
    return float(k1 / n1 - k2 / n2), float(lo), float(hi)


def per_phase_on_targets(
    t: Targets, n_boot: int, rng: np.random.Generator, alpha: float
) -> pd.DataFrame:
    """:func:`per_phase` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
    k, n = t.phase_counts()
    lo, hi = wilson_ci(k, n, alpha)
    boot_lo = boot_hi = np.full(t.stride, np.nan)
    if n_boot:
        kc, nc = t.cluster_counts()  # (C, d)
        w = cluster_weights(rng, t.cluster_seed, n_boot).astype(float)  # (B, C)
        boot_lo, boot_hi = percentile_ci(ratio_or_nan(w @ kc, w @ nc), alpha)  # from (B, d)
    return pd.DataFrame(
        {
            "phase": np.arange(t.stride),
            "n": n.astype(np.int64),
            "k": k.astype(np.int64),
            "accuracy": ratio_or_nan(k, n),
            "wilson_lo": lo,
            "wilson_hi": hi,
            "boot_lo": boot_lo,
            "boot_hi": boot_hi,
        }
    )


def per_phase(
    df: pd.DataFrame, stride: int, *, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05
) -> pd.DataFrame:
    """Accuracy per phase with Wilson and cluster-bootstrap percentile intervals.

    Columns ``phase, n, k, accuracy, wilson_lo, wilson_hi, boot_lo, boot_hi``, one row per phase
    ``0..d-1`` (NaN accuracy and intervals for a phase with no target). Wilson treats targets as
    independent; the bootstrap resamples sequences (seeds, then sequences within seeds, when the
    ``seed`` column has more than one value), so it widens when targets of a sequence are
    correlated. ``n_boot=0`` skips the bootstrap (NaN columns).
    """
    t = load_targets(df, stride, "per_phase")
    n_boot = check_int("per_phase", "n_boot", n_boot, 0)
    alpha = check_alpha("per_phase", alpha)
    return per_phase_on_targets(t, n_boot, np.random.default_rng(seed), alpha)


def by_depth_on_targets(t: Targets, n_bins: int, alpha: float) -> pd.DataFrame:
    """:func:`by_depth` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
    bins = depth_bins(t.depth, n_bins)
    k = np.bincount(bins, weights=t.correct, minlength=n_bins)
    n = np.bincount(bins, minlength=n_bins).astype(float)
    lo, hi = wilson_ci(k, n, alpha)
    edges = np.linspace(0, 1, n_bins + 1)
    return pd.DataFrame(
        {
            "depth_bin": np.arange(n_bins),
            "depth_lo": edges[:-1],
            "depth_hi": edges[1:],
            "n": n.astype(np.int64),
            "k": k.astype(np.int64),
            "accuracy": ratio_or_nan(k, n),
            "wilson_lo": lo,
            "wilson_hi": hi,
        }
    )


def by_depth(df: pd.DataFrame, n_bins: int = 5, alpha: float = 0.05) -> pd.DataFrame:
    """Accuracy in ``n_bins`` equal-width depth bins on [0, 1] with Wilson intervals.

    Columns ``depth_bin, depth_lo, depth_hi, n, k, accuracy, wilson_lo, wilson_hi``; a bin's
    lower edge belongs to it, depth 1 to the last bin. Needs only ``correct`` and ``depth``.
    """
    t = load_targets(df, None, "by_depth", ("correct", "depth"))
    n_bins = check_int("by_depth", "n_bins", n_bins, 1)
    return by_depth_on_targets(t, n_bins, check_alpha("by_depth", alpha))


__all__ = [
    "by_depth",
    "by_depth_on_targets",
    "newcombe_diff",
    "per_phase",
    "per_phase_on_targets",
    "wilson_ci",
]
