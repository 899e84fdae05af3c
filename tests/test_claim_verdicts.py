"""The claims report's verdict rules, each with fixtures just either side of its threshold: a
test here fails if a rule's threshold moves."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from phasemech.experiments.claims.fixes import baseline_has_gap, fixes_verdict
from phasemech.experiments.claims.from_scratch import size_words
from phasemech.experiments.claims.real_fixes import multiplicity_line
from phasemech.experiments.claims.report import build_report
from phasemech.experiments.claims.sources import ALPHA, CLAIM_GAP_PP, Sources, holm_floor
from phasemech.experiments.claims.specialisation import (
    head_test_floor,
    real_model_verdict,
    run_reading,
)
from phasemech.experiments.claims.weak_spots import (
    DEPLOY_FRACTION,
    deployment_settings,
    replication,
    setting_command,
    weak_spots_verdict,
)

RESULTS = Path(__file__).resolve().parents[1] / "analyses" / "results"


# ------------------------------------------------------------------ claim 3: the head test's floor
def test_holm_floor_is_the_family_times_the_smallest_permutation_p():
    assert holm_floor(540, 1000) == pytest.approx(540 / 1001)
    assert holm_floor(2000, 1000) == 1.0
    with pytest.raises(ValueError, match="n_tests=0"):
        holm_floor(0, 1000)


def _run(n_heads: int, n_perm: int, **findings) -> dict:
    return dict(config=dict(n_perm=n_perm), findings=dict(n_heads_tested=n_heads, **findings))


def test_head_test_floor_reads_a_recorded_floor_else_computes_it():
    # 6 heads x zero and mean ablation = 12 tests: 12 / 240 = 0.05 (cannot reject), 12 / 241 can
    floor, m, n_perm = head_test_floor(_run(6, 239))
    assert (m, n_perm) == (12, 239) and floor == pytest.approx(0.05)
    assert run_reading(0, floor) == "not testable"
    floor = head_test_floor(_run(6, 240))[0]
    assert floor < ALPHA and run_reading(0, floor) == "not supported"
    assert run_reading(1, floor) == "supported" and run_reading(None, floor) == "not run"
    # a recorded floor (a later explain run states it) wins over the computed one
    assert head_test_floor(_run(6, 240, p_holm_floor=0.2))[0] == 0.2
    assert head_test_floor(_run(6, 1000, n_tests=3))[1] == 3
    # the recorded SmolLM2 runs: 270 heads x 2 forms, 1000 permutations -> 540 / 1001
    s = json.loads((RESULTS / "explain_quest_decode_T1024.json").read_text())
    assert head_test_floor(s)[:2] == (pytest.approx(540 / 1001), 540)


def test_real_model_verdict_separates_untestable_from_unsupported():
    v = real_model_verdict("m", [("`a` (decode)", "not testable", 0.539)])
    assert v.startswith("**Not testable post hoc**: no head of m was trained")
    assert "**not testable with this test**" in v and "1 of the 1 settings" in v
    assert "**not supported**" not in v
    v = real_model_verdict("m", [("`a`", "not supported", 0.01), ("`b`", "not run", 1.0)])
    assert "**not supported** post hoc" in v and "1 of the 1 settings" in v
    v = real_model_verdict("m", [("`a`", "supported", 0.01), ("`b`", "not testable", 0.5)])
    assert "**supported post hoc**" in v and "**not testable with this test**" in v
    assert "no recorded setting ablated heads" in real_model_verdict("m", [("`a`", "not run", 1)])


# ---------------------------------------------------------------------- claim 1: deployment gap
def _setting(gap: float, lo: float, p: float, seed: int = 0) -> dict:
    return dict(setting="route_d4_w16_k8", regime="decode", context=1024, budget=48,
                fraction=48 / 1024, accuracy=0.9, debiased_gap=gap, gap_lo=lo, gap_hi=gap + 0.1,
                p_perm=p, seed=seed)  # fmt: skip


def test_weak_spots_verdict_needs_the_papers_size_at_a_deployment_budget_and_a_correction():
    big = CLAIM_GAP_PP / 100
    anywhere = dict(setting="x", accuracy=0.4, debiased_gap=0.6, p_perm=0.001)
    rep = _setting(big, 0.001, 0.5, seed=1)
    assert "**Supported**" in weak_spots_verdict(anywhere, 8, _setting(big, 0.2, 0.5), 10, rep)
    # the chosen gap is the largest of many: a replication just below the paper's size is not
    low = dict(rep, debiased_gap=big - 0.001)
    assert "**Partly" in weak_spots_verdict(anywhere, 8, _setting(big, 0.2, 0.5), 10, low)
    # just below the paper's figure: partly (the largest gap anywhere holds: 0.001 x 8 < 0.05)
    below = weak_spots_verdict(anywhere, 8, _setting(big - 0.001, 0.2, 0.5), 10, rep)
    assert "**Partly supported**" in below and "below the paper's 40 pp" in below
    # the replication's CI must lie above 0
    flat = dict(rep, gap_lo=0.0)
    assert "**Partly" in weak_spots_verdict(anywhere, 8, _setting(big, 0.2, 0.5), 10, flat)
    # without a replication, the Bonferroni p over the settings searched decides: 10 x 0.0049
    assert "**Supported**" in weak_spots_verdict(anywhere, 8, _setting(big, 0.2, 0.0049), 10, None)
    v = weak_spots_verdict(anywhere, 8, _setting(big, 0.2, 0.0051), 10, None)
    assert "**Partly" in v and "does not hold after being chosen from 10" in v
    # the largest gap anywhere must hold after its own correction: 8 x 0.0062 = 0.0496 < 0.05
    dep = _setting(0.05, 0.0, 0.5)
    assert "**Partly" in weak_spots_verdict(dict(anywhere, p_perm=0.0062), 8, dep, 10, None)
    weak = dict(anywhere, p_perm=0.0063)
    assert "**Not supported**" in weak_spots_verdict(weak, 8, dep, 10, None)
    # a deployment gap below the paper's size that replicates is still a real weak spot
    rep_dep = dict(rep, gap_lo=0.001)
    assert "**Partly" in weak_spots_verdict(weak, 8, dep, 10, rep_dep)
    assert "**Not supported**" in weak_spots_verdict(weak, 8, dep, 10, dict(rep, gap_lo=0.0))


def _audit(path: Path, context: int, seed: int = 0) -> None:
    cfg = dict(designs=["route"], stride=4, window=16, top_k=1, layers=list(range(2, 30)),
               regime="decode", contexts=[context], contents=50, seed=seed)  # fmt: skip
    row = dict(setting="route_d4_w16_k1", accuracy=0.6, acc_by_phase=[0.7, 0.3, 0.6, 0.8],
               debiased_gap=0.3, gap_lo=0.1, gap_hi=0.5, p_perm=0.001)  # fmt: skip
    path.write_text(json.dumps(dict(config=cfg, rows=[dict(row, setting="null"), row])))


def test_deployment_settings_keep_budgets_of_at_least_the_fraction(tmp_path):
    # route k = 1 reads 20 tokens: exactly 1/32 of T = 640, just under it at T = 641
    assert DEPLOY_FRACTION == 1 / 32
    _audit(tmp_path / "audit_a.json", 640)
    _audit(tmp_path / "audit_b.json", 641)
    found = deployment_settings(tmp_path)
    assert [(s["context"], s["budget"]) for s in found] == [(640, 20)]
    assert found[0]["fraction"] == pytest.approx(1 / 32) and found[0]["top_k"] == 1
    assert replication(found, found[0]) is None
    _audit(tmp_path / "audit_c.json", 640, seed=3)  # the same setting on fresh contents
    found = deployment_settings(tmp_path)
    assert replication(found, found[0])["seed"] == 3
    assert "--top-k 1 --context 640 --layers 2-29 --contents 50 --seed 3" in setting_command(
        found[0], 3
    )


# ------------------------------------------------------------------- claim 2: ratio to the paper
def test_converged_gaps_are_stated_as_a_ratio_to_the_papers_figure():
    big = CLAIM_GAP_PP / 100
    assert size_words([0.01, big]).startswith("at the paper's size")
    words = size_words([0.009, big - 0.001])
    assert "at a fraction of the paper's size" in words and "0.022 to 0.998 times" in words
    assert "0.080 times the paper's 40 pp" in size_words([0.032]) and size_words([]) == ""


# ----------------------------------------------------------- claim 6: untestable without a gap
def _fix_results(lo: float, accuracies: list[float]) -> pd.DataFrame:
    rows = [dict(fix="aligned", seed="pooled", targets="all", debiased_lo=lo)]
    rows += [
        dict(fix="aligned", seed=i, targets="all", accuracy=a) for i, a in enumerate(accuracies)
    ]
    return pd.DataFrame(rows)


def test_a_fix_is_untestable_where_its_baseline_has_no_gap():
    assert baseline_has_gap(_fix_results(0.001, [0.95, 0.96]), "aligned", 0.95)
    assert not baseline_has_gap(_fix_results(0.0, [0.95, 0.96]), "aligned", 0.95)
    assert not baseline_has_gap(_fix_results(0.001, [0.949, 0.96]), "aligned", 0.95)
    assert fixes_verdict([], [], ["a vs b"]).startswith("**Untestable**")
    v = fixes_verdict([], ["c vs b"], ["a vs b"])
    assert "**Goal not met** by any of the 1 testable" in v and "untestable" in v
    assert fixes_verdict(["c (long)"], ["c vs b"], []).startswith("**Goal met** by c (long)")


# --------------------------------------------------------------- section 7: the rows it tests
def test_section_7_states_its_rows_and_that_it_does_not_correct():
    verdicts = ["meets the goal", "no baseline gap to cut", "does not cut the gap enough",
                "baseline gap not established"]  # fmt: skip
    t = pd.DataFrame(dict(verdict=verdicts))
    line = multiplicity_line([t, t.iloc[:1]])
    assert "tests 5 rows in 2 runs; 3 have an established baseline gap" in line
    assert "not corrected for the 3 rows" in line


# ------------------------------------------------------------ the report from recorded results
def test_the_report_from_the_recorded_results_alone():
    theory = json.loads((RESULTS / "theory_predictions.json").read_text())
    text = build_report(Sources(None, None, {}, theory, "cmd", RESULTS))
    assert text.count("Verdict") == 8 and "vary by machine" in text
    assert "**Not testable post hoc**" in text and "540/1001 = 0.539" in text
    assert "of the context, mean accuracy" in text and "times the paper's 40 pp" in text
