"""analyses/run_progress.py: a partly run experiment's runs, finished or not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "analyses"))
import run_progress  # noqa: E402


def _run(folder: Path, key: str, name: str, accs: list[float], finished: bool) -> None:
    run = folder / "jobs" / "work" / key / name
    run.mkdir(parents=True)
    lines = [{"step": 100 * (i + 1), "accuracy": a} for i, a in enumerate(accs)]
    if finished:
        lines.append({"event": "done", "step": 100 * len(accs), "accuracy": accs[-1]})
        (folder / "jobs" / f"{key}.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_progress_lists_finished_and_running_runs(tmp_path, capsys):
    _run(tmp_path, "k1", "mean_s0", [0.2, 0.96, 0.99], finished=True)
    _run(tmp_path, "k2", "gated_s0", [0.2, 0.25], finished=False)
    df = run_progress.progress(tmp_path).set_index("run")
    assert list(df.index) == ["gated_s0", "mean_s0"]
    assert df.loc["mean_s0", "steps_to_95"] == 200 and df.loc["mean_s0", "finished"]
    assert df.loc["mean_s0", "last_step"] == 300 and df.loc["mean_s0", "heldout_accuracy"] == 0.99
    assert df.loc["gated_s0"].isna()["steps_to_95"] and not df.loc["gated_s0", "finished"]
    run_progress.main(tmp_path)
    out = capsys.readouterr().out
    assert "| gated_s0 | never | 200 | 0.250 | running or stopped |" in out
    assert "| mean_s0 | 200 | 300 | 0.990 | yes |" in out
