"""Why from-scratch models sat on the MQAR loss plateau: one component at a time, on the launcher.

Gated pooling, d = 4, H = 4, T = 64, 8 pairs, V = 64, raw window 8, batch 64, 2000 steps, no
early stop. Each row changes one thing relative to the row it names:

- ``prefix``: the training data's random prefix spans 4 positions (the model's stride) or 8
  (one shared task for a d = 4 and d = 8 sweep, which the old sweep used);
- ``recipe``: the old trainer (lr 1e-3, weight decay 0.01, cosine decay over the budget) or the
  current defaults (lr 3e-3, weight decay 0.1, constant rate after warm-up).

Writes ``OUT/plateau_ablation.json`` and prints a table: per row and seed, the first evaluated
step with held-out accuracy >= 0.95 (never: the model stayed on the plateau) and the final
accuracy. docs/training.md reports the table measured side by side with a plain-PyTorch model.

    .venv/bin/python analyses/plateau_ablation.py --seeds 0,1,2 --out runs/plateau_ablation
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from phasemech.core.config import CompressionConfig
from phasemech.core.io import write_json_atomic
from phasemech.data.tasks import MQARTask
from phasemech.experiments.experiment import Experiment, Profile, run_experiment
from phasemech.experiments.jobs import TrainJob
from phasemech.experiments.lr_search import steps_to
from phasemech.training.config import ModelSpec, TrainConfig

OLD = dict(lr=1e-3, weight_decay=0.01, schedule="cosine")
NEW = dict(lr=3e-3, weight_decay=0.1, schedule="constant")
ROWS = {  # name: (prefix span, recipe)
    "prefix 8, old recipe": (8, OLD),
    "prefix 4, old recipe": (4, OLD),
    "prefix 8, new recipe": (8, NEW),
    "prefix 4, new recipe": (4, NEW),
}


def config(span: int, recipe: dict, seed: int, steps: int) -> TrainConfig:
    base = TrainConfig(
        task=MQARTask(vocab_size=64, seq_len=64, n_pairs=8, stride=span),
        model=ModelSpec(n_heads=4),
        compression=CompressionConfig("gated", stride=4, window=8, layers=(1,)),
        steps=steps,
        target_accuracy=None,
        seed=seed,
    )
    return dataclasses.replace(base, **recipe)


def main(
    seeds: Annotated[str, typer.Option(help="comma-separated seeds")] = "0,1,2",
    steps: int = 2000,
    out: Path = Path("runs/plateau_ablation"),
    num_cpus: int | None = None,
    address: str | None = None,
) -> None:
    seed_list = tuple(int(s) for s in seeds.split(","))

    def jobs(p: Profile, done) -> list[TrainJob]:
        return [
            TrainJob(config(span, recipe, s, steps), name=f"{name} s{s}", test_sequences=512)
            for name, (span, recipe) in ROWS.items()
            for s in seed_list
        ]

    exp = Experiment("plateau_ablation", {"default": Profile(steps=steps)}, (jobs,))
    run = run_experiment(exp, "default", out, num_cpus=num_cpus, address=address)
    rows = [
        {
            "row": j.name.rsplit(" s", 1)[0],
            "seed": j.train.seed,
            "steps_to_95": steps_to(r["curve"]),
            "final_accuracy": r["heldout_accuracy"],
        }
        for j, r in run.done.of(TrainJob)
    ]
    write_json_atomic(run.folder / "plateau_ablation.json", rows)
    print("| data and recipe | seed | first step >= 0.95 | final held-out accuracy |")
    print("|---|---|---|---|")
    for r in rows:
        first = "never" if r["steps_to_95"] is None else r["steps_to_95"]
        print(f"| {r['row']} | {r['seed']} | {first} | {r['final_accuracy']:.3f} |")
    print(json.dumps({"seconds": round(run.seconds, 1), "ran": run.ran, "cached": run.cached}))


if __name__ == "__main__":
    typer.run(main)
