"""The experiment behind ``make figures`` as an
:class:`~phasemech.experiments.experiment.Experiment`: its stages and its finish, which writes
``per_phase.parquet``, ``panels.json``, ``patch_grid.parquet``, ``theory_predictions.json`` and
``summary.json`` under ``RUNS/<folder>/showcase/``.

Axes: ``phase`` rows per design x stride x heads x T and grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.core.grid import phase_of
from phasemech.core.io import atomic_write, json_safe, write_json_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import TrainJob, scored_targets
from phasemech.experiments.lr_search import analysed_runs
from phasemech.experiments.showcase.jobs import (
    PanelJob,
    PatchJob,
    TheoryJob,
    panel_jobs,
    patch_jobs,
    pick_showcase,
)
from phasemech.experiments.showcase.profiles import PROFILES, SHOWCASE_DIR
from phasemech.experiments.sweep.jobs import grids, search_jobs, seed_jobs


def per_phase_table(p: Profile, done: Done) -> pd.DataFrame:
    """Per-phase accuracy with CIs per (design, stride, heads, T) and grid, seeds pooled (those
    at the profile's ``pool_min_accuracy``, if any), final checkpoint of each run."""
    from phasemech.measure.stats import per_phase, phase_gap

    frames = []
    # with a pooling threshold (the converged profiles), a model that never learned is left out
    # of the pooled curves, as it is of the sweep's statistics
    for job, result in analysed_runs(done, p.get("pool_min_accuracy", 0.0)):
        df = scored_targets(job, result)
        c = job.train
        frames.append(
            df[df["step"] == result["step"]].assign(
                design=c.compression.design, stride=c.compression.stride,
                heads=c.model.n_heads, seq_len=c.task.seq_len, seed=c.seed,
            )
        )  # fmt: skip
    targets = pd.concat(frames, ignore_index=True)
    rows = []
    for (design, stride, heads, seq_len), df in targets.groupby(
        ["design", "stride", "heads", "seq_len"]
    ):
        for grid in grids(design, stride, p.strides):
            sdf = df.assign(
                phase=phase_of(df["source_pos"].to_numpy(), grid),
                seq_id=df["group_id"] + 1_000_000 * df["seed"],
            )
            if sdf["seed"].nunique() == 1:
                sdf = sdf.drop(columns="seed")
            pp = per_phase(sdf, grid, n_boot=p.n_boot, seed=0)
            gap = phase_gap(sdf, grid, n_perm=p.n_perm, n_boot=p.n_boot, seed=0)
            rows.append(
                pp.assign(
                    design=design, stride=int(stride), grid=int(grid), heads=int(heads),
                    seq_len=int(seq_len), seeds=int(df["seed"].nunique()),
                    overall=float(sdf["correct"].mean()), debiased_gap=gap["debiased_gap"],
                    gap_lo=gap["debiased_lo"], gap_hi=gap["debiased_hi"],
                )
            )  # fmt: skip
    return pd.concat(rows, ignore_index=True)


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """The tables the figures are drawn from, under ``out/showcase/`` (the ``full`` profile
    shares the phase sweep's folder: its own tables stay apart)."""
    out = out / SHOWCASE_DIR
    out.mkdir(parents=True, exist_ok=True)
    table = per_phase_table(p, done)
    atomic_write(out / "per_phase.parquet", lambda tmp: table.to_parquet(tmp))
    panels = [r for _, r in done.of(PanelJob)]
    write_json_atomic(out / "panels.json", json_safe(panels))
    patched = [r["by_phase"] for _, r in done.of(PatchJob)]
    frame = pd.DataFrame(patched[0]) if patched else pd.DataFrame()
    atomic_write(out / "patch_grid.parquet", lambda tmp: frame.to_parquet(tmp))
    [(_, theory)] = done.of(TheoryJob)
    write_json_atomic(out / "theory_predictions.json", theory)
    show = pick_showcase([r["panel"] for r in panels])
    trained = done.of(TrainJob)
    summary = {
        "models": len(trained),
        "showcase": show["name"],
        "eval_every": p.eval_every,
        "train_seconds": sum(r["train_seconds"] for _, r in trained),
        "curves": {j.name: r["curve"] for j, r in trained},
    }
    write_json_atomic(out / "summary.json", json_safe(summary))
    return summary


FIGURES = Experiment(
    name="figures",
    profiles=PROFILES,
    stages=(search_jobs, seed_jobs, panel_jobs, patch_jobs),
    finish=finish,
    about="the models, panels, patching and theory that make figures draws",
    folders={
        "full": "phase_sweep_default",
        "converged": "phase_sweep_converged",
        "converged_d8": "phase_sweep_converged_d8",
        "converged_d8_wide": "phase_sweep_converged_d8_wide",
    },
)


__all__ = ["FIGURES", "finish", "per_phase_table"]
