"""The specialisation test's inference pinned through its public API
(``specialization(frame, metric, n_perm=..., seed=...)``): Holm over the units, the index from
absolute effects, the depth-stratified null under a design that confounds phase with depth,
and a two-sided size over hundreds of null units.

Axes: ``unit``, ``row`` (one unit's score of one target), ``phase``, ``depth``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from statsmodels.stats.multitest import multipletests

from phasemech.interventions.specialization import specialization

STRIDE = 4


def _frame(effect: np.ndarray, group, target, phase, depth) -> pd.DataFrame:
    """Targets frame of ``effect`` ``(unit, row)``: head units of layer 0, zero ablation,
    baseline logprob 0, so each row's effect is ``effect[unit, row]`` exactly."""
    n_units, n = effect.shape
    return pd.DataFrame(
        {
            "component": "head",
            "mode": "zero",
            "layer": 0,
            "unit": np.repeat(np.arange(n_units), n),
            "group_id": np.tile(group, n_units),
            "target": np.tile(target, n_units),
            "phase": np.tile(phase, n_units),
            "depth": np.tile(depth, n_units),
            "logprob_base": 0.0,
            "logprob": effect.ravel(),
        }
    )


def _balanced(n_groups: int):
    """Every group holds each phase once (a phase-balanced set): the within-block null."""
    group = np.repeat(np.arange(n_groups), STRIDE)
    phase = np.tile(np.arange(STRIDE), n_groups)
    depth = np.repeat(np.linspace(0.1, 0.9, n_groups), STRIDE)
    return group, np.zeros_like(group), phase, depth


def test_p_holm_is_holm_of_the_units_p_perm():
    """Graded phase-2 effects give distinct permutation p-values; p_holm is their Holm
    adjustment (statsmodels'), not p_perm itself and not Bonferroni's ``m * p``; units the
    test cannot tell apart from the strongest share the smallest attainable Holm p, ``m / (1 +
    n_perm)``."""
    rng = np.random.default_rng(0)
    group, target, phase, depth = _balanced(30)
    size = np.array([0.0, 0.1, 0.25, 0.4, 0.55, 0.7, 3.0, 3.0])
    effect = -size[:, None] * (phase == 2) + rng.normal(0, 1, (len(size), len(phase)))
    sp = specialization(_frame(effect, group, target, phase, depth), "logprob", n_perm=400)
    p = sp["p_perm"].to_numpy()
    expected = multipletests(p, method="holm")[1]
    np.testing.assert_allclose(sp["p_holm"], expected, rtol=1e-12)
    bonferroni = np.minimum(len(p) * p, 1)
    assert (sp["p_holm"] < bonferroni - 1e-9).any()  # the fixture tells Holm from Bonferroni
    assert (sp["p_holm"] > p + 1e-9).sum() >= len(p) - 1
    strong = sp.unit >= 6
    assert (sp.loc[strong, "p_perm"] == 1 / 401).all()
    np.testing.assert_allclose(sp.loc[strong, "p_holm"], 8 / 401, rtol=1e-12)


def test_specialization_index_reads_absolute_effects():
    """SI = 1 - H(|e| / sum |e|) / log d. A unit that hurts phase 0 and helps phase 1 equally
    has SI 0.5 (two phases carry it), not the 0 that signed effects (summing to 0) give."""
    group, target, phase, depth = _balanced(10)
    profiles = np.array(
        [
            [-1.0, 1.0, 0.0, 0.0],  # two phases, opposite signs: SI = 1 - log 2 / log 4
            [-0.6, -0.2, -0.2, 0.0],  # 1 - H(0.6, 0.2, 0.2) / log 4
            [-0.5, 0.5, -0.5, 0.5],  # spread evenly: 0
            [0.0, 0.0, -2.0, 0.0],  # one phase: 1
        ]
    )
    sp = specialization(
        _frame(profiles[:, phase], group, target, phase, depth), "logprob", n_perm=10
    )
    h = -(0.6 * math.log(0.6) + 2 * 0.2 * math.log(0.2))
    want = [0.5, 1 - h / math.log(4), 0.0, 1.0]
    np.testing.assert_allclose(sp.sort_values("unit")["si"], want, atol=1e-12)
    np.testing.assert_allclose(sp.sort_values("unit")["phase_range"], [2, 0.6, 1, 2], atol=1e-12)


def _confounded(rng: np.random.Generator, n: int = 200):
    """Unbalanced rows (the depth-quintile null): five depths, 40 rows each; at depth ``j``
    70% of the rows sit at phase ``j mod 4``."""
    j = np.repeat(np.arange(5), n // 5)
    phase = np.where(rng.random(n) < 0.7, j % STRIDE, rng.integers(0, STRIDE, n))
    depth = np.array([0.1, 0.3, 0.5, 0.7, 0.9])[j]
    return np.arange(n) // 4, np.zeros(n, np.int64), phase, depth, j


def test_depth_confounded_design_keeps_p_perm_large():
    """The effect depends on depth only (0 to -2 over the five depths), phase is confounded
    with depth: within depth quintiles the null stays exact (~5% of 60 units below 0.05);
    one stratum (quintiles collapsed, or no strata) credits depth to phase (p = 1/201 for
    all). A unit with a real phase effect at fixed depth is still found."""
    rng = np.random.default_rng(1)
    group, target, phase, depth, j = _confounded(rng)
    null = -0.5 * j + rng.normal(0, 0.3, (60, len(j)))
    real = -0.5 * j - 0.5 * (phase == 3) + rng.normal(0, 0.3, len(j))
    frame = _frame(np.vstack([null, real]), group, target, phase, depth)
    sp = specialization(frame, "logprob", n_perm=200, seed=0).sort_values("unit")
    assert (sp.null == "depth_quintile").all()
    p = sp.p_perm.to_numpy()
    assert np.mean(p[:60] < 0.05) <= 0.15, np.sort(p[:60])[:10]
    assert np.median(p[:60]) > 0.3, np.median(p[:60])
    assert p[60] == 1 / 201 and sp.served_phase.iloc[60] == 3


def test_null_size_is_nominal_two_sided():
    """300 units without a phase effect on a phase-balanced set (within-block null): the share
    of p_perm below 0.05 lies in [0.025, 0.085] and below 0.5 in [0.42, 0.58] (a null that is
    too strict fails as well as one that is too lax)."""
    rng = np.random.default_rng(2)
    group, target, phase, depth = _balanced(20)
    block = rng.normal(0, 1, (300, 20))[:, group]  # content offsets: removed by the pairing
    effect = block + rng.normal(0, 1, (300, len(phase)))
    sp = specialization(_frame(effect, group, target, phase, depth), "logprob", n_perm=200)
    assert (sp.null == "within_block").all()
    p = sp.p_perm.to_numpy()
    assert 0.025 <= np.mean(p < 0.05) <= 0.085, np.mean(p < 0.05)
    assert 0.42 <= np.mean(p < 0.5) <= 0.58, np.mean(p < 0.5)
