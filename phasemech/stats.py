"""Honest per-phase retrieval statistics (the reporting template of ``docs/statistics.md``).

Input: one tidy row per evaluated **target** with columns

* ``correct``: bool or 0/1, whether the target was retrieved;
* ``phase``: int in ``[0, stride)``, the target's phase ``phi`` on the compression grid;
* ``depth``: float in ``[0, 1]``, relative position of the source in the context;
* ``seq_id``: the sequence the target came from. Targets of one sequence are correlated, so the
  sequence is the resampling **cluster**. ``seq_id`` need only be unique within a seed;
* ``seed`` (optional): the training seed of the model, a cluster level above sequences.

Other columns are ignored. Bad input raises ``ValueError`` before any work.

Names used throughout: ``d`` = ``stride``; ``k``, ``n`` = correct and total targets (per phase
unless said otherwise; in :func:`harmonics` ``k`` is the harmonic index); array axes ``target``
(N rows), ``cluster`` (C sequences, numbered so that each seed's sequences are contiguous),
``phase`` (d), ``replicate`` (B bootstrap or permutation draws), ``split`` (random halves).
Shape comments read ``(B, C)`` etc.

The keyword ``seed`` of the functions seeds the random number generator; the ``seed`` column
names training seeds. Every random draw comes from numpy generators seeded with ``seed``, so a
call is deterministic given ``seed`` (and :func:`phase_report` reproduces the standalone calls).

Which test to trust: the chi-square, logistic and harmonic tests treat targets as independent
Bernoulli trials. Under a design that draws each target's phase at random (independently of
its sequence) that is still a valid randomisation test of "no phase effect", but if all targets
of a sequence share one phase draw (one grid offset per sequence) those p-values are too small:
prefer the cluster bootstrap intervals then. The permutation test shuffles phase labels between
targets, so it carries the same assumption.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import patsy
from scipy import stats as sps
from statsmodels.genmod import families
from statsmodels.genmod.generalized_linear_model import GLM
from statsmodels.stats.contingency_tables import cochrans_q
from statsmodels.stats.proportion import confint_proportions_2indep, proportion_confint

from phasemech.io import atomic_write
from phasemech.validation import check_int

__all__ = [
    "PhaseReport",
    "by_depth",
    "chi2_phase",
    "compare_gaps",
    "design_guard",
    "harmonics",
    "logistic_phase_test",
    "newcombe_diff",
    "paired_phase_test",
    "per_phase",
    "phase_gap",
    "phase_report",
    "wilson_ci",
]

REQUIRED = ("correct", "phase", "depth", "seq_id")


# --------------------------------------------------------------------------- input checking


def _check_alpha(where: str, alpha: Any) -> float:
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
class _Targets:
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


def _load(df: Any, stride: Any, where: str, columns: tuple[str, ...] = REQUIRED) -> _Targets:
    """Check ``df`` (only the listed ``columns``; ``stride`` unless it is None) and flatten it."""
    if stride is not None:
        stride = check_int(where, "stride", stride, 2)
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
    n_rows = len(df)

    correct = np.zeros(n_rows)
    if "correct" in columns:
        col = df["correct"]
        num = pd.to_numeric(col, errors="coerce").astype(float).to_numpy()
        bad = ~np.isin(num, (0.0, 1.0))  # also catches NaN / NA
        if bad.any():
            raise ValueError(
                f"{where}: column 'correct' has value {_first_bad(col, bad)}: "
                "allowed are bool or 0/1"
            )
        correct = num

    phase = np.zeros(n_rows, dtype=np.int64)
    if "phase" in columns:
        col = df["phase"]
        num = pd.to_numeric(col, errors="coerce").astype(float).to_numpy()
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
        phase = num.astype(np.int64)

    depth = np.zeros(n_rows)
    if "depth" in columns:
        col = df["depth"]
        num = pd.to_numeric(col, errors="coerce").astype(float).to_numpy()
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(num) | (num < 0) | (num > 1)
        if bad.any():
            raise ValueError(
                f"{where}: column 'depth' has value {_first_bad(col, bad)}: "
                "allowed are floats in [0, 1]"
            )
        depth = num

    seed = np.zeros(n_rows, dtype=np.int64)
    if "seed" in df.columns:
        bad = df["seed"].isna().to_numpy()
        if bad.any():
            raise ValueError(f"{where}: column 'seed' has {int(bad.sum())} missing value(s)")
        seed = pd.factorize(df["seed"], sort=True)[0].astype(np.int64)

    seq = np.zeros(n_rows, dtype=np.int64)
    if "seq_id" in columns:
        bad = df["seq_id"].isna().to_numpy()
        if bad.any():
            raise ValueError(f"{where}: column 'seq_id' has {int(bad.sum())} missing value(s)")
        seq = pd.factorize(df["seq_id"], sort=True)[0].astype(np.int64)
    # A sequence is a (seed, seq_id) pair; sorting by seed first keeps each seed's clusters
    # contiguous, which the two-level bootstrap and the within-seed splits rely on.
    pair_key = seed * (int(seq.max()) + 1) + seq
    keys, cluster = np.unique(pair_key, return_inverse=True)
    cluster_seed = keys // (int(seq.max()) + 1)
    return _Targets(
        correct=correct,
        phase=phase,
        depth=depth,
        seed=seed,
        cluster=cluster.astype(np.int64),
        cluster_seed=cluster_seed.astype(np.int64),
        stride=0 if stride is None else stride,
    )


def _depth_bins(depth: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-width bins on [0, 1]; an edge belongs to the upper bin, depth 1 to the last."""
    return np.minimum((depth * n_bins).astype(np.int64), n_bins - 1)


def _ratio(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``k / n`` with NaN where ``n == 0`` (an unobserved phase has no accuracy)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, k / np.where(n > 0, n, 1), np.nan)


# --------------------------------------------------------------------------- resampling


def _cluster_weights(rng: np.random.Generator, cluster_seed: np.ndarray, n_boot: int) -> np.ndarray:
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


def _half_masks(rng: np.random.Generator, cluster_seed: np.ndarray, n: int) -> np.ndarray:
    """``n`` random halves of the clusters, ``(n, C)`` bool; each seed is split in half.

    Splitting within seeds keeps a seed's effect out of the A-versus-B contrast.
    """
    masks = np.empty((n, len(cluster_seed)), dtype=bool)
    for s in range(int(cluster_seed.max()) + 1):
        cols = np.flatnonzero(cluster_seed == s)
        base = np.arange(len(cols)) < len(cols) // 2
        masks[:, cols] = rng.permuted(np.broadcast_to(base, (n, len(cols))), axis=1)
    return masks


def _gap(p: np.ndarray) -> np.ndarray:
    """``max - min`` over the last (phase) axis, ignoring unobserved (NaN) phases."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmax(p, axis=-1) - np.nanmin(p, axis=-1)


def _split_gap(k_a: np.ndarray, n_a: np.ndarray, k_b: np.ndarray, n_b: np.ndarray) -> np.ndarray:
    """Split-sample gap for each row of ``(..., d)`` counts: pick on one half, measure on the other.

    Choosing the best and worst phase on half A and reading them off half B removes the
    selection bias of ``max - min`` (B's noise is independent of the choice); then swap halves.
    """
    p_a, p_b = _ratio(k_a, n_a), _ratio(k_b, n_b)

    def pick_measure(p_pick: np.ndarray, p_measure: np.ndarray) -> np.ndarray:
        def at(i: np.ndarray) -> np.ndarray:
            return np.take_along_axis(p_measure, i[..., None], -1)[..., 0]

        hi = np.argmax(np.where(np.isnan(p_pick), -np.inf, p_pick), axis=-1)
        lo = np.argmin(np.where(np.isnan(p_pick), np.inf, p_pick), axis=-1)
        return at(hi) - at(lo)  # NaN if a picked phase is unobserved in the other half

    return (pick_measure(p_a, p_b) + pick_measure(p_b, p_a)) / 2


def _percentile_ci(x: np.ndarray, alpha: float, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: unobserved phase
        lo, hi = np.nanquantile(x, [alpha / 2, 1 - alpha / 2], axis=axis)
    return lo, hi


# --------------------------------------------------------------------------- intervals


def wilson_ci(k: Any, n: Any, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for ``k`` successes of ``n`` (broadcasting); NaN where ``n == 0``."""
    alpha = _check_alpha("wilson_ci", alpha)
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
    alpha = _check_alpha("newcombe_diff", alpha)
    for name, v in (("n1", n1), ("n2", n2)):
        check_int("newcombe_diff", name, v, 1)
    if not (0 <= k1 <= n1 and 0 <= k2 <= n2):
        raise ValueError(f"newcombe_diff: need 0 <= k <= n, got {k1}/{n1} and {k2}/{n2}")
    lo, hi = confint_proportions_2indep(
        k1, n1, k2, n2, method="newcomb", compare="diff", alpha=alpha
    )
    return float(k1 / n1 - k2 / n2), float(lo), float(hi)


# --------------------------------------------------------------------------- per phase, depth


def _per_phase(t: _Targets, n_boot: int, rng: np.random.Generator, alpha: float) -> pd.DataFrame:
    k, n = t.phase_counts()
    lo, hi = wilson_ci(k, n, alpha)
    boot_lo = boot_hi = np.full(t.stride, np.nan)
    if n_boot:
        kc, nc = t.cluster_counts()  # (C, d)
        w = _cluster_weights(rng, t.cluster_seed, n_boot).astype(float)  # (B, C)
        boot_lo, boot_hi = _percentile_ci(_ratio(w @ kc, w @ nc), alpha)  # from (B, d)
    return pd.DataFrame(
        {
            "phase": np.arange(t.stride),
            "n": n.astype(np.int64),
            "k": k.astype(np.int64),
            "accuracy": _ratio(k, n),
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
    t = _load(df, stride, "per_phase")
    n_boot = check_int("per_phase", "n_boot", n_boot, 0)
    alpha = _check_alpha("per_phase", alpha)
    return _per_phase(t, n_boot, np.random.default_rng(seed), alpha)


def _by_depth(t: _Targets, n_bins: int, alpha: float) -> pd.DataFrame:
    bins = _depth_bins(t.depth, n_bins)
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
            "accuracy": _ratio(k, n),
            "wilson_lo": lo,
            "wilson_hi": hi,
        }
    )


def by_depth(df: pd.DataFrame, n_bins: int = 5, alpha: float = 0.05) -> pd.DataFrame:
    """Accuracy in ``n_bins`` equal-width depth bins on [0, 1] with Wilson intervals.

    Columns ``depth_bin, depth_lo, depth_hi, n, k, accuracy, wilson_lo, wilson_hi``; a bin's
    lower edge belongs to it, depth 1 to the last bin. Needs only ``correct`` and ``depth``.
    """
    t = _load(df, None, "by_depth", ("correct", "depth"))
    n_bins = check_int("by_depth", "n_bins", n_bins, 1)
    return _by_depth(t, n_bins, _check_alpha("by_depth", alpha))


# --------------------------------------------------------------------------- omnibus tests


def _chi2_phase(t: _Targets) -> dict:
    k, n = t.phase_counts()
    seen = n > 0
    table = np.stack([k[seen], n[seen] - k[seen]], axis=1)  # (phases seen, 2)
    if seen.sum() < 2:
        return {"statistic": math.nan, "dof": 0, "p": math.nan, "note": "fewer than 2 phases seen"}
    if (table.sum(0) == 0).any():
        # Every target right (or every one wrong): accuracy cannot differ between phases.
        return {"statistic": 0.0, "dof": int(seen.sum() - 1), "p": 1.0, "note": "no variation"}
    # No Yates correction (it only applies at d = 2): keep it comparable with the LR test.
    res = sps.chi2_contingency(table, correction=False)
    note = None
    if res.expected_freq.min() < 5:
        note = "some expected counts < 5: the chi-square approximation may be poor"
    return {
        "statistic": float(res.statistic),
        "dof": int(res.dof),
        "p": float(res.pvalue),
        "note": note,
    }


def chi2_phase(df: pd.DataFrame, stride: int) -> dict:
    """``d x 2`` chi-square test of homogeneity of accuracy across phases.

    Returns ``statistic, dof, p, note``. Unobserved phases are dropped; with no variation in
    ``correct`` it returns ``statistic 0, p 1`` and says so in ``note``. Targets are treated
    as independent and depth is ignored: see :func:`logistic_phase_test` for the adjusted test.
    """
    return _chi2_phase(_load(df, stride, "chi2_phase"))


_RIDGE = 1e-4  # per-observation L2 weight of the fallback fit: tiny next to loglike / nobs


def _fit_llf(y: np.ndarray, x: np.ndarray, ridge: bool) -> tuple[float, bool, bool]:
    """Binomial GLM log-likelihood of ``y ~ x``: ``(llf, converged, separated)``.

    ``ridge`` fits with a tiny L2 penalty (``GLM.fit_regularized(L1_wt=0)``) and returns the
    *unpenalised* log-likelihood at the penalised estimate.
    """
    model = GLM(y, x, family=families.Binomial())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if ridge:
                res = model.fit_regularized(alpha=_RIDGE, L1_wt=0.0)
                llf = float(model.loglike(res.params))
                converged = not any("failed" in str(w.message) for w in caught)
            else:
                res = model.fit(maxiter=100)
                llf, converged = float(res.llf), bool(res.converged)
            mu = model.predict(res.params)
        except (np.linalg.LinAlgError, ValueError, FloatingPointError, OverflowError):
            return math.nan, False, True
    separated = bool(
        any("separation" in str(w.message).lower() for w in caught)
        or np.any((mu < 1e-8) | (mu > 1 - 1e-8))
    )
    return llf, converged and math.isfinite(llf), separated


def _logistic(t: _Targets, depth_df: int) -> dict:
    y = t.correct
    if y.min() == y.max():
        dof = len(np.unique(t.phase)) - 1
        return {"statistic": 0.0, "dof": dof, "p": 1.0, "note": "no variation in correct"}
    if len(np.unique(t.phase)) < 2:
        return {"statistic": math.nan, "dof": 0, "p": math.nan, "note": "fewer than 2 phases seen"}
    terms, notes = [], []
    n_depths = len(np.unique(t.depth))
    if depth_df and n_depths > 1:
        # bs() needs df >= degree; a lower-df spline is a lower-degree one.
        df_ = min(depth_df, n_depths - 1)
        terms.append(f"bs(depth, df={df_}, degree={min(3, df_)})")
    elif depth_df:
        notes.append("depth is constant: no depth term")
    if t.n_seeds > 1:
        terms.append("C(seed)")
    data = {"phase": t.phase, "depth": t.depth, "seed": t.seed}
    design = patsy.dmatrix(" + ".join(["1", *terms, "C(phase)"]), data, NA_action="raise")
    x = np.asarray(design)
    # patsy reorders terms (categorical ones first), so find the phase columns by name.
    x_red = np.delete(x, design.design_info.term_name_slices["C(phase)"], axis=1)
    # Rank, not column count: a phase dummy can be collinear with the depth basis or seeds.
    dof = int(np.linalg.matrix_rank(x) - np.linalg.matrix_rank(x_red))
    if dof == 0:
        return {"statistic": 0.0, "dof": 0, "p": 1.0, "note": "phase is collinear with covariates"}

    fits = [_fit_llf(y, m, ridge=False) for m in (x, x_red)]
    if not all(f[1] for f in fits):
        fits = [_fit_llf(y, m, ridge=True) for m in (x, x_red)]
        notes.append(
            f"maximum likelihood did not converge (separation); used ridge fits "
            f"(L2 weight {_RIDGE:g} per target) and the unpenalised likelihood ratio"
        )
        if not all(f[1] for f in fits):
            chi = _chi2_phase(t)
            notes.append("ridge fits failed too: p is the unadjusted chi-square test's")
            return {**chi, "note": "; ".join(notes)}
    elif any(f[2] for f in fits):
        # Quasi-separation (a phase or seed cell all right or all wrong): maximum likelihood
        # converges to the limiting likelihood, which is what the LR test needs.
        notes.append("(quasi-)separation: some fitted probabilities are 0 or 1")
    stat = max(2 * (fits[0][0] - fits[1][0]), 0.0)  # tiny negatives are round-off
    return {
        "statistic": float(stat),
        "dof": dof,
        "p": float(sps.chi2.sf(stat, dof)),
        "note": "; ".join(notes) or None,
    }


def logistic_phase_test(df: pd.DataFrame, stride: int, depth_df: int = 4) -> dict:
    """Likelihood-ratio test of phase, adjusted for depth and seed.

    Binomial GLM ``correct ~ C(phase) + bs(depth, df=depth_df) + C(seed)`` against the same
    without ``C(phase)`` (``C(seed)`` only with more than one seed, the B-spline via patsy's
    ``bs``; ``depth_df=0`` drops depth). Returns ``statistic`` (``2 * delta loglik``), ``dof``
    (rank difference of the designs), ``p`` (chi-square) and ``note``.

    Degenerate data, in order: no variation in ``correct`` gives ``statistic 0, p 1``.
    (Quasi-)separation that maximum likelihood still converges through (IRLS, limiting
    likelihood) is only noted. If IRLS fails to converge, both models are refitted with a tiny
    ridge penalty and the unpenalised log-likelihoods at those estimates are compared; if that
    fails too, the unadjusted :func:`chi2_phase` result is returned with a note.
    """
    t = _load(df, stride, "logistic_phase_test")
    return _logistic(t, check_int("logistic_phase_test", "depth_df", depth_df, 0))


# --------------------------------------------------------------------------- harmonics


def _holm(p: np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values, as ``multipletests(p, method="holm")[1]``.

    Not that call itself: in statsmodels 0.15 its Holm branch runs ``gc.collect()``, which costs
    0.2 s and up in a process holding torch and a model (tests/test_stats.py checks equality).
    """
    order = np.argsort(p)
    adjusted = np.maximum.accumulate(p[order] * np.arange(len(p), 0, -1))
    out = np.empty_like(adjusted)
    out[order] = np.minimum(adjusted, 1.0)
    return out


def _harmonics(t: _Targets, alpha: float) -> pd.DataFrame:
    d = t.stride
    k, n = t.phase_counts()
    p = _ratio(k, n)
    ks = np.arange(1, d // 2 + 1)
    angle = 2 * np.pi * np.outer(ks, np.arange(d)) / d  # (harmonic, phase)
    amplitude = (2 / d) * np.abs((p * np.exp(-1j * angle)).sum(1))
    dof = np.where(2 * ks == d, 1, 2)
    p_bar = k.sum() / n.sum()
    var = p_bar * (1 - p_bar)
    if (n == 0).any():
        stat = pval = p_holm = np.full(len(ks), np.nan)
    else:
        # z = (sum_phi (p_phi - p_bar) cos, ... sin) has covariance var * [[a, b], [b, e]]
        # with a = sum cos^2 / n_phi etc.; T_k = z' Cov^-1 z. With equal n this is exactly
        # the usual 2|S_k|^2 / (d p_bar (1 - p_bar) / n) for k < d/2. At k = d/2 the sine
        # part vanishes and Var(S) = d p_bar (1 - p_bar) / n, so T = |S|^2 / that (half the
        # usual expression, which would be 2 chi2_1, not chi2_1).
        cos, sin = np.cos(angle), np.sin(angle)
        dev = p - p_bar
        zc, zs = (dev * cos).sum(1), (dev * sin).sum(1)
        a, b, e = (cos**2 / n).sum(1), (cos * sin / n).sum(1), (sin**2 / n).sum(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            two = (e * zc**2 - 2 * b * zc * zs + a * zs**2) / (a * e - b**2)
            stat = np.where(dof == 1, zc**2 / a, two) / var if var > 0 else np.zeros(len(ks))
        pval = sps.chi2.sf(stat, dof)
        p_holm = _holm(pval)
    return pd.DataFrame(
        {
            "k": ks,
            "amplitude": amplitude,
            "statistic": stat,
            "dof": dof,
            "p": pval,
            "p_holm": p_holm,
            "significant": p_holm < alpha,
        }
    )


def harmonics(df: pd.DataFrame, stride: int, alpha: float = 0.05) -> pd.DataFrame:
    """Fourier spectrum of the per-phase accuracy with a chi-square test per harmonic.

    ``A_k = (2/d) sum_phi p_phi exp(-2 pi i k phi / d)`` for ``k = 1..d//2``; ``amplitude`` is
    ``|A_k|`` (for ``k < d/2`` a cosine of amplitude ``a`` gives ``|A_k| = a``; at ``k = d/2``
    it gives ``2a``, the peak-to-peak). ``statistic`` is ``T_k``, chi-square with ``dof`` 2
    (1 at ``k = d/2``) under "no phase effect"; ``p_holm`` is Holm-adjusted across k and
    ``significant`` is ``p_holm < alpha``. k = 1 tests period d, k = d/2 parity.

    ``T_k`` uses the exact variance of the Fourier sum for the observed per-phase counts
    (``var(p_phi) = p_bar (1 - p_bar) / n_phi``, ``p_bar`` pooled), which equals the usual
    formula with equal counts. Replacing ``n`` by the per-phase *mean* count when counts are
    unequal would overstate ``T_k`` (its mean would be ``2 * mean(n) / harmonic_mean(n)``).
    At ``k = d/2`` this is half the usual expression, which is ``2 chi2_1`` there. A phase
    with no target makes ``amplitude``, ``statistic``, ``p`` and ``p_holm`` NaN and
    ``significant`` False.
    """
    t = _load(df, stride, "harmonics")
    return _harmonics(t, _check_alpha("harmonics", alpha))


# --------------------------------------------------------------------------- phase gap


def _phase_gap(
    t: _Targets,
    n_perm: int,
    n_boot: int,
    n_splits: int,
    seed: Any,
    alpha: float,
    n_depth_bins: int,
) -> dict:
    d = t.stride
    # Independent streams, so changing n_perm does not move the bootstrap draws and vice versa.
    perm_rng, split_rng, boot_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    k, n = t.phase_counts()
    p = _ratio(k, n)
    raw = float(_gap(p))
    seen = n > 0
    argmax = int(np.argmax(np.where(seen, p, -np.inf)))
    argmin = int(np.argmin(np.where(seen, p, np.inf)))

    # Permutation null: shuffling phase labels within a (seed, depth bin) stratum keeps each
    # stratum's phase counts and number correct, so a phase's correct count is the sum over
    # strata of a multivariate hypergeometric draw: exact, and no target-level shuffling.
    null_median = null_p95 = p_perm = math.nan
    if n_perm:
        stratum = t.seed * n_depth_bins + _depth_bins(t.depth, n_depth_bins)
        k_perm = np.zeros((n_perm, d))  # (B, d)
        for s in np.unique(stratum):
            rows = stratum == s
            colors = np.bincount(t.phase[rows], minlength=d)
            k_perm += perm_rng.multivariate_hypergeometric(
                colors, int(t.correct[rows].sum()), size=n_perm
            )
        null = _gap(_ratio(k_perm, n))
        null_median, null_p95 = (float(q) for q in np.quantile(null, [0.5, 0.95]))
        # 1e-12: equal gaps differ by round-off; ties count against the observed gap.
        p_perm = float((1 + np.sum(null >= raw - 1e-12)) / (n_perm + 1))

    # Split-sample gap on halves of the sequences (clusters never straddle halves).
    kc, nc = t.cluster_counts()  # (C, d)
    masks = _half_masks(split_rng, t.cluster_seed, n_splits).astype(float)  # (splits, C)
    k_a, n_a = masks @ kc, masks @ nc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        debiased = float(np.nanmean(_split_gap(k_a, n_a, k - k_a, n - n_a)))

    # Its cluster bootstrap: each replicate reweights clusters and is split afresh. Only
    # n_inner = 2 splits per replicate, to keep the cost down; their mean varies more than a
    # mean over n_splits splits, by E[Var(gap | data)] * (1/n_inner - 1/n_splits) (law of
    # total variance). That split variance is estimated from the spread of the inner splits
    # and the replicates are shrunk about their mean to remove it; left in, it made the
    # interval ~1.7x too wide (d=8, 500 targets per phase, no phase effect).
    lo = hi = math.nan
    if n_boot:
        n_inner = min(n_splits, 2)
        w = _cluster_weights(boot_rng, t.cluster_seed, n_boot).astype(float)  # (B, C)
        k_w, n_w = w @ kc, w @ nc  # (B, d)
        inner = np.empty((n_inner, n_boot))
        for j in range(n_inner):
            wa = w * _half_masks(boot_rng, t.cluster_seed, n_boot)  # (B, C)
            k_a, n_a = wa @ kc, wa @ nc
            inner[j] = _split_gap(k_a, n_a, k_w - k_a, n_w - n_a)
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
        lo, hi = (float(v) for v in _percentile_ci(reps, alpha))

    # First harmonic with its noise floor removed: E|A_1|^2 = |true A_1|^2 + E_noise under
    # independent targets, E_noise = (4 / d^2) p_bar (1 - p_bar) sum_phi 1 / n_phi, which is
    # 4 p_bar (1 - p_bar) / (d n) for equal counts n.
    p2p = math.nan
    if seen.all():
        a1 = (2 / d) * abs((p * np.exp(-2j * np.pi * np.arange(d) / d)).sum())
        p_bar = k.sum() / n.sum()
        noise = 4 / d**2 * p_bar * (1 - p_bar) * (1 / n).sum()
        p2p = float(2 * math.sqrt(max(a1**2 - noise, 0.0)))
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
        "harmonic_p2p": p2p,
        "n_perm": n_perm,
        "n_boot": n_boot,
    }


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
    t = _load(df, stride, where)
    n_perm = check_int(where, "n_perm", n_perm, 0)
    n_boot = check_int(where, "n_boot", n_boot, 0)
    n_splits = check_int(where, "n_splits", n_splits, 1)
    n_depth_bins = check_int(where, "n_depth_bins", n_depth_bins, 1)
    alpha = _check_alpha(where, alpha)
    return _phase_gap(t, n_perm, n_boot, n_splits, seed, alpha, n_depth_bins)


# --------------------------------------------------------------------------- design guard


def _design_guard(t: _Targets, n_bins: int) -> dict:
    d = t.stride
    counts = np.bincount(t.phase, minlength=d)
    uniform_p = float(sps.chisquare(counts).pvalue)
    table = np.zeros((d, n_bins), dtype=np.int64)  # (phase, depth bin)
    np.add.at(table, (t.phase, _depth_bins(t.depth, n_bins)), 1)
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
    t = _load(df, stride, "design_guard", ("phase", "depth"))
    return _design_guard(t, check_int("design_guard", "n_bins", n_bins, 1))


def _content_seed_counts(t: _Targets, contents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``k, n`` per (seed, shared content, phase), ``(S, C, d)``: ``contents`` maps each row to a
    content code shared by the frames being compared."""
    s, c, d = t.n_seeds, int(contents.max()) + 1, t.stride
    flat = (t.seed * c + contents) * d + t.phase
    k = np.bincount(flat, weights=t.correct, minlength=s * c * d).reshape(s, c, d)
    n = np.bincount(flat, minlength=s * c * d).reshape(s, c, d).astype(float)
    return k, n


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
    alpha = _check_alpha(where, alpha)
    cols = ("correct", "phase", "seq_id")
    ta = _load(baseline, stride, f"{where} (baseline)", cols)
    tb = _load(other, stride, f"{where} (other)", cols)
    only = set(baseline["seq_id"]) ^ set(other["seq_id"])
    if only:
        raise ValueError(
            f"{where}: the frames must score the same test set (the bootstrap pairs them by "
            f"seq_id), but {len(only)} seq_id value(s) are in only one, e.g. {sorted(only)[:3]}"
        )
    codes, uniq = pd.factorize(pd.concat([baseline["seq_id"], other["seq_id"]]), sort=True)
    ca, cb = codes[: len(baseline)], codes[len(baseline) :]
    n_contents = len(uniq)
    ka, na = _content_seed_counts(ta, ca)
    kb, nb = _content_seed_counts(tb, cb)
    ka = np.pad(ka, ((0, 0), (0, n_contents - ka.shape[1]), (0, 0)))
    na = np.pad(na, ((0, 0), (0, n_contents - na.shape[1]), (0, 0)))
    kb = np.pad(kb, ((0, 0), (0, n_contents - kb.shape[1]), (0, 0)))
    nb = np.pad(nb, ((0, 0), (0, n_contents - nb.shape[1]), (0, 0)))
    split_rng, boot_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    one_seed = np.zeros(n_contents, dtype=np.int64)

    def split_gaps(w_seed: np.ndarray, w_content: np.ndarray, k, n, masks) -> np.ndarray:
        # w_seed (B, S), w_content and masks (B, C): the split gap of each replicate
        full_k = np.einsum("bs,bc,scp->bp", w_seed, w_content, k)
        full_n = np.einsum("bs,bc,scp->bp", w_seed, w_content, n)
        half_k = np.einsum("bs,bc,scp->bp", w_seed, w_content * masks, k)
        half_n = np.einsum("bs,bc,scp->bp", w_seed, w_content * masks, n)
        return _split_gap(half_k, half_n, full_k - half_k, full_n - half_n)

    def point(k, n) -> tuple[float, float]:
        masks = _half_masks(split_rng, one_seed, n_splits).astype(float)
        ones_s = np.ones((n_splits, k.shape[0]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            gap = float(np.nanmean(split_gaps(ones_s, np.ones_like(masks), k, n, masks)))
        return float(k.sum() / n.sum()), gap

    acc_a, gap_a = point(ka, na)
    acc_b, gap_b = point(kb, nb)
    out = {
        "accuracy_baseline": acc_a,
        "accuracy_other": acc_b,
        "accuracy_diff": acc_b - acc_a,
        "gap_baseline": gap_a,
        "gap_other": gap_b,
        "reduction": 1 - gap_b / gap_a if gap_a > 0 else math.nan,
        "n_boot": n_boot,
    }
    lo = {k: math.nan for k in ("accuracy_diff", "gap_other", "reduction")}
    hi = dict(lo)
    if n_boot:
        w_c = boot_rng.multinomial(
            n_contents, np.full(n_contents, 1 / n_contents), size=n_boot
        ).astype(float)
        reps = {}
        for name, k, n in (("a", ka, na), ("b", kb, nb)):
            s = k.shape[0]
            w_s = boot_rng.multinomial(s, np.full(s, 1 / s), size=n_boot).astype(float)
            gaps = [
                split_gaps(w_s, w_c, k, n, _half_masks(boot_rng, one_seed, n_boot))
                for _ in range(2)
            ]
            acc = np.einsum("bs,bc,scp->b", w_s, w_c, k) / np.einsum("bs,bc,scp->b", w_s, w_c, n)
            reps[name] = (acc, np.mean(gaps, axis=0))
        with np.errstate(divide="ignore", invalid="ignore"):
            red = np.where(reps["a"][1] > 0, 1 - reps["b"][1] / reps["a"][1], np.nan)
        # a replicate without a positive baseline gap has no reduction: the interval is
        # conditional on the others, so say how many were left out
        out["reduction_dropped"] = float(np.mean(np.isnan(red)))
        if not np.isfinite(out["reduction"]):
            red = np.full_like(red, np.nan)
        for key, x in (
            ("accuracy_diff", reps["b"][0] - reps["a"][0]),
            ("gap_other", reps["b"][1]),
            ("reduction", red),
        ):
            lo[key], hi[key] = (float(v) for v in _percentile_ci(x, alpha))
    for key in lo:
        out[f"{key}_lo"], out[f"{key}_hi"] = lo[key], hi[key]
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
    t = _load(df, stride, "paired_phase_test", ("correct", "phase"))
    return _paired(t, df["pair_id"].to_numpy() if "pair_id" in df.columns else None)


def _paired(t: _Targets, pair_id: np.ndarray | None) -> dict:
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


# --------------------------------------------------------------------------- the report


def _plain(x: Any) -> Any:
    """JSON-ready copy: numpy scalars to Python, NaN / inf to None, frames to row records."""
    if isinstance(x, pd.DataFrame):
        return [_plain(r) for r in x.to_dict(orient="records")]
    if isinstance(x, dict):
        return {str(key): _plain(v) for key, v in x.items()}
    if isinstance(x, list | tuple | np.ndarray):
        return [_plain(v) for v in x]
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    return x


def _fmt_p(p: Any) -> str:
    if p is None or not np.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "n/a" if x is None or not np.isfinite(x) else format(x, spec)


@dataclass(frozen=True, eq=False)  # eq=False: DataFrame fields have no truth value
class PhaseReport:
    """The reporting template (docs/statistics.md) for one (model, design, stride, length).

    ``per_phase``, ``by_depth``, ``harmonics`` are the frames of the functions of those names;
    ``chi2``, ``logistic``, ``gap``, ``guard`` the dicts of :func:`chi2_phase`,
    :func:`logistic_phase_test`, :func:`phase_gap`, :func:`design_guard`.
    """

    stride: int
    n: int
    accuracy: float
    per_phase: pd.DataFrame
    by_depth: pd.DataFrame
    chi2: dict
    logistic: dict
    harmonics: pd.DataFrame
    gap: dict
    guard: dict
    paired: dict = field(default_factory=dict)  # paired_phase_test, if pair_id

    def to_dict(self) -> dict:
        """Plain ints / floats / lists / dicts (frames as lists of row dicts); NaN -> None."""
        return _plain({name: getattr(self, name) for name in self.__dataclass_fields__})

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``{per_phase,by_depth,harmonics}.parquet`` and ``report.json`` into ``directory``.

        Each file is written to a temp file and moved into place, so an interrupted save never
        leaves a truncated file under the final name.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("per_phase", "by_depth", "harmonics"):
            frame = getattr(self, name)
            atomic_write(
                directory / f"{name}.parquet", lambda p, f=frame: f.to_parquet(p, index=False)
            )
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        atomic_write(directory / "report.json", lambda p: Path(p).write_text(text + "\n"))

    def summary(self) -> str:
        """A few lines for a terminal: the per-phase curve, the tests and the gaps."""
        lines = [f"stride {self.stride}: {self.n} targets, accuracy {_fmt(self.accuracy)}"]
        lines.append("phase  acc    wilson 95%       cluster boot 95%       n")
        for r in self.per_phase.itertuples():
            lines.append(
                f"{r.phase:>5}  {_fmt(r.accuracy)}  [{_fmt(r.wilson_lo)}, {_fmt(r.wilson_hi)}]"
                f"   [{_fmt(r.boot_lo)}, {_fmt(r.boot_hi)}]   {r.n:>7}"
            )
        lo, ch = self.logistic, self.chi2
        lines.append(
            f"phase effect: logistic LR (depth, seed adjusted) chi2={_fmt(lo['statistic'], '.1f')}"
            f" dof={lo['dof']} p={_fmt_p(lo['p'])}; unadjusted chi2 p={_fmt_p(ch['p'])}"
        )
        lines.append(
            "harmonics: "
            + "; ".join(
                f"k={r.k} |A|={_fmt(r.amplitude)} p={_fmt_p(r.p)} (Holm {_fmt_p(r.p_holm)})"
                for r in self.harmonics.itertuples()
            )
        )
        g = self.gap
        lines.append(
            f"gap: raw {_fmt(g['raw_gap'])} (phase {g['argmax_phase']} - {g['argmin_phase']};"
            f" null median {_fmt(g['null_median'])}, 95th {_fmt(g['null_p95'])},"
            f" perm p={_fmt_p(g['p_perm'])}); debiased {_fmt(g['debiased_gap'])}"
            f" [{_fmt(g['debiased_lo'])}, {_fmt(g['debiased_hi'])}];"
            f" harmonic p2p {_fmt(g['harmonic_p2p'])}"
        )
        if self.paired.get("blocks"):
            pq = self.paired
            lines.append(
                f"paired (Cochran's Q over {pq['blocks']} targets seen at every phase, "
                f"{pq['discordant']} discordant): Q={_fmt(pq['statistic'], '.1f')} "
                f"dof={pq['dof']} p={_fmt_p(pq['p'])}"
            )
        lines.append(
            "by depth: "
            + "; ".join(
                f"[{r.depth_lo:.1f}, {r.depth_hi:.1f}) {_fmt(r.accuracy)} (n={r.n})"
                for r in self.by_depth.itertuples()
            )
        )
        gd = self.guard
        lines.append(
            f"design guard: phase uniform p={_fmt_p(gd['uniform_p'])},"
            f" phase independent of depth p={_fmt_p(gd['independence_p'])}"
        )
        notes = [
            f"{name}: {d['note']}"
            for name, d in (("chi2", ch), ("logistic", lo), ("guard", gd))
            if d.get("note")
        ]
        if notes:
            lines.append("notes: " + "; ".join(notes))
        return "\n".join(lines)


def phase_report(
    df: pd.DataFrame,
    stride: int,
    *,
    n_boot: int = 1000,
    n_perm: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
    n_depth_bins: int = 5,
) -> PhaseReport:
    """Everything in the reporting template (docs/statistics.md), deterministic given ``seed``.

    ``n_depth_bins`` sets the depth bins of ``by_depth``, the design guard and the permutation
    strata. The logistic test uses its default spline (``depth_df=4``), the gap 20 splits.
    """
    where = "phase_report"
    t = _load(df, stride, where)
    n_boot = check_int(where, "n_boot", n_boot, 0)
    n_perm = check_int(where, "n_perm", n_perm, 0)
    n_depth_bins = check_int(where, "n_depth_bins", n_depth_bins, 1)
    alpha = _check_alpha(where, alpha)
    return PhaseReport(
        stride=t.stride,
        n=len(t.correct),
        accuracy=float(t.correct.mean()),
        # Same seed handling as the standalone functions, so their results match the report's.
        per_phase=_per_phase(t, n_boot, np.random.default_rng(seed), alpha),
        by_depth=_by_depth(t, n_depth_bins, alpha),
        chi2=_chi2_phase(t),
        logistic=_logistic(t, 4),
        harmonics=_harmonics(t, alpha),
        gap=_phase_gap(t, n_perm, n_boot, 20, seed, alpha, n_depth_bins),
        guard=_design_guard(t, n_depth_bins),
        # the frame is already checked: reuse its flattened form
        paired=_paired(t, df["pair_id"].to_numpy()) if "pair_id" in df.columns else {},
    )
