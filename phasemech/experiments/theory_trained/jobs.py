"""The theory-vs-trained jobs: the train jobs (through the
learning-rate search), a :class:`TheoryFitJob` per chosen model (its effective pooling weights
and the theory's accuracy per phase from them against the measured one) and a
:class:`TheorySimJob` per H (the theory simulated from scratch).

Axes: ``head``, ``phase``; ``target`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.jobs import (
    Job,
    TrainJob,
    job_device,
    payload,
    scored_targets,
    trained_run,
)
from phasemech.experiments.lr_search import chosen_runs, search_stages, with_lr
from phasemech.experiments.theory_trained.profiles import train_config
from phasemech.measure.learning import off_plateau
from phasemech.training.config import TrainConfig


def make_jobs(
    p: Profile, lr: float | None, seeds: tuple[int, ...], steps: int | None = None
) -> list[TrainJob]:
    """The train jobs of ``seeds`` at learning rate ``lr`` (None: the recipe's). A budget other
    than the profile's (a shorter search) replaces every H's; the profile's keeps each H's own
    (``steps_for_heads``). Names carry a rate only where it is not the recipe's, so a search
    reuses the runs the recipe's rate already trained."""
    jobs = []
    for s in seeds:
        for h in p.heads:
            cfg = with_lr(train_config(h, s, p), lr)
            if steps is not None and steps != p.steps:
                cfg = replace(cfg, steps=steps)
            suffix = "" if cfg.lr == TrainConfig.lr else f"_lr{cfg.lr:g}"
            jobs.append(
                TrainJob(cfg, name=f"gated_h{h}_s{s}{suffix}", test_sequences=p.test_sequences)
            )
    return jobs


# (1) the first seed of each H at every rate of the profile (every seed at the recipe's rate
# when the profile has no rates), (2) the other seeds at each H's best rate
search_jobs, seed_jobs = search_stages(make_jobs)


def theory_config(heads: int, p: Profile, seed: int = 0):
    from phasemech.theory.dynamics import TheoryConfig

    d = p.strides[0]
    return TheoryConfig(d=d, heads=heads, n_windows=p.seq_lens[0] // d, seed=seed)


@dataclass(frozen=True)
class TheorySimJob(Job):
    """The theory from scratch at H heads: covered and served phases over seeds."""

    kind: ClassVar[str] = "theory_sim"
    heads: int
    theory: Any  # the TheoryConfig of seed 0 (seed i: the same with seed=i)
    seeds: int
    steps: int

    def run(self, workdir: Path) -> dict[str, Any]:
        from dataclasses import replace

        from phasemech.theory.dynamics import simulate

        covered, served, gaps = [], [], []
        for s in range(self.seeds):
            tr = simulate(replace(self.theory, seed=s), steps=self.steps)
            covered.append(tr.covered())
            served.append(len(set(tr.weights[-1].argmax(1).tolist())))
            gaps.append(tr.gap)
        return {
            "theory_covered": covered,
            "theory_served": served,
            "theory_gap_mean": float(np.mean(gaps)),
        }


@dataclass(frozen=True)
class TheoryFitJob(Job):
    """One trained model against the theory: effective weights, predicted vs measured."""

    kind: ClassVar[str] = "theory_fit"
    train: TrainJob
    theory: Any  # TheoryConfig at this model's H
    weight_sequences: int
    result: dict[str, Any] = payload(default=None)

    @property
    def label(self) -> str:
        return f"fit {self.train.name}"

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.data.tasks import balanced_test_set
        from phasemech.measure.stats import per_phase
        from phasemech.theory.fit import compare, effective_weights, weight_matrix
        from phasemech.training.checkpoints import load_trained

        d = self.theory.d
        model, cfg, model_dir = load_trained(trained_run(workdir, self.train), job_device())
        w = effective_weights(model, balanced_test_set(cfg.task, self.weight_sequences, seed=778))
        targets = scored_targets(self.train, self.result)
        targets = targets.assign(phase=targets["source_pos"] % d)
        acc_all = per_phase(targets, d, n_boot=0)["accuracy"].to_numpy()
        # the theory is about reading through blocks: targets beyond the raw window (2d)
        far = targets[targets["distance"] >= 3 * d - 1]
        acc = per_phase(far, d, n_boot=0)["accuracy"].to_numpy()
        bias = w.pivot(index="head", columns="phase", values="bias_weight").to_numpy()
        row = {
            "heads": cfg.model.n_heads,
            "seed": cfg.seed,
            "lr": cfg.lr,
            "step": int(model_dir.name.removeprefix("step_")),
            "accuracy": float(targets["correct"].mean()),
            "off_plateau": off_plateau(targets["correct"].mean()),
            "acc_all_by_phase": acc_all.round(4).tolist(),
            "acc_by_phase": acc.round(4).tolist(),  # far targets
            "gap": float(acc.max() - acc.min()),
            "bias_max_weight": bias.max(1).round(4).tolist(),
            **compare(weight_matrix(w), acc, self.theory),
        }
        return {"row": row, "weights": w.to_dict(orient="list")}


def fit_jobs(p: Profile, done: Done) -> list[Job]:
    """Stage 2: the theory fit of every trained model, and the theory from scratch per H."""
    ws = p.get("weight_sequences")
    jobs: list[Job] = [
        TheoryFitJob(j, theory_config(j.train.model.n_heads, p), ws, r)
        for j, r in chosen_runs(done)
    ]
    seeds, steps = p.get("theory_seeds"), p.get("theory_steps")
    return jobs + [TheorySimJob(h, theory_config(h, p), seeds, steps) for h in p.heads]


__all__ = [
    "TheoryFitJob",
    "TheorySimJob",
    "fit_jobs",
    "make_jobs",
    "search_jobs",
    "seed_jobs",
    "theory_config",
]
