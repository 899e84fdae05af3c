"""The experiment behind ``make figures``: trained models, their dashboard panels, the
showcase model's grid-contrast patching and the theory's predictions, as tables.

Stages: (1) the phase sweep's :class:`TrainJob` of each model of the profile; (2) a
:class:`PanelJob` per model (per-phase accuracy and gap, head attention on the needle by phase,
head zero-ablation effects by phase with their specialisation tests, an example pattern) and a
:class:`TheoryJob`; (3) a :class:`PatchJob` for the *showcase*: the compressed model whose most
phase-specialised compressed-layer head ranks first (Holm p < 0.05, then the range of its
per-phase ablation effect), among models with test accuracy >= 0.9 when any. The finish writes
``per_phase.parquet`` (per-phase accuracy with cluster-bootstrap CIs per design x stride x heads
x T and grid, seeds pooled, final checkpoints), ``panels.json``, ``patch_grid.parquet``,
``theory_predictions.json`` and ``summary.json`` under ``RUNS/<folder>/showcase/``. Figures
are drawn from these by ``analyses/figures.py``.

Axes: ``layer, head, phase``; ``target`` rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.core.grid import phase_of
from phasemech.core.io import atomic_write, json_safe, write_json_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import Job, TrainJob, job_device, scored_targets, trained_run
from phasemech.experiments.lr_search import analysed_runs
from phasemech.experiments.panels import PanelConfig
from phasemech.experiments.sweep import PROFILES as SWEEP_PROFILES
from phasemech.experiments.sweep import grids, search_jobs, seed_jobs
from phasemech.viz.dashboard import head_rank_key

SHOWCASE_DIR = "showcase"


def _on_converged_sweep(name: str, analyse_seeds) -> Profile:
    """The dashboard profile of a converged sweep profile: its models, in its folder."""
    return replace(
        SWEEP_PROFILES[name],
        extra=SWEEP_PROFILES[name].extra
        + (("panel", PanelConfig(sequences=2048, n_boot=400, n_perm=400)),
           ("analyse_seeds", analyse_seeds)),
    )  # fmt: skip


PROFILES = {
    "tiny": replace(
        SWEEP_PROFILES["tiny"],
        extra=(("panel", PanelConfig(sequences=64, n_boot=50, n_perm=50)), ("patch_pairs", 32),
               ("theory_scale", 0.05)),
    ),
    # one seed of the four design families that the sweep found most telling: the dense
    # control, mean pooling (largest gap), gated (heads split the phases), route (no gap)
    "default": replace(
        SWEEP_PROFILES["default"],
        designs=("none", "mean", "gated", "route"), heads=(2,), seq_lens=(64,), seeds=(0, 1),
        test_sequences=2048,
        # longest first, so that the workers finish together
        models=("mean_d8_h2_T64_s0", "mean_d4_h2_T64_s0", "route_d4_h2_T64_s0",
                "gated_d4_h2_T64_s1", "none_d8_h2_T64_s0"),
        extra=(("panel", PanelConfig(sequences=2048, n_boot=400, n_perm=400)),),
    ),
    # the dashboard panels of the converged phase sweep's models (its search and seeds
    # stages: the same cache), those that reached 0.95, seed 0 of each setting
    "converged": _on_converged_sweep("converged", (0,)),
    # the same at d = 8, the first seed of each setting that reached 0.95 (gated and mlp
    # H = 4 converged only in seed 2), and at d = 8 with d_model 128
    "converged_d8": _on_converged_sweep("converged_d8", "first"),
    "converged_d8_wide": _on_converged_sweep("converged_d8_wide", "first"),
    # every run of the phase sweep's default profile (its train jobs: the same cache keys)
    "full": replace(
        SWEEP_PROFILES["default"],
        extra=(("panel", PanelConfig(sequences=4096, n_boot=1000, n_perm=1000)),),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class PanelJob(Job):
    """The dashboard panel of one trained model, with the tables the figures draw."""

    kind: ClassVar[str] = "panel"
    train: TrainJob
    panel: PanelConfig

    @property
    def label(self) -> str:
        return f"panel {self.train.name}"

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.experiments.panels import model_panel, panel_dir
        from phasemech.interventions.ablation import AblationResult

        run = trained_run(workdir, self.train)
        panel = model_panel(run, self.panel, device=job_device())
        panel["name"] = self.train.name
        folder = panel_dir(run, self.panel)
        effects = AblationResult.load(folder / "ablate").effects
        effects = effects[(effects.metric == "accuracy") & (effects.component == "head")]
        attention = pd.read_parquet(folder / "phase_attention.parquet")
        return {
            "panel": panel,
            "phase_attention": attention.to_dict(orient="list"),
            "head_effects": effects[effects["mode"] == "zero"].to_dict(orient="list"),
        }


@dataclass(frozen=True)
class PatchJob(Job):
    """Grid-contrast head patching of one model: effect by the needle's clean phase."""

    kind: ClassVar[str] = "patch_grid"
    train: TrainJob
    panel: PanelConfig
    pairs: int = 256

    @property
    def label(self) -> str:
        return f"patch {self.train.name}"

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.core.grid import reference_grid
        from phasemech.data.tasks import balanced_test_set
        from phasemech.interventions.contrasts import make_contrast
        from phasemech.interventions.patching_fast import patch_heads
        from phasemech.training.checkpoints import load_trained

        model, cfg, _ = load_trained(trained_run(workdir, self.train), job_device())
        stride, offset = reference_grid(cfg.compression)
        p = self.panel
        ds = balanced_test_set(cfg.task, p.sequences, p.data_seed).shuffle(seed=0)
        contrast = make_contrast(ds, "grid", stride=stride, grid_offset=offset, n_pairs=self.pairs)
        result = patch_heads(model, contrast)
        return {"by_phase": result.by_phase(n_boot=p.n_boot, seed=0).to_dict(orient="list")}


@dataclass(frozen=True)
class TheoryJob(Job):
    """The theory model's predictions (``scale`` < 1: shorter simulations, for tests)."""

    kind: ClassVar[str] = "theory"
    scale: float = 1.0

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.theory.dynamics import predictions

        return json.loads(json.dumps(predictions(scale=self.scale)))


def best_head(panel: dict) -> dict:
    """A panel's most phase-specialised head (:func:`phasemech.viz.dashboard.head_rank_key`),
    among its compressed layers' heads when it has any."""
    return max([h for h in panel["heads"] if h["compressed"]] or panel["heads"], key=head_rank_key)


def pick_showcase(panels: list[dict]) -> dict:
    """The compressed model whose most specialised head ranks first, among models with
    test-set accuracy >= 0.9 when any."""
    comp = [p for p in panels if p["design"] != "none"] or panels
    good = [p for p in comp if (p["summary"]["accuracy"] or 0) >= 0.9] or comp
    return max(good, key=lambda p: head_rank_key(best_head(p)))


def panel_jobs(p: Profile, done: Done) -> list[Job]:
    """Stage 2: a panel per trained model, and the theory's predictions."""
    runs = analysed_runs(done, p.get("pool_min_accuracy", 0.0), p.get("analyse_seeds"))
    jobs: list[Job] = [PanelJob(job, p.get("panel")) for job, _ in runs]
    return jobs + [TheoryJob(p.get("theory_scale", 1.0))]


def patch_jobs(p: Profile, done: Done) -> list[Job]:
    """Stage 3: grid-contrast patching of the showcase model (none if it is dense)."""
    panels = {j.train.name: (j, r["panel"]) for j, r in done.of(PanelJob)}
    show = pick_showcase([panel for _, panel in panels.values()])
    job = panels[show["name"]][0]
    if show["design"] == "none":
        return []
    return [PatchJob(job.train, job.panel, p.get("patch_pairs", 256))]


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

__all__ = ["FIGURES", "PROFILES", "PanelJob", "PatchJob", "TheoryJob", "best_head", "pick_showcase"]
