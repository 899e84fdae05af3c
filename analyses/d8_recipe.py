"""Can an honest change of recipe take the d = 8 settings that stayed on the loss plateau off it?

The converged d = 8 phase sweep (``phasemech run phase_sweep --profile converged_d8``: T = 64,
8 pairs, V = 64, raw window 16, lr 3e-3, 8000 steps) left ``mlp`` H = 2 (0 of 3 seeds),
``gated`` H = 4 and ``mlp`` H = 4 (1 of 3 each) on the plateau. Each variant here changes one
thing of that sweep's training config, on the launcher:

- ``warmup``: a curriculum on the data's random prefix (``TrainConfig.prefix_warmup``): the
  spread widens from 1 position to 8 over the first 2000 steps;
- ``width``: ``d_model`` 128 instead of 64 (twice the head dimension at the same H);
- ``width_dhead16``: ``d_model`` 128 with the head dimension kept at 16: is it the residual
  width or the head's that takes a model off the plateau?
- ``lr1e-3``: the search's other rate (the d = 8 sweep ran only 3e-3).

Writes ``OUT/d8_recipe.json`` and prints, per setting, variant and seed, the first evaluated step
with held-out accuracy >= 0.95 (never: still on the plateau) and the accuracy at the last step.
The recipe's own numbers are the sweep's (``analyses/results/phase_sweep_converged_d8.md``).

    .venv/bin/python analyses/d8_recipe.py --settings mlp_h2,gated_h4 --variants warmup,width \\
        --seeds 0 --steps 4000 --out runs/d8_recipe
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from phasemech.core.io import write_json_atomic
from phasemech.experiments.experiment import Experiment, Profile, run_experiment
from phasemech.experiments.jobs import TrainJob
from phasemech.experiments.lr_search import steps_to
from phasemech.experiments.sweep.profiles import PROFILES, RunSpec, train_config
from phasemech.training.config import TrainConfig

SETTINGS = {"mlp_h2": ("mlp", 2), "gated_h4": ("gated", 4), "mlp_h4": ("mlp", 4)}


def _width(cfg: TrainConfig, d_head: int | None = None) -> TrainConfig:
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, d_model=128, d_head=d_head)
    )


VARIANTS = {
    "warmup": lambda cfg: dataclasses.replace(cfg, prefix_warmup=2000),
    "width": _width,
    "width_dhead16": lambda cfg: _width(cfg, d_head=16),
    "lr1e-3": lambda cfg: dataclasses.replace(cfg, lr=1e-3),
}


def config(setting: str, variant: str, seed: int, steps: int) -> TrainConfig:
    design, heads = SETTINGS[setting]
    cfg = train_config(RunSpec(design, 8, heads, 64, seed), PROFILES["converged_d8"])
    return VARIANTS[variant](dataclasses.replace(cfg, steps=steps))


def _choices(text: str, allowed: dict, what: str) -> list[str]:
    picked = [x for x in text.split(",") if x]
    bad = [x for x in picked if x not in allowed]
    if bad or not picked:
        raise typer.BadParameter(f"{what} {bad or text!r} unknown: allowed {sorted(allowed)}")
    return picked


def _seeds(text: str) -> list[int]:
    try:
        seeds = list(dict.fromkeys(int(x) for x in text.split(",")))
    except ValueError:
        raise typer.BadParameter(f"seeds {text!r} invalid: need comma-separated ints") from None
    return seeds


def picked_runs(settings: str, variants: str, seeds: str) -> dict[str, tuple[str, str, int]]:
    """``{job name: (setting, variant, seed)}`` of every run asked for (unknown names: error)."""
    chosen_s = _choices(settings, SETTINGS, "settings")
    chosen_v = _choices(variants, VARIANTS, "variants")
    return {
        f"{s}_{v}_s{seed}": (s, v, seed)
        for s in chosen_s
        for v in chosen_v
        for seed in _seeds(seeds)
    }


def result_rows(done: list, picked: dict[str, tuple[str, str, int]]) -> list[dict]:
    """One row per finished :class:`TrainJob` ``(job, result)``, labelled from ``picked``."""
    rows = []
    for j, r in done:
        setting, variant, seed = picked[j.name]
        rows.append(
            {
                "setting": setting, "variant": variant, "seed": seed, "budget": j.train.steps,
                "steps_to_95": steps_to(r["curve"]), "final_step": r["curve"][-1]["step"],
                "final_accuracy": r["heldout_accuracy"], "curve": r["curve"],
            }
        )  # fmt: skip
    return rows


def main(
    settings: Annotated[str, typer.Option(help="comma-separated: mlp_h2, gated_h4, mlp_h4")] = (
        "mlp_h2,gated_h4,mlp_h4"
    ),
    variants: Annotated[str, typer.Option(help=f"comma-separated: {', '.join(VARIANTS)}")] = (
        "warmup,width,lr1e-3"
    ),
    seeds: Annotated[str, typer.Option(help="comma-separated seeds")] = "0",
    steps: Annotated[int, typer.Option(min=1)] = 8000,
    out: Path = Path("runs/d8_recipe"),
    num_cpus: Annotated[int | None, typer.Option(min=1)] = None,
    address: str | None = None,
) -> None:
    picked = picked_runs(settings, variants, seeds)

    def jobs(p: Profile, done) -> list[TrainJob]:
        return [
            TrainJob(config(s, v, seed, steps), name=name, test_sequences=2048)
            for name, (s, v, seed) in picked.items()
        ]

    exp = Experiment("d8_recipe", {"default": Profile(steps=steps)}, (jobs,))
    run = run_experiment(exp, "default", out, num_cpus=num_cpus, address=address)
    rows = result_rows(run.done.of(TrainJob), picked)
    write_json_atomic(run.folder / "d8_recipe.json", rows)
    print("| setting (d = 8) | variant | seed | budget | first step >= 0.95 | final acc |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        first = "never" if r["steps_to_95"] is None else r["steps_to_95"]
        print(
            f"| {r['setting']} | {r['variant']} | {r['seed']} | {r['budget']} | {first} "
            f"| {r['final_accuracy']:.3f} (step {r['final_step']}) |"
        )
    print(json.dumps({"seconds": round(run.seconds, 1), "ran": run.ran, "cached": run.cached}))


if __name__ == "__main__":
    typer.run(main)
