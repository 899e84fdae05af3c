"""phasemech.measure.stats on simulated evaluations with a known truth.

Every simulation has a fixed seed, so the tests are deterministic; the thresholds are set so
that a correct implementation passes with a wide margin and a wrong one (no cluster resampling,
a mis-scaled statistic, a biased gap) fails.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from scipy.special import expit, logit
from scipy.stats import binomtest

from phasemech.measure import stats
from phasemech.measure.stats import (
    PhaseReport,
    by_depth,
    chi2_phase,
    design_guard,
    harmonics,
    logistic_phase_test,
    newcombe_diff,
    omnibus,
    per_phase,
    phase_gap,
    phase_report,
    wilson_ci,
)

D = 8


def simulate(
    p_phase,
    *,
    n_seq: int = 400,
    per_seq: int = 10,
    n_seeds: int = 1,
    seq_sd: float = 0.0,
    seed_sd: float = 0.0,
    depth_logit=None,
    phase_weights=None,
    tie_to_depth: float = 0.0,
    rng: int = 0,
) -> pd.DataFrame:
    """``n_seq`` sequences x ``per_seq`` targets, uniform depths, Bernoulli correctness.

    ``logit P(correct) = logit(p_phase[phase]) + seq_sd * u_seq + seed_sd * u_seed
    + depth_logit(depth)``. Phases are drawn with ``phase_weights`` (uniform by default); with
    ``tie_to_depth`` that fraction of targets instead gets the phase ``floor(depth * d)``.
    ``seq_id`` restarts in every seed (a sequence is a (seed, seq_id) pair).
    """
    gen = np.random.default_rng(rng)
    d, n = len(p_phase), n_seq * per_seq
    seq = np.repeat(np.arange(n_seq), per_seq)
    seed = seq % n_seeds
    depth = gen.random(n)
    phase = gen.choice(d, size=n, p=phase_weights)
    tied = gen.random(n) < tie_to_depth
    phase[tied] = np.minimum((depth[tied] * d).astype(int), d - 1)
    eta = logit(np.asarray(p_phase, dtype=float))[phase]
    eta = eta + seq_sd * gen.normal(size=n_seq)[seq] + seed_sd * gen.normal(size=n_seeds)[seed]
    if depth_logit is not None:
        eta = eta + depth_logit(depth)
    return pd.DataFrame(
        {
            "correct": gen.random(n) < expit(eta),
            "phase": phase,
            "depth": depth,
            "seq_id": seq // n_seeds,
            "seed": seed,
            "comment": "extra columns are ignored",
        }
    )


def flat(p: float = 0.8, d: int = D) -> list[float]:
    return [p] * d


# --------------------------------------------------------------------------- intervals


@pytest.mark.parametrize("k, n", [(0, 10), (3, 10), (10, 10), (57, 200), (1, 1000)])
@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_wilson_matches_scipy(k, n, alpha):
    ref = binomtest(k, n).proportion_ci(confidence_level=1 - alpha, method="wilson")
    lo, hi = wilson_ci(k, n, alpha)
    assert lo == pytest.approx(ref.low, abs=1e-12)
    assert hi == pytest.approx(ref.high, abs=1e-12)


def test_wilson_vectorised_and_empty():
    lo, hi = wilson_ci(np.array([3, 0]), np.array([10, 0]))
    assert lo.shape == hi.shape == (2,)
    assert np.isnan(lo[1]) and np.isnan(hi[1])
    with pytest.raises(ValueError, match="k <= n"):
        wilson_ci(11, 10)


def test_newcombe_textbook():
    # Newcombe (1998), Stat Med 17:873, example (e): 56/70 vs 48/80.
    diff, lo, hi = newcombe_diff(56, 70, 48, 80)
    assert diff == pytest.approx(0.2)
    assert lo == pytest.approx(0.0524, abs=5e-5)
    assert hi == pytest.approx(0.3339, abs=5e-5)


def test_holm_matches_statsmodels():
    from statsmodels.stats.multitest import multipletests

    for p in ([0.01, 0.04, 0.03, 0.5], [0.3, 0.3, 0.001], [0.9, 0.8, 0.95, 0.99], [0.2]):
        p = np.array(p)
        np.testing.assert_allclose(stats.holm(p), multipletests(p, method="holm")[1])


# --------------------------------------------------------------------------- no phase effect


def test_flat_profile_is_not_flagged():
    """d=8, p=0.8, ~500 targets per phase, 20 data sets: the tests hold their size."""
    rows = []
    for r in range(20):
        df = simulate(flat(), rng=r)
        gap = phase_gap(df, D, n_perm=200, n_boot=100, n_splits=10, seed=r)
        rows.append(
            {
                "chi2": chi2_phase(df, D)["p"],
                "logistic": logistic_phase_test(df, D)["p"],
                "perm": gap["p_perm"],
                "holm_min": harmonics(df, D)["p_holm"].min(),
                "covers_0": gap["debiased_lo"] <= 0 <= gap["debiased_hi"],
                "raw_gap": gap["raw_gap"],
                "null_median": gap["null_median"],
                "debiased": gap["debiased_gap"],
            }
        )
    res = pd.DataFrame(rows)
    for test in ("chi2", "logistic", "perm", "holm_min"):
        assert (res[test] > 0.05).mean() >= 0.8, (test, res[test].tolist())
    assert res["covers_0"].mean() >= 0.8
    # the null gap mean is 0.051 at d=8, n=500, p=0.8; the raw gap is that biased.
    assert res["null_median"].between(0.035, 0.065).all()
    assert 0.040 < res["raw_gap"].mean() < 0.062
    # ... and the split-sample gap is not.
    assert abs(res["debiased"].mean()) < 0.012


@pytest.mark.parametrize("weights", [None, np.arange(1, D + 1) / np.arange(1, D + 1).sum()])
def test_harmonic_statistics_are_calibrated(weights):
    """T_k is chi2_2 (chi2_1 at k=d/2) without a phase effect, also with unequal counts.

    Fails if T_{d/2} carries the usual formula's factor 2 (mean 2, size ~17%) or if unequal
    counts are replaced by their mean (mean of T_1 ~3 with these weights).
    """
    stat, pval = [], []
    for r in range(300):
        h = harmonics(simulate(flat(), n_seq=200, per_seq=20, phase_weights=weights, rng=r), D)
        stat.append(h["statistic"].to_numpy())
        pval.append(h["p"].to_numpy())
    stat, pval = np.array(stat), np.array(pval)  # (rep, k)
    assert h["dof"].tolist() == [2, 2, 2, 1]
    assert stat[:, 0].mean() == pytest.approx(2.0, rel=0.2)
    assert stat[:, 3].mean() == pytest.approx(1.0, rel=0.25)
    size = (pval < 0.05).mean(0)
    assert ((size > 0.015) & (size < 0.095)).all(), size


# --------------------------------------------------------------------------- planted effects


def test_planted_dip_is_detected():
    p = flat()
    p[3] = 0.6
    df = simulate(p, rng=1)
    assert chi2_phase(df, D)["p"] < 0.01
    assert logistic_phase_test(df, D)["p"] < 0.01
    assert harmonics(df, D)["p_holm"].min() < 0.01
    gap = phase_gap(df, D, n_perm=500, n_boot=300, seed=0)
    assert gap["p_perm"] < 0.01
    assert gap["argmin_phase"] == 3
    assert gap["debiased_gap"] == pytest.approx(0.2, abs=0.06)
    assert gap["debiased_lo"] > 0.05
    assert gap["debiased_lo"] < gap["debiased_gap"] < gap["debiased_hi"]
    # A dip delta at one phase has |A_1| = 2 delta / d: 2|A_1| = 0.1.
    assert gap["harmonic_p2p"] == pytest.approx(0.1, abs=0.04)


def test_parity_pattern_is_a_k_half_harmonic():
    p = [0.8 + 0.05 * (-1) ** phi for phi in range(D)]
    h = harmonics(simulate(p, rng=2), D).set_index("k")
    assert h.loc[D // 2, "p_holm"] < 0.01
    assert bool(h.loc[D // 2, "significant"])
    assert h.loc[1, "p"] > 0.05
    # A cosine of amplitude a at k = d/2 has |A_k| = 2a (peak-to-peak).
    assert h.loc[D // 2, "amplitude"] == pytest.approx(0.1, abs=0.03)


# --------------------------------------------------------------------------- depth


def test_depth_effect_is_not_a_phase_effect_in_a_fair_design():
    """Lost in the middle (accuracy depends on depth only), phases independent of depth."""
    ps, guards = [], []
    for r in range(10):
        df = simulate(flat(), depth_logit=lambda x: 12 * (x - 0.5) ** 2 - 1.0, rng=100 + r)
        ps.append(logistic_phase_test(df, D)["p"])
        guards.append(design_guard(df, D))
    assert np.mean(np.array(ps) > 0.05) >= 0.8, ps
    assert np.mean([g["independence_p"] > 0.01 for g in guards]) >= 0.8
    assert np.mean([g["uniform_p"] > 0.01 for g in guards]) >= 0.8
    by = by_depth(df)
    assert by["accuracy"].iloc[2] < by["accuracy"].iloc[0] - 0.1  # the middle is worse


def test_logistic_separates_depth_from_phase_when_they_correlate():
    """Phase tied to depth, accuracy depends on depth only: chi2 is fooled, logistic is not."""
    df = simulate(flat(), tie_to_depth=0.7, depth_logit=lambda x: 3.0 * x - 2.0, rng=3)
    assert chi2_phase(df, D)["p"] < 1e-6
    assert logistic_phase_test(df, D)["p"] > 0.05
    guard = design_guard(df, D)
    assert guard["independence_p"] < 1e-6
    assert sum(guard["counts"]) == len(df)


# --------------------------------------------------------------------------- clusters


def _widths(table: pd.DataFrame) -> tuple[float, float]:
    boot = (table["boot_hi"] - table["boot_lo"]).mean()
    wilson = (table["wilson_hi"] - table["wilson_lo"]).mean()
    return boot, wilson


def test_cluster_bootstrap_widens_with_sequence_effects():
    correlated = simulate(flat(), n_seq=100, per_seq=40, seq_sd=1.5, rng=4)
    boot, wilson = _widths(per_phase(correlated, D, n_boot=400))
    assert boot > 1.2 * wilson
    independent = simulate(flat(), n_seq=100, per_seq=40, rng=4)
    boot, wilson = _widths(per_phase(independent, D, n_boot=400))
    assert 0.85 * wilson < boot < 1.15 * wilson


def test_bootstrap_resamples_seeds_when_there_are_several():
    df = simulate(flat(), n_seeds=5, seed_sd=1.0, rng=5)
    two_level, _ = _widths(per_phase(df, D, n_boot=400))
    # The same sequences without the seed level (seq_id made unique across seeds).
    one = df.drop(columns="seed").assign(seq_id=df["seq_id"] * 5 + df["seed"])
    one_level, _ = _widths(per_phase(one, D, n_boot=400))
    assert two_level > 1.5 * one_level


# --------------------------------------------------------------------------- degenerate data


def test_all_correct_is_degenerate_not_an_error():
    df = simulate(flat(), n_seq=50).assign(correct=True)
    for res in (chi2_phase(df, D), logistic_phase_test(df, D)):
        assert res["p"] == 1.0 and res["statistic"] == 0.0 and res["note"]
    h = harmonics(df, D)
    assert (h["p"] == 1.0).all()


def test_logistic_survives_separation():
    df = simulate(flat(), n_seq=50)
    df["correct"] = df["phase"] == 0  # phase predicts correctness perfectly
    res = logistic_phase_test(df, D)
    assert np.isfinite(res["statistic"]) and res["p"] < 1e-10
    assert "separation" in res["note"]
    # Near-all-correct, a few phases with no error at all.
    res = logistic_phase_test(simulate(flat(0.995), n_seq=40, per_seq=5, rng=6), D)
    assert 0 <= res["p"] <= 1


def test_logistic_fallbacks(monkeypatch):
    df = simulate(flat(), n_seq=100, rng=7)
    mle = logistic_phase_test(df, D)
    assert mle["note"] is None

    def broken(self, *args, **kwargs):
        raise np.linalg.LinAlgError("singular")

    monkeypatch.setattr(omnibus.GLM, "fit", broken)
    ridge = logistic_phase_test(df, D)
    assert "ridge" in ridge["note"]
    assert ridge["dof"] == mle["dof"]
    assert ridge["statistic"] == pytest.approx(mle["statistic"], rel=0.05)

    monkeypatch.setattr(omnibus.GLM, "fit_regularized", broken)
    last = logistic_phase_test(df, D)
    assert "chi-square" in last["note"]
    assert last["p"] == chi2_phase(df, D)["p"]


def test_design_guard_and_by_depth_edges():
    df = simulate(flat(), n_seq=20).assign(depth=0.5)  # every target in one depth bin
    guard = design_guard(df, D)
    assert np.isnan(guard["independence_p"]) and guard["note"]
    df = pd.DataFrame(
        {"correct": [1, 0, 1, 1], "depth": [0.0, 0.2, 0.99, 1.0], "phase": 0, "seq_id": 0}
    )
    by = by_depth(df, n_bins=5)
    assert by["n"].tolist() == [1, 1, 0, 0, 2]  # an edge belongs to the upper bin, 1 to the last
    assert by["depth_lo"].iloc[1] == pytest.approx(0.2)
    assert np.isnan(by["accuracy"].iloc[2]) and np.isnan(by["wilson_lo"].iloc[2])


# --------------------------------------------------------------------------- bad input


def _bad_inputs():
    good = simulate(flat(), n_seq=10)
    return {
        "missing": (good.drop(columns="depth"), D, r"missing column.*'depth'"),
        "phase_high": (good.assign(phase=good["phase"] + 1), D, r"'phase'.*8.*\[0, stride=8\)"),
        "phase_negative": (good.assign(phase=-1), D, r"'phase' has value -1"),
        "phase_fraction": (good.assign(phase=0.5), D, r"'phase'.*0\.5.*ints"),
        "stride_1": (good.assign(phase=0), 1, r"stride=1.*int >= 2"),
        "stride_float": (good, 8.0, r"stride=8\.0"),
        "empty": (good.iloc[:0], D, r"empty"),
        "correct": (good.assign(correct=2), D, r"'correct' has value 2.*bool or 0/1"),
        "depth": (good.assign(depth=1.5), D, r"'depth' has value 1\.5.*\[0, 1\]"),
        "seq_id_nan": (good.assign(seq_id=np.nan), D, r"'seq_id'.*missing"),
        "not_a_frame": (good.to_dict(), D, r"DataFrame"),
    }


FUNCTIONS = {
    "per_phase": per_phase,
    "chi2_phase": chi2_phase,
    "logistic_phase_test": logistic_phase_test,
    "harmonics": harmonics,
    "phase_gap": phase_gap,
    "phase_report": phase_report,
}


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_bad_input_raises(name, case):
    df, stride, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message) as info:
        FUNCTIONS[name](df, stride)
    assert str(info.value).startswith(f"{name}:")


def test_bad_parameters_raise():
    df = simulate(flat(), n_seq=10)
    with pytest.raises(ValueError, match="n_boot=-1"):
        per_phase(df, D, n_boot=-1)
    with pytest.raises(ValueError, match="alpha=1.5"):
        phase_gap(df, D, alpha=1.5)
    with pytest.raises(ValueError, match="missing column.*'depth'"):
        by_depth(df.drop(columns="depth"))
    with pytest.raises(ValueError, match="'phase' has value 9"):
        design_guard(df.assign(phase=9), D)


# --------------------------------------------------------------------------- the report


def test_report_is_deterministic_and_matches_the_functions():
    df = simulate(flat(), n_seq=100, n_seeds=2, rng=8)
    kwargs = dict(n_boot=60, n_perm=60)
    a = phase_report(df, D, seed=3, **kwargs).to_dict()
    assert a == phase_report(df, D, seed=3, **kwargs).to_dict()
    b = phase_report(df, D, seed=4, **kwargs).to_dict()
    assert a["per_phase"] != b["per_phase"] and a["gap"] != b["gap"]
    assert a["chi2"] == b["chi2"] and a["harmonics"] == b["harmonics"]
    report = phase_report(df, D, seed=3, **kwargs)
    pd.testing.assert_frame_equal(report.per_phase, per_phase(df, D, n_boot=60, seed=3))
    assert report.gap == phase_gap(df, D, n_perm=60, n_boot=60, seed=3)
    assert report.n == len(df) and report.accuracy == pytest.approx(df["correct"].mean())


def test_report_save_round_trip(tmp_path):
    df = simulate(flat(), n_seq=60, rng=9)
    df = df[df["phase"] != 7]  # phase 7 unobserved: NaN accuracy, NaN harmonics
    report = phase_report(df, D, n_boot=50, n_perm=50)
    assert isinstance(report, PhaseReport)
    as_dict = report.to_dict()
    json.dumps(as_dict, allow_nan=False)
    assert as_dict["per_phase"][7]["accuracy"] is None
    assert as_dict["per_phase"][7]["n"] == 0
    assert as_dict["harmonics"][0]["p"] is None
    assert isinstance(as_dict["gap"]["argmin_phase"], int)

    out = tmp_path / "run"
    report.save(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "by_depth.parquet",
        "harmonics.parquet",
        "per_phase.parquet",
        "report.json",
    ]  # no temp files left behind
    for name in ("per_phase", "by_depth", "harmonics"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(out / f"{name}.parquet"), getattr(report, name)
        )
    assert json.loads((out / "report.json").read_text()) == as_dict

    text = report.summary()
    assert text.startswith("stride 8:")
    assert "n/a" in text  # the unobserved phase
    assert len(text.splitlines()) == 2 + D + 5  # + the by-depth line


# --------------------------------------------------------------------------- paired design


def paired_frame(p_phase, n_blocks: int, rng: np.random.Generator, copies: int = 1):
    """Each block = one target measured ``copies`` times at every phase; a block effect makes
    copies of one target correlated (as the shifted copies of one content are)."""
    d = len(p_phase)
    block_effect = rng.normal(0, 1.5, size=n_blocks)
    rows = []
    for b in range(n_blocks):
        for _ in range(copies):
            for phase in range(d):
                prob = expit(logit(p_phase[phase]) + block_effect[b])
                rows.append((b, phase, rng.random() < prob))
    df = pd.DataFrame(rows, columns=["pair_id", "phase", "correct"])
    return df.assign(depth=0.5, seq_id=df["pair_id"])


def test_paired_test_matches_statsmodels_and_finds_a_dip():
    from statsmodels.stats.contingency_tables import cochrans_q

    rng = np.random.default_rng(0)
    dip = paired_frame([0.8, 0.8, 0.55, 0.8], 300, rng)
    res = stats.paired_phase_test(dip, 4)
    x = dip.pivot(index="pair_id", columns="phase", values="correct").to_numpy(float)
    assert res["statistic"] == pytest.approx(cochrans_q(x).statistic)
    assert res["p"] < 0.01 and res["blocks"] == 300 and res["dropped"] == 0
    report = stats.phase_report(dip, 4, n_boot=50, n_perm=50)
    assert report.paired["p"] == res["p"] and "Cochran" in report.summary()


def test_paired_test_size_under_no_effect():
    rng = np.random.default_rng(1)
    pvals = [
        stats.paired_phase_test(paired_frame(flat(0.8, 4), 200, rng), 4)["p"] for _ in range(20)
    ]
    assert np.mean(np.asarray(pvals) < 0.05) <= 0.2


def test_paired_test_splits_repeated_blocks_and_drops_incomplete_ones():
    rng = np.random.default_rng(2)
    df = paired_frame(flat(0.7, 4), 50, rng, copies=2)  # 8 shifts seen on a stride-4 grid
    res = stats.paired_phase_test(df, 4)
    assert res["blocks"] == 100 and res["dropped"] == 0
    res = stats.paired_phase_test(df.iloc[1:], 4)  # block 0 loses one copy at phase 0
    assert res["blocks"] == 99 and res["dropped"] == 1


def test_paired_test_without_pairs_or_discordance():
    df = simulate(flat(0.8, 4), n_seq=20, per_seq=4, rng=3)
    assert np.isnan(stats.paired_phase_test(df, 4)["p"])
    assert stats.phase_report(df, 4, n_boot=20, n_perm=20).paired == {}
    same = paired_frame(flat(0.8, 4), 10, np.random.default_rng(4)).assign(correct=True)
    assert stats.paired_phase_test(same, 4)["p"] == 1.0


def _scored(effect: float, acc: float, seeds: int, rng: np.random.Generator) -> pd.DataFrame:
    """Models (seeds) scoring one shared test set of 300 contents x 8 phases."""
    phase = np.tile(np.arange(8), 300)
    content = np.repeat(np.arange(300), 8)
    p = acc + effect * np.cos(2 * np.pi * phase / 8) / 2
    return pd.concat(
        [
            pd.DataFrame(
                {"seed": s, "seq_id": content, "phase": phase, "correct": rng.random(len(p)) < p}
            )
            for s in range(seeds)
        ],
        ignore_index=True,
    )


def test_compare_gaps_sees_a_fix_that_removes_the_gap():
    rng = np.random.default_rng(0)
    base, fix = _scored(0.3, 0.5, 3, rng), _scored(0.0, 0.5, 3, rng)
    c = stats.compare_gaps(base, fix, 8, n_boot=200, seed=1)
    assert c["gap_baseline"] == pytest.approx(0.3, abs=0.06)
    assert abs(c["gap_other"]) < 0.06
    assert c["reduction_lo"] > 0.6 and c["reduction"] > 0.8
    assert c["accuracy_diff_lo"] < 0 < c["accuracy_diff_hi"]  # same mean accuracy
    assert c == stats.compare_gaps(base, fix, 8, n_boot=200, seed=1)  # deterministic


def test_compare_gaps_finds_no_reduction_between_equal_models():
    rng = np.random.default_rng(1)
    base, same = _scored(0.3, 0.5, 3, rng), _scored(0.3, 0.5, 3, rng)
    c = stats.compare_gaps(base, same, 8, n_boot=200, seed=2)
    assert c["reduction_lo"] < 0 < c["reduction_hi"]
    assert c["gap_other_lo"] > 0.1  # the gap is still there
    worse = _scored(0.3, 0.3, 3, rng)
    c = stats.compare_gaps(base, worse, 8, n_boot=200, seed=2)
    assert c["accuracy_diff_hi"] < -0.1  # a fix that costs accuracy is seen as one


def test_compare_gaps_rejects_bad_input():
    rng = np.random.default_rng(2)
    base = _scored(0.3, 0.5, 1, rng)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['seq_id'\]"):
        stats.compare_gaps(base, base.drop(columns="seq_id"), 8)
    with pytest.raises(ValueError, match="phase.*outside"):
        stats.compare_gaps(base, base, 4)
    with pytest.raises(ValueError, match="n_boot=-1"):
        stats.compare_gaps(base, base, 8, n_boot=-1)
