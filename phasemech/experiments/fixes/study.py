"""The fixes experiment as an :class:`~phasemech.experiments.experiment.Experiment`:
its stages and its finish, which writes ``results.parquet``, ``comparison.parquet``,
``budget.parquet`` (each fix beside its baseline at equal training budget),
``convergence.parquet``, ``matched.parquet`` (at equal held-out accuracy), ``summary.json``
(what the claims report reads once recorded) and ``summary.md``.

Axes: ``phase`` columns; rows one per fix x seed x step as each table says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.fixes.jobs import FixStatsJob, fix_of, stats_jobs, train_jobs
from phasemech.experiments.fixes.profiles import GOAL_REDUCTION, NONINFERIORITY, PROFILES, VARIANTS
from phasemech.experiments.fixes.summary import (
    budget_markdown,
    convergence_markdown,
    matched_markdown,
    summary_markdown,
)
from phasemech.experiments.jobs import TrainJob
from phasemech.experiments.lr_search import convergence_frame
from phasemech.experiments.sweep.summary import matched_gaps
from phasemech.measure.learning import PLATEAU_EXIT


def fix_curves(done: Done) -> pd.DataFrame:
    """Every held-out evaluation of every run: fix, seed, step, accuracy and raw gap (max - min
    of per-phase accuracy)."""
    frames = []
    for job, result in done.of(TrainJob):
        c = pd.DataFrame(result["curve"])
        if not len(c):
            continue
        by = np.vstack(c["accuracy_by_phase"].to_numpy())
        c = c.assign(raw_gap=by.max(1) - by.min(1), fix=fix_of(job), seed=job.train.seed)
        frames.append(c[["fix", "seed", "step", "accuracy", "raw_gap"]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def budget_table(curve: pd.DataFrame) -> pd.DataFrame:
    """Each fix beside its baseline at equal training budget, from :func:`fix_curves`: at
    every evaluated step, the mean over seeds of held-out accuracy and raw gap. A run that
    stopped early at its target keeps its last evaluation at later steps (it had converged)."""
    rows = []
    for fix, g in curve.groupby("fix", sort=False) if len(curve) else ():
        base = VARIANTS[fix].baseline if fix in VARIANTS else None
        seeds = [c.set_index("step") for _, c in g.groupby("seed")]
        for step in sorted(g["step"].unique()):
            at = [c[c.index <= step].iloc[-1] for c in seeds if c.index.min() <= step]
            rows.append({"fix": fix, "baseline": base, "step": int(step), "seeds": len(at),
                         "accuracy": float(np.mean([a["accuracy"] for a in at])),
                         "raw_gap": float(np.mean([a["raw_gap"] for a in at]))})  # fmt: skip
    return pd.DataFrame(rows)


def convergence_table(done: Done) -> pd.DataFrame:
    """Fix x seed: steps to 0.95 held-out accuracy, final step, held-out and test accuracy,
    training seconds, and ``converged``."""
    runs = done.of(TrainJob)
    df = convergence_frame(runs)
    df.insert(0, "fix", [fix_of(j) for j, _ in runs])
    return df


def matched_table(curve: pd.DataFrame) -> pd.DataFrame:
    """Each fix's held-out raw gap by held-out accuracy band (every evaluation of every seed
    in :func:`fix_curves`), with its baseline's in the same band: the fix against its baseline
    at equal accuracy."""
    m = matched_gaps(curve, by=("fix",))
    if not len(m):
        return m
    m["baseline"] = [VARIANTS[f].baseline if f in VARIANTS else None for f in m["fix"]]
    base = m[["fix", "band", "raw_gap", "n"]].rename(
        columns={"fix": "baseline", "raw_gap": "baseline_raw_gap", "n": "baseline_n"}
    )
    return m.merge(base, on=["baseline", "band"], how="left")


def profile_dict(p: Profile) -> dict[str, Any]:
    """The profile as the recorded fixes summaries name it."""
    return {
        "design": p.designs[0], "stride": p.strides[0], "heads": p.heads[0],
        "seq_len": p.seq_lens[0], "n_pairs": p.n_pairs, "seeds": list(p.seeds),
        "steps": p.steps, "jitter": p.get("jitter"), "test_sequences": p.test_sequences,
        "n_boot": p.n_boot, "n_perm": p.n_perm, "eval_every": p.eval_every,
        "fixes": list(p.get("fixes")),
        # a seed counts as learned at this held-out accuracy; runs stopped early at the target
        "min_accuracy": p.get("min_accuracy", PLATEAU_EXIT), "target_accuracy": p.target_accuracy,
    }  # fmt: skip


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    stats = done.of(FixStatsJob)
    results = pd.DataFrame([r for _, res in stats for r in res["rows"]])
    comparison = pd.DataFrame([c for _, res in stats for c in res["comparison"]])
    atomic_write(out / "results.parquet", lambda tmp: results.to_parquet(tmp))
    atomic_write(out / "comparison.parquet", lambda tmp: comparison.to_parquet(tmp))
    curve = fix_curves(done)  # read once: the budget and matched tables both bin it
    budget, conv, matched = budget_table(curve), convergence_table(done), matched_table(curve)
    for name, df in (("budget", budget), ("convergence", conv), ("matched", matched)):
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    train_min = sum(r["train_seconds"] for _, r in done.of(TrainJob)) / 60
    summary = json_safe(
        {
            "profile": profile_dict(p),
            "training_minutes": train_min,
            "goal_reduction": GOAL_REDUCTION,
            "noninferiority": NONINFERIORITY,
            "plateau_exit": PLATEAU_EXIT,
            "results": results.to_dict("records"),
            "comparison": comparison.to_dict("records"),
            "budget": budget.to_dict("records"),
            "convergence": conv.to_dict("records"),
            "matched": matched.to_dict("records"),
        }
    )
    write_json_atomic(out / "summary.json", summary)
    text = (
        summary_markdown(results, comparison, p, train_min)
        + convergence_markdown(conv)
        + matched_markdown(matched)
        + budget_markdown(budget)
    )
    write_text_atomic(out / "summary.md", text)
    return summary


FIXES_EXPERIMENT = Experiment(
    name="fixes",
    profiles=PROFILES,
    stages=(train_jobs, stats_jobs),
    finish=finish,
    about="matched models with and without each offset or data fix, gaps compared",
)

__all__ = [
    "FIXES_EXPERIMENT",
    "budget_table",
    "convergence_table",
    "finish",
    "fix_curves",
    "matched_table",
    "profile_dict",
]
