"""Where a partly run experiment stands: every training run under its folder, finished or not.

An experiment writes its tables only when every job is done; a long sweep stopped part way has
none yet. This reads each run's ``metrics.jsonl`` under ``RUNS/<experiment>_<profile>/jobs/
work/`` and prints one row per run: the first evaluated step with held-out accuracy >= 0.95
(never: not yet), the last evaluated step and its accuracy, and whether the launcher cached the
job as finished (``jobs/<key>.json``). Nothing is recorded: rerun the experiment to finish it.

    .venv/bin/python analyses/run_progress.py runs/phase_sweep_converged_d8
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import typer

from phasemech.experiments.launcher import WORK_DIR
from phasemech.experiments.lr_search import CONVERGED, steps_to
from phasemech.training.checkpoints import METRICS_NAME, read_metrics


def progress(folder: Path) -> pd.DataFrame:
    """One row per run under ``folder`` (an experiment's output folder), sorted by name."""
    jobs = folder / "jobs"
    rows = []
    for metrics in sorted((jobs / WORK_DIR).glob(f"*/*/{METRICS_NAME}")):
        curve, key = read_metrics(metrics.parent), metrics.parent.parent.name
        last = curve[-1] if curve else {}
        rows.append({
            "run": metrics.parent.name,
            "steps_to_95": steps_to(curve, CONVERGED),
            "last_step": last.get("step"),
            "heldout_accuracy": last.get("accuracy"),
            "finished": (jobs / f"{key}.json").is_file(),
        })  # fmt: skip
    return pd.DataFrame(rows).sort_values("run", ignore_index=True) if rows else pd.DataFrame()


def main(folder: Path) -> None:
    df = progress(folder)
    if not len(df):
        raise typer.BadParameter(f"no training runs under {folder / 'jobs' / WORK_DIR}")
    print("| run | steps to 0.95 | last evaluated step | held-out acc | finished |")
    print("|---|---|---|---|---|")
    for r in df.itertuples():
        first = "never" if pd.isna(r.steps_to_95) else int(r.steps_to_95)
        done = "yes" if r.finished else "running or stopped"
        print(f"| {r.run} | {first} | {r.last_step} | {r.heldout_accuracy:.3f} | {done} |")


if __name__ == "__main__":
    typer.run(main)
