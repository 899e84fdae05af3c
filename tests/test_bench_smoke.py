"""The scaling benchmark runs end to end at toy sizes (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_scaling_benchmark_runs(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "bench/attention_scaling.py"), "--seq-lens", "64", "128"]
    cmd += ["--strides", "4", "--designs", "mean", "--repeats", "1", "--warmup", "1"]
    cmd += ["--d-model", "32", "--n-heads", "2", "--d-head", "16", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["design"], r["T"]) for r in rows} == {("mean", 64), ("mean", 128)}
    assert all(r["comp_ms"] > 0 and r["dense_ms"] > 0 for r in rows)


def test_selection_benchmark_runs(tmp_path):
    """Whole-model forwards: transformers SDPA (the baseline), phasemech's SDPA dense, TL's
    dense and the selecting designs, at toy sizes."""
    out = tmp_path / "selection.json"
    cmd = [sys.executable, str(ROOT / "bench/selection.py"), "--tiny", "--seq-lens", "64", "128"]
    cmd += ["--designs", "route", "quest", "--gather", "--repeats", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    names = ("hf", "floor", "sdpa", "tl", "route", "quest", "route/gather", "quest/gather")
    assert {(r["variant"], r["T"]) for r in rows} == {(v, t) for v in names for t in (64, 128)}
    assert all(r["forward_s"] > 0 and r["attn_s"] > 0 for r in rows)
    assert all(0 < r["outside_s"] < r["forward_s"] for r in rows)
    assert all(r["forward_s_ratio"] == 1.0 for r in rows if r["variant"] == "hf")


def test_selection_train_benchmark_runs():
    """A training step of a selecting design, dense mask beside the gathered engine."""
    cmd = [sys.executable, str(ROOT / "bench/selection_train.py"), "--designs", "partition"]
    cmd += ["--repeats", "1"]
    done = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    row = done.stdout.strip().splitlines()[-1].split()
    assert row[0] == "partition" and all(float(x) > 0 for x in row[1:])


def test_selection_tiles_benchmark_runs():
    cmd = [sys.executable, str(ROOT / "bench/selection_tiles.py"), "--seq", "256", "--layer", "1"]
    out = subprocess.run(cmd + ["--repeats", "1"], check=True, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert "tiles" in out.stdout and "gather" in out.stdout and "union per chunk" in out.stdout


def test_audit_tiles_benchmark_runs(tmp_path):
    """The trained-regime audit's jobs with the tiles and with the gather, on two prompts."""
    out = tmp_path / "audit_tiles.json"
    cmd = [sys.executable, str(ROOT / "bench/audit_tiles.py"), "--prompts", "2", "--start", "20"]
    cmd += ["--context", "128", "--out", str(out)]
    done = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "verdicts that differ: 0 of 4 rows" in done.stdout
    meta = json.loads(out.read_text())["meta"]
    assert meta["prompts"] == 2 and meta["tiles_s"] > 0 and meta["gather_s"] > 0
