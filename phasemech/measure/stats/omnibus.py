"""Omnibus tests of "no phase effect": chi-square over phases, a logistic likelihood-ratio
test controlling for depth, and the Fourier harmonics of accuracy over the phase cycle
(Holm-corrected). They treat targets as independent trials (see :mod:`phasemech.measure.stats`).

Axes: ``target``, ``phase``; in :func:`harmonics` ``k`` is the harmonic index.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import patsy
from scipy import stats as sps
from statsmodels.genmod import families
from statsmodels.genmod.generalized_linear_model import GLM

from phasemech.core.validation import check_int
from phasemech.measure.stats.targets import Targets, check_alpha, load_targets, ratio_or_nan


def chi2_phase_on_targets(t: Targets) -> dict:
    """:func:`chi2_phase` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
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
    return chi2_phase_on_targets(load_targets(df, stride, "chi2_phase"))


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


def logistic_phase_test_on_targets(t: Targets, depth_df: int) -> dict:
    """:func:`logistic_phase_test` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
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
            chi = chi2_phase_on_targets(t)
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
    t = load_targets(df, stride, "logistic_phase_test")
    return logistic_phase_test_on_targets(
        t, check_int("logistic_phase_test", "depth_df", depth_df, 0)
    )


def holm(p: np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values, as ``multipletests(p, method="holm")[1]``.

    Not that call itself: in statsmodels 0.15 its Holm branch runs ``gc.collect()``, which costs
    0.2 s and up in a process holding torch and a model (tests/test_stats.py checks equality).
    """
    order = np.argsort(p)
    adjusted = np.maximum.accumulate(p[order] * np.arange(len(p), 0, -1))
    out = np.empty_like(adjusted)
    out[order] = np.minimum(adjusted, 1.0)
    return out


def harmonics_on_targets(t: Targets, alpha: float) -> pd.DataFrame:
    """:func:`harmonics` on checked :func:`load_targets` output (:func:`phase_report`
    checks its frame once for all its statistics)."""
    d = t.stride
    k, n = t.phase_counts()
    p = ratio_or_nan(k, n)
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
        p_holm = holm(pval)
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
    t = load_targets(df, stride, "harmonics")
    return harmonics_on_targets(t, check_alpha("harmonics", alpha))


__all__ = [
    "chi2_phase",
    "chi2_phase_on_targets",
    "harmonics",
    "harmonics_on_targets",
    "logistic_phase_test",
    "logistic_phase_test_on_targets",
]
