"""The benchmarks run end to end at toy sizes (no timing is asserted).

Each runs as ``python bench/NAME.py ARGS`` would (``__main__``, the same arguments), in a
process of its own shared with the others of its group, one after another: one interpreter
and one import of torch and phasemech per group instead of per script. Two groups: the toy
models, and the two that read SmolLM2-135M (dequantised once for both)."""

import contextlib
import functools
import io
import json
import re
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def run_scripts(runs: list[tuple[str, list[str]]], out: Path) -> None:
    """Run ``bench/NAME.py ARGS`` for each ``(NAME, ARGS)`` in this process, as ``__main__``
    with that ``sys.argv``; write each one's stdout, exit code, traceback (None: exited
    cleanly) and wall seconds to ``out`` (JSON). SmolLM2 is dequantised once (``hf_model``
    cached)."""
    import phasemech.model.pretrained as pretrained

    pretrained.hf_model = functools.lru_cache(pretrained.hf_model)
    sys.path.insert(0, str(BENCH))  # as for a script: its folder first (sibling imports)
    done = {}
    for name, args in runs:
        stdout, code, error, t0 = io.StringIO(), 0, None, time.perf_counter()
        sys.argv = [str(BENCH / f"{name}.py"), *args]
        try:
            with contextlib.redirect_stdout(stdout):
                runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        except BaseException:  # noqa: BLE001 - reported to the test that reads this script
            code, error = 1, traceback.format_exc()
        seconds = time.perf_counter() - t0
        done[name] = dict(stdout=stdout.getvalue(), code=code, error=error, seconds=seconds)
    out.write_text(json.dumps(done))


def run_group(tmp: Path, runs: list[tuple[str, list[str]]]) -> tuple[dict, Path]:
    """:func:`run_scripts` in a process of its own; ``(NAME -> {stdout, code, error,
    seconds}, tmp)`` (the scripts' output files go to ``tmp``)."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_bench_smoke import run_scripts\n"
        f"run_scripts({runs!r}, __import__('pathlib').Path({str(tmp / 'runs.json')!r}))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=600)
    return json.loads((tmp / "runs.json").read_text()), tmp


@pytest.fixture(scope="module")
def toy_scripts(tmp_path_factory):
    """The benchmarks of toy models, in one process."""
    tmp = tmp_path_factory.mktemp("bench_toy")
    return run_group(tmp, [
        # it forks each case from a forkserver (which imports torch and phasemech itself)
        ("attention_scaling", ["--seq-lens", "64", "128", "--strides", "4", "--designs", "mean",
                               "--repeats", "1", "--warmup", "1", "--d-model", "32",
                               "--n-heads", "2", "--d-head", "16",
                               "--out", str(tmp / "bench.json")]),
        # whole-model forwards at toy sizes
        ("selection", ["--tiny", "--seq-lens", "64", "128", "--designs", "route", "quest",
                       "--gather", "--repeats", "1", "--out", str(tmp / "selection.json")]),
        ("selection_train", ["--designs", "partition", "--repeats", "1"]),
        ("specialization_cost", ["--units", "36", "--contents", "20",
                                 "--out", str(tmp / "results" / "spec.json")]),
    ])  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_scripts(tmp_path_factory):
    """The benchmarks on SmolLM2-135M, in one process (one load of the model)."""
    tmp = tmp_path_factory.mktemp("bench_smollm2")
    return run_group(tmp, [
        ("audit_tiles", ["--prompts", "2", "--start", "20", "--context", "128", "--out",
                         str(tmp / "audit_tiles.json")]),
        ("selection_tiles", ["--seq", "256", "--layer", "1", "--repeats", "1"]),
    ])  # fmt: skip


def ran(scripts, name: str) -> str:
    """The script's stdout, once it is known to have exited cleanly."""
    done = scripts[0][name]
    assert done["code"] == 0 and done["error"] is None, done["error"] or done["stdout"][-3000:]
    return done["stdout"]


def test_attention_scaling_benchmark_runs(toy_scripts):
    ran(toy_scripts, "attention_scaling")
    result = json.loads((toy_scripts[1] / "bench.json").read_text())
    rows = result["rows"]
    assert {(r["design"], r["T"]) for r in rows} == {("mean", 64), ("mean", 128)}
    assert all(r["comp_ms"] > 0 and r["dense_ms"] > 0 for r in rows)


def test_selection_benchmark_runs(toy_scripts):
    """Whole-model forwards: transformers SDPA (the baseline), phasemech's SDPA dense, TL's
    dense and the selecting designs, at toy sizes."""
    ran(toy_scripts, "selection")
    rows = json.loads((toy_scripts[1] / "selection.json").read_text())["rows"]
    names = ("hf", "floor", "sdpa", "tl", "route", "quest", "route/gather", "quest/gather")
    assert {(r["variant"], r["T"]) for r in rows} == {(v, t) for v in names for t in (64, 128)}
    assert all(r["forward_s"] > 0 and r["attn_s"] > 0 for r in rows)
    assert all(0 < r["outside_s"] < r["forward_s"] for r in rows)
    assert all(r["forward_s_ratio"] == 1.0 for r in rows if r["variant"] == "hf")


def test_selection_train_benchmark_runs(toy_scripts):
    """A training step of a selecting design, dense mask beside the gathered engine."""
    row = ran(toy_scripts, "selection_train").strip().splitlines()[-1].split()
    assert row[0] == "partition" and all(float(x) > 0 for x in row[1:])


def test_specialization_cost_benchmark_runs(toy_scripts):
    out = ran(toy_scripts, "specialization_cost")
    got = json.loads((toy_scripts[1] / "results" / "spec.json").read_text())
    assert "auto" in out and got["auto"]["holm_floor"] <= 1e-3 + 1e-12
    assert got["1000"]["draws_total"] == 36 * 1000 and got["auto"]["planted_served_phase"] == 2


def test_selection_tiles_benchmark_runs(smollm2_scripts):
    out = ran(smollm2_scripts, "selection_tiles")
    assert "tiles" in out and "gather" in out and "union per chunk" in out
    # the two paths agree in float64 up to rounding (a wrong pick moves the output by O(1))
    gap = re.search(r"float64 max \|tiles - gather\| (\S+)", out)
    assert gap is not None, out[-2000:]
    assert float(gap.group(1)) < 1e-9, gap.group(0)


def test_audit_tiles_benchmark_runs(smollm2_scripts):
    """The trained-regime audit's jobs with the tiles and with the gather, on two prompts."""
    assert "verdicts that differ: 0 of 4 rows" in ran(smollm2_scripts, "audit_tiles")
    meta = json.loads((smollm2_scripts[1] / "audit_tiles.json").read_text())["meta"]
    assert meta["prompts"] == 2 and meta["tiles_s"] > 0 and meta["gather_s"] > 0
