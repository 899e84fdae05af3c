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
