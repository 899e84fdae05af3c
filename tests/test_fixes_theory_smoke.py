"""The issue-7 analyses end to end at their tiny profiles, and the report's readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    import pandas as pd

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
