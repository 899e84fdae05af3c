"""The statistics' inference pinned, not only their formulas: exact Holm values, paired
intervals that vanish between identical frames, two-sided interval widths and coverage over
a few hundred simulated data sets, noise-floor corrections, and depth-stratified nulls under
designs that confound phase with depth.

Each test names the wrong implementation it fails on (docs/statistics.md, "What the tests
pin"). Every simulation is seeded; the bounds leave several standard errors of Monte Carlo
noise on both sides of the correct implementation's value.

Axes: ``sim`` (simulated data sets), ``content``, ``phase``, ``depth``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.special import expit

from phasemech.measure import stats
from phasemech.measure.stats import compare_gaps, phase_gap

# --------------------------------------------------------------------------- Holm


def test_holm_exact_values_for_a_known_ordering():
    """Step-down by hand: sorted 0.01, 0.03, 0.04, 0.5 times 4, 3, 2, 1, running maximum.
    Bonferroni (every p times 4) gives 0.16, 0.12, 1 where Holm gives 0.09, 0.09, 0.5."""
    p = np.array([0.01, 0.04, 0.03, 0.5])
    np.testing.assert_allclose(stats.holm(p), [0.04, 0.09, 0.09, 0.5], rtol=0, atol=1e-15)
    # the running maximum: a smaller p later in the order cannot lower an earlier adjustment
    p = np.array([0.02, 0.021, 0.3, 0.31, 0.9])
    np.testing.assert_allclose(stats.holm(p), [0.1, 0.1, 0.9, 0.9, 0.9], atol=1e-15)
    # capped at 1, and a single p is unchanged
    np.testing.assert_allclose(stats.holm(np.array([0.4, 0.6])), [0.8, 0.8], atol=1e-15)
    assert stats.holm(np.array([0.37]))[0] == 0.37


# --------------------------------------------------------------------------- compare_gaps


def _audit_pair(rng: np.random.Generator, n: int = 50, flip: float = 0.05):
    """An audit-sized pair: ``n`` contents x 4 phases, contents of very different difficulty
    (logit sd 1.5), the fix agreeing with the baseline on all but ``flip`` of the prompts."""
    content, phase = np.repeat(np.arange(n), 4), np.tile(np.arange(4), n)
    base = rng.random(4 * n) < expit(1.0 + rng.normal(0, 1.5, n)[content])
    fix = np.where(rng.random(4 * n) < flip, ~base, base)
    frame = lambda c: pd.DataFrame({"correct": c, "phase": phase, "seq_id": content})  # noqa: E731
    return frame(base), frame(fix), content


def test_compare_gaps_of_a_frame_with_itself_has_a_zero_accuracy_interval():
    """Contents drawn once for both frames: every replicate scores the same prompts twice, so
    the difference is exactly 0 in every replicate (drawn separately for each frame, it spreads
    over several points)."""
    base, _, _ = _audit_pair(np.random.default_rng(0))
    c = compare_gaps(base, base, 4, n_boot=200, seed=0)
    assert c["accuracy_diff"] == 0
    assert c["accuracy_diff_lo"] == 0 and c["accuracy_diff_hi"] == 0


def test_compare_gaps_accuracy_interval_has_the_paired_width():
    """Correlated frames (the fix flips 5% of the baseline's answers): the bootstrap interval of
    the accuracy difference is as wide as the paired normal interval ``2 * 1.96 * sd(d_c) /
    sqrt(C)`` of the per-content differences ``d_c`` (ratio 0.99 on average over these seeds);
    resampling the frames unpaired makes it an order of magnitude wider, enough to fail a
    1-point non-inferiority margin on its own."""
    ratios = []
    for s in range(6):
        base, fix, content = _audit_pair(np.random.default_rng(s))
        c = compare_gaps(base, fix, 4, n_boot=1000, seed=0)
        diff = pd.Series(fix["correct"].astype(float) - base["correct"].astype(float))
        d_c = diff.groupby(content).mean()
        paired = 2 * 1.96 * d_c.std(ddof=0) / np.sqrt(len(d_c))
        ratios.append((c["accuracy_diff_hi"] - c["accuracy_diff_lo"]) / paired)
        assert c["accuracy_diff_lo"] <= c["accuracy_diff"] <= c["accuracy_diff_hi"]
    assert 0.8 < np.mean(ratios) < 1.2, ratios
    assert max(ratios) < 1.4, ratios


# --------------------------------------------------------------------------- phase_gap


def _frames(rng: np.random.Generator, p_phase, n_sims: int, n_seq: int = 100, per_seq: int = 4):
    """``n_sims`` independent frames of ``n_seq`` sequences x ``per_seq`` targets, uniform
    phases and depths, correct ~ Bernoulli(p_phase[phase])."""
    p_phase, d, n = np.asarray(p_phase), len(p_phase), n_seq * per_seq
    seq = np.repeat(np.arange(n_seq), per_seq)
    phase = rng.integers(0, d, (n_sims, n))
    correct = rng.random((n_sims, n)) < p_phase[phase]
    depth = rng.random((n_sims, n))
    return [
        pd.DataFrame({"correct": correct[i], "phase": phase[i], "depth": depth[i], "seq_id": seq})
        for i in range(n_sims)
    ]


def _debiased(frames, d: int) -> np.ndarray:
    """``(sim, 3)``: debiased gap, its lower and upper bootstrap bound."""
    out = [phase_gap(f, d, n_perm=0, n_boot=200, n_splits=20, seed=i) for i, f in enumerate(frames)]
    return np.array([[g["debiased_gap"], g["debiased_lo"], g["debiased_hi"]] for g in out])


def test_debiased_gap_interval_is_as_wide_as_the_estimate_varies():
    """No phase effect, d = 4, 400 targets, 300 data sets: the mean width of the 95% interval
    over ``2 * 1.96 * sd`` of the debiased gap across data sets is 1.16; without the correction
    for the replicates' extra split noise it is 1.54 (too wide). Two-sided: a too narrow
    interval fails too."""
    est, lo, hi = _debiased(_frames(np.random.default_rng(0), [0.8] * 4, 300), 4).T
    ratio = (hi - lo).mean() / (2 * 1.96 * est.std())
    assert 0.9 < ratio < 1.35, ratio
    assert abs(est.mean()) < 0.02  # centred on the true gap, 0


def test_debiased_gap_interval_covers_a_planted_gap_two_sided():
    """A dip of 0.3 at one phase (d = 4, 400 targets, 300 data sets): the interval covers the
    true gap in 96.7% of data sets (nominal 95%, bounds [0.89, 0.985]) and its width matches
    the estimate's spread (ratio 1.18; 1.36 without the split-noise correction)."""
    est, lo, hi = _debiased(_frames(np.random.default_rng(1), [0.8, 0.8, 0.8, 0.5], 300), 4).T
    cover = ((lo <= 0.3) & (0.3 <= hi)).mean()
    assert 0.89 <= cover <= 0.985, cover
    ratio = (hi - lo).mean() / (2 * 1.96 * est.std())
    assert 0.9 < ratio < 1.28, ratio
    assert est.mean() == pytest.approx(0.3, abs=0.015)


def _p2p(frames, d: int) -> np.ndarray:
    gaps = [phase_gap(f, d, n_perm=0, n_boot=0, n_splits=1) for f in frames]
    return np.array([g["harmonic_p2p"] for g in gaps])


def test_harmonic_p2p_is_zero_in_most_null_data_sets():
    """No phase effect: |A_1|^2 is its noise floor times an Exp(1) draw (chi-square 2 / 2), so
    the corrected amplitude is exactly 0 in 1 - 1/e = 63% of data sets (62.5% here). Without
    the noise correction it is never 0 and its mean is ~2.7x larger."""
    p2p = _p2p(_frames(np.random.default_rng(2), [0.8] * 4, 200), 4)
    assert 0.53 < (p2p == 0).mean() < 0.73, (p2p == 0).mean()
    # E = 2 sqrt(noise) e^-1 Gamma(3/2) = 0.65 sqrt(noise), noise = (4/d^2) p(1-p) sum 1/n_phi
    # = 0.0016: 0.026 (uncorrected: 2 sqrt(noise) Gamma(3/2) = 0.071)
    assert 0.018 < p2p.mean() < 0.034, p2p.mean()


def test_harmonic_p2p_is_unbiased_for_a_planted_cosine():
    """``p = 0.7 + 0.06 cos(2 pi phi / 4)``: ``(p2p / 2)^2`` estimates ``|A_1|^2 = 0.0036``
    without bias (0.0040 over these data sets; the noise floor, 0.0021 here, is subtracted:
    uncorrected it would average 0.0057)."""
    p = 0.7 + 0.06 * np.cos(2 * np.pi * np.arange(4) / 4)
    sq = (_p2p(_frames(np.random.default_rng(3), p, 300), 4) / 2) ** 2
    assert sq.mean() == pytest.approx(0.0036, abs=0.0012), sq.mean()


def _depth_confounded(rng: np.random.Generator, n_contents: int = 100) -> pd.DataFrame:
    """Five depths; at depth ``j`` most targets sit at phase ``j mod 4``; accuracy depends on
    the depth only (0.95 down to 0.35). No phase effect once depth is held fixed."""
    depths = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
    j = np.repeat(np.arange(5), n_contents // 5 * 4)
    favoured = rng.random(len(j)) < 0.7
    phase = np.where(favoured, j % 4, rng.integers(0, 4, len(j)))
    acc = np.array([0.95, 0.8, 0.65, 0.5, 0.35])[j]
    return pd.DataFrame(
        {
            "correct": rng.random(len(j)) < acc,
            "phase": phase,
            "depth": depths[j],
            "seq_id": np.arange(len(j)) // 4,
        }
    )


def test_gap_permutation_null_is_stratified_by_depth():
    """Phase confounded with depth, accuracy a function of depth only: shuffling phases within
    depth bins keeps the null exact (about 5% of p below 0.05); shuffling them across depths
    credits the depth effect to phase (p ~ 1e-3 in every data set)."""
    rng = np.random.default_rng(4)
    p = [phase_gap(_depth_confounded(rng), 4, n_perm=200, n_boot=0, n_splits=1, seed=s)["p_perm"]
         for s in range(40)]  # fmt: skip
    assert np.mean(np.asarray(p) < 0.05) <= 0.15, p
    assert np.median(p) > 0.25, np.median(p)
