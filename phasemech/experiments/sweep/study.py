"""The phase sweep as an :class:`~phasemech.experiments.experiment.Experiment`:
its stages and its finish, which writes ``results.parquet`` (one row per design x stride x
heads x T x seed|pooled x step x targets), ``gap_vs_accuracy.parquet`` (held-out gap along
training), the learning-rate search's tables, ``summary.json`` and ``summary.md``.

Axes: ``phase`` on each reported grid; rows as each table says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.lr_search import chosen_runs, convergence_table, curves, search_table
from phasemech.experiments.sweep.jobs import (
    SweepStatsJob,
    grids,
    search_jobs,
    seed_jobs,
    stats_jobs,
)
from phasemech.experiments.sweep.profiles import PROFILES
from phasemech.experiments.sweep.summary import convergence_markdown, matched_gaps, summary_markdown

# ------------------------------------------------------------------------------------ finish


def gap_curve(done: Done, p: Profile) -> pd.DataFrame:
    """Held-out raw gap along training, per evaluation of every run (for matching compressed
    runs to dense ones at equal accuracy)."""
    rows = []
    for job, result in chosen_runs(done):
        c = job.train
        for m in result["curve"]:
            by = np.asarray(m["accuracy_by_phase"], dtype=float)
            for stride in grids(c.compression.design, c.compression.stride, p.strides):
                # accuracy by phase on a coarser grid: phases fold (mod), counts are equal
                folded = by.reshape(-1, stride).mean(0) if len(by) != stride else by
                rows.append(
                    {
                        "design": c.compression.design,
                        "stride": stride,
                        "heads": c.model.n_heads,
                        "seq_len": c.task.seq_len,
                        "seed": c.seed,
                        "step": m["step"],
                        "accuracy": m["accuracy"],
                        "raw_gap": float(folded.max() - folded.min()),
                    }
                )
    return pd.DataFrame(rows)


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """``results.parquet``, ``gap_vs_accuracy.parquet`` and ``summary.json`` under ``out``."""
    rows = [r for _, res in done.of(SweepStatsJob) for r in res["rows"]]
    results = pd.DataFrame(rows)
    atomic_write(out / "results.parquet", lambda tmp: results.to_parquet(tmp))
    curve = gap_curve(done, p)
    atomic_write(out / "gap_vs_accuracy.parquet", lambda tmp: curve.to_parquet(tmp))
    conv, search = convergence_table(done), search_table(done)
    for name, df in (("convergence", conv), ("lr_search", search), ("curves", curves(done))):
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    trained = chosen_runs(done)
    summary = {
        # the width travels with the recording (the report reads it, not today's profile)
        "profile": {
            "d_model": p.d_model,
            "n_pairs": p.n_pairs,
            "steps": p.steps,
            "positional": p.get("positional", "standard"),
            "design_options": {d: dict(o) for d, o in p.get("design_options", ())},
        },
        "models": len(trained),
        "train_seconds": sum(r["train_seconds"] for _, r in trained),
        "runs": [
            {
                "name": j.name,
                "step": r["step"],
                "heldout_accuracy": r["heldout_accuracy"],
                "test_accuracy": r["test_accuracy"],
                "seconds": r["seconds"],
            }
            for j, r in trained
        ],
        "rows": rows,
        "matched": matched_gaps(curve).to_dict("records"),
        "convergence": conv.to_dict("records"),
        "lr_search": search.to_dict("records"),
    }
    summary = json_safe(summary)
    write_json_atomic(out / "summary.json", summary)
    text = summary_markdown(out.name, results, curve, summary["train_seconds"], p, len(trained))
    text += convergence_markdown(conv, search)
    write_text_atomic(out / "summary.md", text)
    return summary


PHASE_SWEEP = Experiment(
    name="phase_sweep",
    profiles=PROFILES,
    stages=(search_jobs, seed_jobs, stats_jobs),
    finish=finish,
    about="from-scratch models of every design, trained, scored and reported per phase",
)


__all__ = ["PHASE_SWEEP", "finish", "gap_curve"]
