"""The figures experiment's jobs: a :class:`PanelJob` per model
(its dashboard panel), a :class:`TheoryJob` (the theory's predictions) and a
:class:`PatchJob` for the showcase model (grid-contrast patching of every head), picked by
:func:`pick_showcase`.

Axes: ``layer, head, phase``; ``target`` rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.jobs import Job, TrainJob, job_device, trained_run
from phasemech.experiments.lr_search import analysed_runs
from phasemech.experiments.showcase.panels import PanelConfig
from phasemech.viz.dashboard import head_rank_key


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
        from phasemech.experiments.showcase.panels import model_panel, panel_dir
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


__all__ = [
    "PanelJob",
    "PatchJob",
    "TheoryJob",
    "best_head",
    "panel_jobs",
    "patch_jobs",
    "pick_showcase",
]
