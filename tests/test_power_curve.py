"""analyses/power_curve.py: the audit's per-phase tests hold their size with no gap and find a
large one at the audit's sample size (50 contents x 4 phases), in the right direction."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from phasemech.measure.pretrained import mcnemar_pairs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analyses"))
import power_curve  # noqa: E402


def test_simulated_audit_has_the_audits_shape_and_planted_accuracies():
    rng = np.random.default_rng(0)
    df = power_curve.simulate(20, rng, acc=0.9, content_sd=1.5)
    assert len(df) == 200 and df.groupby("seq_id").phase.nunique().eq(4).all()
    assert df.groupby("seq_id").depth.nunique().eq(1).all() and df.depth.nunique() == 5
    # the marginal per-phase accuracies are the planted ones despite the content shifts
    big = [power_curve.simulate(20, rng, 0.9, 1.5) for _ in range(40)]
    by = np.mean([f.groupby("phase").correct.mean().to_numpy() for f in big], axis=0)
    np.testing.assert_allclose(by, [0.9, 0.7, 0.9, 0.9], atol=0.03)


def test_mcnemar_is_the_audits():
    rng = np.random.default_rng(1)
    for gap in (10, 30):
        df = power_curve.simulate(gap, rng, acc=0.8, content_sd=1.0)
        want = float(mcnemar_pairs(df, 4)["p_holm"].min())
        assert power_curve.mcnemar_min_holm(df) == want


def test_power_is_the_size_at_no_gap_and_high_at_a_large_gap():
    tests = ("cochran", "perm")
    size = power_curve.power(0, 120, tests=tests, n_perm=50, seed=3)
    assert all(v <= 0.08 for v in size.values()), size
    strong = power_curve.power(30, 30, tests=tests, n_perm=50, seed=3)
    assert all(v >= 0.8 for v in strong.values()), strong
    assert all(strong[t] > size[t] for t in tests)
