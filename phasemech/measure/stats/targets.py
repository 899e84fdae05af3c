"""Checked input of the statistics and the cluster resampling they share.

Axes: ``target`` (rows), ``cluster`` (sequences, each seed's contiguous), ``phase``, ``replicate``
(bootstrap or permutation draws), ``split`` (random halves). See :mod:`phasemech.measure.stats`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.validation import check_int

REQUIRED = ("correct", "phase", "depth", "seq_id")


def check_alpha(where: str, alpha: Any) -> float:
    """``alpha`` as a float in (0, 1), else a ValueError naming ``where``."""
    if not isinstance(alpha, int | float | np.floating) or not 0 < alpha < 1:
        raise ValueError(f"{where}: alpha={alpha!r} is invalid: must be a float in (0, 1)")
    return float(alpha)


def _first_bad(series: pd.Series, bad: np.ndarray) -> str:
    """``'VALUE' (and M more)`` for the first offending entry, to put in an error message."""
    value = series.to_numpy()[bad.nonzero()[0][0]]
    value = value.item() if isinstance(value, np.generic) else value  # 2, not np.int64(2)
    more = int(bad.sum()) - 1
    return f"{value!r}" + (f" (and {more} more)" if more else "")


@dataclass(frozen=True)
class Targets:
    """Checked input as flat arrays (all ``(N,)`` except where noted)."""

    correct: np.ndarray  # float 0/1
    phase: np.ndarray  # int in [0, d)
    depth: np.ndarray  # float in [0, 1]
    seed: np.ndarray  # int code in [0, S)
    cluster: np.ndarray  # int code in [0, C); each seed's clusters contiguous
    cluster_seed: np.ndarray  # (C,) seed code of each cluster
    stride: int

    @property
    def n_clusters(self) -> int:
        return len(self.cluster_seed)

    @property
    def n_seeds(self) -> int:
        return int(self.cluster_seed.max()) + 1

    def phase_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``k, n``: correct and total targets per phase, ``(d,)`` each."""
        d = self.stride
        k = np.bincount(self.phase, weights=self.correct, minlength=d)
        n = np.bincount(self.phase, minlength=d).astype(float)
        return k, n

    def cluster_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``K, N``: correct and total targets per (cluster, phase), ``(C, d)`` each.

        Every resampling scheme below only reweights clusters, so these two small matrices are
        all it needs: a replicate's per-phase counts are ``w @ K`` for cluster weights ``w``.
        """
        d, c = self.stride, self.n_clusters
        flat = self.cluster * d + self.phase
        k = np.bincount(flat, weights=self.correct, minlength=c * d).reshape(c, d)
        n = np.bincount(flat, minlength=c * d).reshape(c, d).astype(float)
        return k, n


def load_targets(df: Any, stride: Any, where: str, columns: tuple[str, ...] = REQUIRED) -> Targets:
    """Check ``df`` (only the listed ``columns``; ``stride`` unless it is None) and flatten it."""
    if stride is not None:
        stride = check_int(where, "stride", stride, 2)
    _check_frame(df, where, columns)
    n_rows = len(df)
    correct = _correct_column(df, where) if "correct" in columns else np.zeros(n_rows)
    phase = (
        _phase_column(df, stride, where) if "phase" in columns else np.zeros(n_rows, dtype=np.int64)
    )
    depth = _depth_column(df, where) if "depth" in columns else np.zeros(n_rows)
    seed = _codes(df, "seed", where) if "seed" in df.columns else np.zeros(n_rows, dtype=np.int64)
    seq = _codes(df, "seq_id", where) if "seq_id" in columns else np.zeros(n_rows, dtype=np.int64)
    # A sequence is a (seed, seq_id) pair; sorting by seed first keeps each seed's clusters
    # contiguous, which the two-level bootstrap and the within-seed splits rely on.
    pair_key = seed * (int(seq.max()) + 1) + seq
    keys, cluster = np.unique(pair_key, return_inverse=True)
    cluster_seed = keys // (int(seq.max()) + 1)
    return Targets(
        correct=correct,
        phase=phase,
        depth=depth,
        seed=seed,
        cluster=cluster.astype(np.int64),
        cluster_seed=cluster_seed.astype(np.int64),
        stride=0 if stride is None else stride,
    )


def _check_frame(df: Any, where: str, columns: tuple[str, ...]) -> None:
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{where}: expected a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(
            f"{where}: missing column(s) {missing}; required: {list(columns)} "
            f"(optional: 'seed'); got {list(df.columns)}"
        )
    if len(df) == 0:
        raise ValueError(f"{where}: the frame is empty: need at least one evaluated target")


def _numeric(col: pd.Series) -> np.ndarray:
    """The column as floats, NaN where an entry is not a number."""
    return pd.to_numeric(col, errors="coerce").astype(float).to_numpy()


def _correct_column(df: pd.DataFrame, where: str) -> np.ndarray:
    col = df["correct"]
    num = _numeric(col)
    bad = ~np.isin(num, (0.0, 1.0))  # also catches NaN / NA
    if bad.any():
        raise ValueError(
            f"{where}: column 'correct' has value {_first_bad(col, bad)}: allowed are bool or 0/1"
        )
    return num


def _phase_column(df: pd.DataFrame, stride: int | None, where: str) -> np.ndarray:
    col = df["phase"]
    num = _numeric(col)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(num) | (num != np.round(num))
    if bad.any():
        raise ValueError(
            f"{where}: column 'phase' has value {_first_bad(col, bad)}: phases must be ints"
        )
    if stride is not None:
        bad = (num < 0) | (num >= stride)
        if bad.any():
            raise ValueError(
                f"{where}: column 'phase' has value {_first_bad(col, bad)} outside "
                f"[0, stride={stride}): allowed are ints 0..{stride - 1}"
            )
    return num.astype(np.int64)


def _depth_column(df: pd.DataFrame, where: str) -> np.ndarray:
    col = df["depth"]
    num = _numeric(col)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(num) | (num < 0) | (num > 1)
    if bad.any():
        raise ValueError(
            f"{where}: column 'depth' has value {_first_bad(col, bad)}: "
            "allowed are floats in [0, 1]"
        )
    return num


def _codes(df: pd.DataFrame, name: str, where: str) -> np.ndarray:
    """Integer codes ``0..K-1`` of a label column, in sorted order of the labels."""
    bad = df[name].isna().to_numpy()
    if bad.any():
        raise ValueError(f"{where}: column {name!r} has {int(bad.sum())} missing value(s)")
    return pd.factorize(df[name], sort=True)[0].astype(np.int64)


def depth_bins(depth: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-width bins on [0, 1]; an edge belongs to the upper bin, depth 1 to the last."""
    return np.minimum((depth * n_bins).astype(np.int64), n_bins - 1)


def ratio_or_nan(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``k / n`` with NaN where ``n == 0`` (an unobserved phase has no accuracy)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, k / np.where(n > 0, n, 1), np.nan)


def cluster_weights(rng: np.random.Generator, cluster_seed: np.ndarray, n_boot: int) -> np.ndarray:
    """Cluster bootstrap multiplicities ``(B, C)``.

    One seed: resample the C sequences with replacement (``Multinomial(C, 1/C)`` counts). Several
    seeds: resample seeds, then sequences within each drawn seed. Drawing seed ``s`` ``m`` times
    and resampling its ``C_s`` sequences each time adds up to ``Multinomial(m * C_s, 1/C_s)``, so
    one multinomial per seed does it (a loop over seeds, never over replicates). Resampling at
    both levels slightly overstates the variance (it counts the within-seed noise twice); with a
    handful of seeds the top level is crude anyway, so treat these intervals as conservative.
    """
    n_clusters = len(cluster_seed)
    n_seeds = int(cluster_seed.max()) + 1
    if n_seeds == 1:
        return rng.multinomial(n_clusters, np.full(n_clusters, 1 / n_clusters), size=n_boot)
    times = rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=n_boot)  # (B, S)
    weights = np.empty((n_boot, n_clusters), dtype=np.int64)
    for s in range(n_seeds):
        cols = np.flatnonzero(cluster_seed == s)
        m = len(cols)
        weights[:, cols] = rng.multinomial(times[:, s] * m, np.full(m, 1 / m))
    return weights


def half_masks(rng: np.random.Generator, cluster_seed: np.ndarray, n: int) -> np.ndarray:
    """``n`` random halves of the clusters, ``(n, C)`` bool; each seed is split in half.

    Splitting within seeds keeps a seed's effect out of the A-versus-B contrast.
    """
    masks = np.empty((n, len(cluster_seed)), dtype=bool)
    for s in range(int(cluster_seed.max()) + 1):
        cols = np.flatnonzero(cluster_seed == s)
        base = np.arange(len(cols)) < len(cols) // 2
        masks[:, cols] = rng.permuted(np.broadcast_to(base, (n, len(cols))), axis=1)
    return masks


def raw_gap(p: np.ndarray) -> np.ndarray:
    """``max - min`` over the last (phase) axis, ignoring unobserved (NaN) phases."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmax(p, axis=-1) - np.nanmin(p, axis=-1)


def split_gap(k_a: np.ndarray, n_a: np.ndarray, k_b: np.ndarray, n_b: np.ndarray) -> np.ndarray:
    """Split-sample gap for each row of ``(..., d)`` counts: pick on one half, measure on the other.

    Choosing the best and worst phase on half A and reading them off half B removes the
    selection bias of ``max - min`` (B's noise is independent of the choice); then swap halves.
    """
    p_a, p_b = ratio_or_nan(k_a, n_a), ratio_or_nan(k_b, n_b)

    def pick_measure(p_pick: np.ndarray, p_measure: np.ndarray) -> np.ndarray:
        def at(i: np.ndarray) -> np.ndarray:
            return np.take_along_axis(p_measure, i[..., None], -1)[..., 0]

        hi = np.argmax(np.where(np.isnan(p_pick), -np.inf, p_pick), axis=-1)
        lo = np.argmin(np.where(np.isnan(p_pick), np.inf, p_pick), axis=-1)
        return at(hi) - at(lo)  # NaN if a picked phase is unobserved in the other half

    return (pick_measure(p_a, p_b) + pick_measure(p_b, p_a)) / 2


def percentile_ci(x: np.ndarray, alpha: float, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The percentile interval ``(lo, hi)`` at level ``1 - alpha`` along ``axis``, NaN ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: unobserved phase
        lo, hi = np.nanquantile(x, [alpha / 2, 1 - alpha / 2], axis=axis)
    return lo, hi


def content_seed_counts(t: Targets, contents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``k, n`` per (seed, shared content, phase), ``(S, C, d)``: ``contents`` maps each row to a
    content code shared by the frames being compared."""
    s, c, d = t.n_seeds, int(contents.max()) + 1, t.stride
    flat = (t.seed * c + contents) * d + t.phase
    k = np.bincount(flat, weights=t.correct, minlength=s * c * d).reshape(s, c, d)
    n = np.bincount(flat, minlength=s * c * d).reshape(s, c, d).astype(float)
    return k, n
