"""The from-scratch claim at convergence: a gap counts only above its dense control, only
converged models count, and the matched-accuracy excess is design minus dense."""

from __future__ import annotations

import numpy as np
import pytest

from phasemech.experiments.claims.converged import (
    converged_claim_lines,
    converged_settings,
    interventions_claim_lines,
    matched_excess,
    merge_summaries,
)


def _row(design, gap, lo, hi, acc=0.99, heads=2):
    return {"design": design, "stride": 4, "heads": heads, "seq_len": 64, "seed": "pooled",
            "targets": "all", "step": "final", "accuracy": acc, "debiased_gap": gap,
            "debiased_lo": lo, "debiased_hi": hi}  # fmt: skip


def _conv(design, converged, heads=2):
    return [{"design": design, "stride": 4, "heads": heads, "seq_len": 64, "seed": s,
             "converged": c} for s, c in enumerate(converged)]  # fmt: skip


def _summary():
    return {
        "rows": [
            _row("none", 0.01, 0.0, 0.02),
            _row("mean", 0.05, 0.03, 0.07),  # above 0 and above dense's CI: a gap
            _row("gated", 0.02, 0.01, 0.03),  # above 0 but inside dense's CI: the task's
            # (mlp: no pooled row, none of its seeds converged)
        ],
        "convergence": _conv("none", [True] * 3)
        + _conv("mean", [True, True, False])
        + _conv("gated", [True] * 3)
        + _conv("mlp", [False] * 3),
        "matched": [
            {"design": d, "stride": 4, "heads": 2, "seq_len": 64, "band": b, "raw_gap": g, "n": 5}
            for d, b, g in [
                ("none", "0.6-0.9", 0.05),
                ("mean", "0.6-0.9", 0.12),
                ("mean", "0.9-0.99", 0.04),
                ("gated", "0.6-0.9", 0.04),
            ]
        ],  # fmt: skip
    }


def test_settings_apply_the_dense_rule_and_list_unconverged_settings():
    s = converged_settings(_summary()).set_index("design")
    assert s.loc["mean", "has_gap"] and not s.loc["gated", "has_gap"]
    assert not s.loc["none", "has_gap"] and not s.loc["mlp", "has_gap"]
    assert (s.loc["mean", "converged"], s.loc["mean", "seeds"]) == (2, 3)
    assert s.loc["mlp", "converged"] == 0 and s.loc["mean", "dense_hi"] == 0.02


def test_matched_excess_is_design_minus_dense_at_the_same_band():
    ex = matched_excess(_summary()).set_index(["design", "band"])
    assert len(ex) == 2  # mean 0.9-0.99 has no dense partner in that band
    assert abs(ex.loc[("mean", "0.6-0.9"), "excess"] - 0.07) < 1e-12
    assert abs(ex.loc[("gated", "0.6-0.9"), "excess"] + 0.01) < 1e-12


def test_claim_lines_and_verdict():
    lines, verdict = converged_claim_lines(_summary(), "x.json")
    text = "\n".join(lines)
    assert "none converged: no gap" in text and "| mlp | 4 | 2 | 64 | 64 | 0 of 3 | - |" in text
    assert verdict.startswith("**Supported at convergence** for mean d=4 H=2 T=64")
    no_gap = _summary()
    no_gap["rows"][1] = _row("mean", 0.015, 0.005, 0.03)
    assert converged_claim_lines(no_gap, "x.json")[1].startswith("**Not supported")
    assert converged_claim_lines({}, "x.json")[1] == "not measured"


def _model(design, dependent, weak="", stride=4):
    return {"model": f"{design}_m", "design": design, "stride": stride, "accuracy": 0.99,
            "phase_range_pts": 1.0, "phase_dependent_heads": dependent,
            "heads_opening_weak_spot": weak}  # fmt: skip


def test_interventions_claim_needs_compressed_heads_beyond_dense():
    models = [_model("none", 0), _model("mean", 2, "L1.0->3"), _model("gated", 0)]
    lines, verdict = interventions_claim_lines({"models": models}, "x.json")
    assert verdict.startswith("**Supported at convergence** at d = 4: 1 of 2 converged")
    assert "0 of 1 dense" in verdict and "L1.0->3" in "\n".join(lines)
    # d = 8's dense control has one too: d = 8 is listed as not supported, d = 4 still holds
    d8 = [_model("none", 1, stride=8), _model("mean", 1, stride=8)]
    verdict = interventions_claim_lines({"models": models + d8}, "x.json")[1]
    assert verdict.endswith("; not at d = 8: 1 of 1 converged compressed models have a "
                            "phase-dependent head, 1 of 1 dense controls do")  # fmt: skip
    # a dense control with a phase-dependent head too: the heads are the task's, not a claim
    models[0] = _model("none", 1)
    assert interventions_claim_lines({"models": models}, "x.json")[1].startswith("**Not")
    models = [_model("none", 0), _model("mean", 0)]
    assert interventions_claim_lines({"models": models}, "x.json")[1].startswith("**Not")
    assert interventions_claim_lines({}, "x.json")[1] == "not measured"


def test_interventions_claim_judges_each_width_against_its_own_dense_controls():
    narrow = [_model("none", 1, stride=8), _model("mean", 1, stride=8)]
    wide = [{**_model("none", 0, stride=8), "d_model": 128},
            {**_model("mean", 1, stride=8), "d_model": 128}]  # fmt: skip
    verdict = interventions_claim_lines({"models": narrow + wide}, "x.json")[1]
    assert verdict.startswith("**Supported at convergence** at d = 8 d_model=128: 1 of 1")
    assert verdict.endswith("; not at d = 8: 1 of 1 converged compressed models have a "
                            "phase-dependent head, 1 of 1 dense controls do")  # fmt: skip


def _at_d8(rows: list[dict]) -> list[dict]:
    return [{**r, "stride": 8} for r in rows]


def test_merged_profiles_keep_each_setting_against_its_own_dense_control():
    d4 = _summary()
    # at d = 8 the same designs, but mean's gap sits inside the d = 8 dense control's CI
    d8 = {
        "rows": _at_d8([_row("none", 0.04, 0.03, 0.06), _row("mean", 0.05, 0.03, 0.07)]),
        "convergence": _at_d8(_conv("none", [True] * 3) + _conv("mean", [True] * 3)),
        "matched": [],
    }
    merged = merge_summaries([d4, d8])
    s = converged_settings(merged).set_index(["design", "stride"])
    assert s.loc[("mean", 4), "has_gap"] and not s.loc[("mean", 8), "has_gap"]
    assert s.loc[("mean", 8), "dense_hi"] == 0.06 and s.loc[("mean", 4), "dense_hi"] == 0.02
    verdict = converged_claim_lines(merged, "x.json")[1]
    assert "mean d=4 H=2 T=64" in verdict and "d=8" not in verdict
    # the same setting recorded twice would pool its seeds twice, even under other seeds
    with pytest.raises(ValueError, match="recorded by two sweep profiles"):
        merge_summaries([d4, d4])
    other_seeds = {**d8, "convergence": [{**r, "seed": r["seed"] + 10} for r in d8["convergence"]]}
    with pytest.raises(ValueError, match="'stride': 8"):
        merge_summaries([d8, other_seeds])


def test_widths_are_settings_of_their_own_each_against_its_own_dense_control():
    d4 = _summary()
    # the same settings at d_model 128: mean's gap now inside that width's dense control's CI
    wide = {
        "rows": [_row("none", 0.04, 0.03, 0.06), _row("mean", 0.05, 0.03, 0.07)],
        "convergence": _conv("none", [True] * 3) + _conv("mean", [True] * 3),
        "matched": [],
    }
    merged = merge_summaries([d4, wide], [64, 128])
    assert {r["d_model"] for r in merged["rows"]} == {64, 128}
    s = converged_settings(merged).set_index(["design", "d_model"])
    assert s.loc[("mean", 64), "has_gap"] and not s.loc[("mean", 128), "has_gap"]
    assert s.loc[("mean", 128), "dense_hi"] == 0.06 and s.loc[("mean", 64), "dense_hi"] == 0.02
    lines, verdict = converged_claim_lines(merged, "x.json")
    assert "| mean | 4 | 2 | 64 | 128 | 3 of 3 |" in "\n".join(lines)
    assert "mean d=4 H=2 T=64" in verdict and "d_model=128" not in verdict
    # the same width twice is the same setting twice; a width per summary, or an error
    with pytest.raises(ValueError, match="'d_model': 128"):
        merge_summaries([wide, wide], [128, 128])
    with pytest.raises(ValueError, match=r"d_models=\[64\] is invalid: need one width"):
        merge_summaries([d4, wide], [64])
    with pytest.raises(ValueError, match=r"d_models=\[\] is invalid"):
        merge_summaries([d4], [])
    # a width the rows record themselves must agree with the one given for their profile
    recorded = {t: [{**r, "d_model": 128} for r in wide[t]] for t in ("rows", "convergence")}
    assert merge_summaries([d4, recorded], [64, 128])["rows"][-1]["d_model"] == 128
    with pytest.raises(ValueError, match=r"d_models\[1\]=64 is invalid: .* records d_model=128"):
        merge_summaries([d4, recorded], [64, 64])
    assert "d_model" not in wide["rows"][0]  # the caller's rows are not changed


def test_a_gap_dense_models_show_at_the_same_accuracy_does_not_count():
    summary = _summary()
    summary["rows"][1] = _row("mean", 0.05, 0.03, 0.07, acc=0.95)  # ends in band 0.9-0.99
    s = converged_settings(summary).set_index("design")
    assert s.loc["mean", "band"] == "0.9-0.99" and s.loc["mean", "band_gap"] == 0.04
    # no dense evaluation in that band: the CI rule alone decides
    assert np.isnan(s.loc["mean", "band_dense_gap"]) and s.loc["mean", "has_gap"]
    lines = "\n".join(converged_claim_lines(summary, "x.json")[0])
    assert "0.040 (5) / no dense evaluation (band 0.9-0.99)" in lines
    # dense models at that accuracy showed a wider raw gap: not the design's
    summary["matched"].append(
        {
            "design": "none",
            "stride": 4,
            "heads": 2,
            "seq_len": 64,
            "band": "0.9-0.99",
            "raw_gap": 0.06,
            "n": 2,
        }  # fmt: skip
    )
    s = converged_settings(summary).set_index("design")
    assert s.loc["mean", "band_dense_gap"] == 0.06 and not s.loc["mean", "has_gap"]
    summary["matched"][-1]["raw_gap"] = 0.01  # narrower: the gap counts again
    assert converged_settings(summary).set_index("design").loc["mean", "has_gap"]
    # the setting itself never evaluated in that band, dense models were: no evidence of its
    # own beyond theirs, so no gap
    summary["matched"] = [m for m in summary["matched"] if m["design"] != "mean"]
    s = converged_settings(summary).set_index("design")
    assert np.isnan(s.loc["mean", "band_gap"]) and not s.loc["mean", "has_gap"]
    lines = "\n".join(converged_claim_lines(summary, "x.json")[0])
    assert "no evaluation / 0.010 (2) (band 0.9-0.99)" in lines


def test_verdict_marks_a_gap_read_off_one_converged_seed():
    one = _summary()
    one["convergence"] = (
        one["convergence"][:3] + _conv("mean", [True, False, False]) + (one["convergence"][6:])
    )
    verdict = converged_claim_lines(one, "x.json")[1]
    assert "mean d=4 H=2 T=64 (one converged seed)" in verdict
    assert "(one converged seed)" not in converged_claim_lines(_summary(), "x.json")[1]
