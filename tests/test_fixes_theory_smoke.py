"""The issue-7 analyses end to end at their tiny profiles, and the report's readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analyses"))
import report  # noqa: E402


def _run(script: str, runs: Path) -> str:
    cmd = [sys.executable, str(ROOT / "analyses" / script), "--profile", "tiny"]
    done = subprocess.run(
        [*cmd, "--runs", str(runs), "--workers", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_fixes_tiny_trains_every_fix_and_compares_with_its_baseline(tmp_path):
    stdout = _run("fixes.py", tmp_path)
    out = tmp_path / "fixes_tiny"
    summary = json.loads((out / "summary.json").read_text())
    fixes = {r["fix"] for r in summary["results"]}
    assert fixes == {
        "aligned",
        "staggered_head",
        "random_offset",
        "jittered_data",
        "aligned_3layer",
        "staggered_layer",
    }
    pairs = {(r["fix"], r["baseline"]) for r in summary["comparison"]}
    assert ("staggered_layer", "aligned_3layer") in pairs and ("random_offset", "aligned") in pairs
    assert all(r["n_boot"] == 50 for r in summary["comparison"])
    assert "meets goal" in (out / "summary.md").read_text() and "train + score" in stdout
    # the grids really differ: per-layer staggering shifts the third layer's grid
    cfg = json.loads((out / "staggered_layer_s0" / "train_config.json").read_text())
    assert cfg["compression"]["offsets"] == "per_layer" and cfg["model"]["n_layers"] == 3
    # a rerun trains nothing: every model is cached
    assert "step 20" in _run("fixes.py", tmp_path)


def test_theory_trained_tiny_maps_gated_models_onto_the_theory(tmp_path):
    _run("theory_trained.py", tmp_path)
    out = tmp_path / "theory_trained_tiny"
    summary = json.loads((out / "summary.json").read_text())
    assert [m["heads"] for m in summary["models"]] == [2, 4]
    for m in summary["models"]:
        assert len(m["acc_by_phase"]) == len(m["predicted_accuracy"]) == 4
        assert len(m["assignment"]) == m["heads"]
    w = pd.read_parquet(out / "weights.parquet")
    assert set(w["heads"]) == {2, 4} and (w["layer"] == 1).all()


def test_report_reads_the_recorded_tables():
    rows = report.md_table(report.RESULTS / "phase_sweep_default.md")
    assert rows and {"design", "debiased gap [95% CI]", "null p95"} <= set(rows[0])
    g, lo, hi = report.with_ci(rows[0]["debiased gap [95% CI]"])
    assert lo <= g <= hi
    assert report.numbers("0.920 [0.88, 0.95] 0.765 [0.71, 0.82]") == [0.92, 0.765]
    with pytest.raises(ValueError, match="value \\[low, high\\]"):
        report.with_ci("0.3")


def test_fixes_profile_names_a_fix_without_its_baseline():
    import fixes

    base = fixes.PROFILES["tiny"]
    kw = {k: getattr(base, k) for k in base.__dataclass_fields__ if k != "fixes"}
    with pytest.raises(ValueError, match="needs its baseline 'aligned'"):
        fixes.Profile(**kw, fixes=("staggered_head",))
    with pytest.raises(ValueError, match="fix='shuffled' is invalid"):
        fixes.Profile(**kw, fixes=("aligned", "shuffled"))
    assert fixes.off_plateau(fixes.PLATEAU_EXIT) and not fixes.off_plateau(0.21)


def _fixes_summary(fix_acc: list[float], reduction: float, meets: bool) -> dict:
    """A recorded fixes summary with one fix whose seeds reach ``fix_acc``."""
    rows = []
    for fix, accs in (("aligned", [0.6, 0.5, 0.55]), ("random_offset", fix_acc)):
        rows.append(
            {
                "fix": fix,
                "seed": "pooled",
                "targets": "all",
                "accuracy": float(np.mean(accs)),
                "acc_by_phase": [0.5, 0.4],
                "debiased_gap": 0.1,
                "debiased_lo": 0.05,
                "debiased_hi": 0.15,
            }
        )
        rows += [
            {"fix": fix, "seed": str(s), "targets": "all", "accuracy": a}
            for s, a in enumerate(accs)
        ]
    cmp = {
        "fix": "random_offset",
        "baseline": "aligned",
        "targets": "all",
        "gap_baseline": 0.2,
        "gap_other": 0.2 * (1 - reduction),
        "reduction": reduction,
        "reduction_lo": reduction - 0.1,
        "reduction_hi": reduction + 0.1,
        "accuracy_diff": 0.0,
        "accuracy_diff_lo": -0.005 if meets else -0.3,
        "accuracy_diff_hi": 0.005,
        "meets_goal": meets,
    }
    profile = {"design": "mean", "stride": 2, "heads": 2, "seq_len": 16, "seeds": [0, 1, 2]}
    profile |= {"steps": 100, "test_sequences": 8}
    return {
        "profile": profile,
        "goal_reduction": 0.7,
        "noninferiority": 0.01,
        "plateau_exit": 0.3,
        "results": rows,
        "comparison": [cmp],
    }


def test_report_calls_a_fix_whose_models_never_learned_no_fix(tmp_path):
    src = report.Sources(pd.DataFrame(), [], {}, {}, "cmd", results=tmp_path)
    assert "**Open**" in report.claim_fixes(src)
    stuck = _fixes_summary([0.21, 0.2, 0.35], reduction=0.9, meets=False)
    (tmp_path / "fixes_default.json").write_text(json.dumps(stuck))
    text = report.claim_fixes(src)
    assert "2 of 3 seeds still on the plateau" in text and "costs mean accuracy" in text
    assert "1 of 3 seeds left the loss plateau" in text and "**Goal not met**" in text
    assert "every seed left the plateau for 0 of 1 fixes" in text
    good = _fixes_summary([0.6, 0.58, 0.61], reduction=0.8, meets=True)
    (tmp_path / "fixes_long.json").write_text(json.dumps(good))
    text = report.claim_fixes(src)
    assert "**Goal met** by random_offset (long)" in text
    assert "(long, 100 steps): every seed left the plateau for 1 of 1 fixes" in text
    assert "significantly narrower for 1 (random_offset)" in text
    assert text.index("Profile default") < text.index("Profile long")
    assert report.fix_runs(tmp_path)[-1][0] == "long"
