"""One training step of each selecting design at the lab's size (2 layers, d_model 64, 2 heads,
T = 64, batch 64, layer 2 compressed, one thread), through the dense-mask training path beside
the gathered engine (what contexts above ``DENSE_MAX_POS`` and every hooked forward run), side
by side in one run: the same model, batch and step, alternating.

    .venv/bin/python bench/selection_train.py                  # every selecting design
    .venv/bin/python bench/selection_train.py --designs dsa partition --repeats 20
"""

from __future__ import annotations

import time
from typing import Annotated

import torch
import typer

import phasemech.attention.selection as selection
from phasemech.core.designs import SELECTING_DESIGNS
from phasemech.experiments.sweep.profiles import PROFILES, RunSpec, train_config
from phasemech.training.trainer import train_step


def _step_seconds(cfg, model, opt, sched, dense: bool, step: int) -> float:
    previous = selection.DENSE_MAX_POS
    selection.DENSE_MAX_POS = previous if dense else 0  # 0: no context is short enough
    try:
        t0 = time.perf_counter()
        train_step(cfg, model, opt, sched, step)
        return time.perf_counter() - t0
    finally:
        selection.DENSE_MAX_POS = previous


def main(
    designs: Annotated[
        list[str] | None, typer.Option(help="default: every selecting design")
    ] = None,
    repeats: int = 10,
) -> None:
    torch.set_num_threads(1)
    print("design   dense (s)  gathered (s)  gathered / dense")
    for design in designs or SELECTING_DESIGNS:
        cfg = train_config(RunSpec(design, 4, 2, 64, 0), PROFILES["systems"])
        model = cfg.build_model().train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        _step_seconds(cfg, model, opt, sched, True, 0)  # warm-up, both paths
        _step_seconds(cfg, model, opt, sched, False, 1)
        dense, gathered = [], []
        for r in range(repeats):
            dense.append(_step_seconds(cfg, model, opt, sched, True, 2 + 2 * r))
            gathered.append(_step_seconds(cfg, model, opt, sched, False, 3 + 2 * r))
        d, g = sorted(dense)[repeats // 2], sorted(gathered)[repeats // 2]  # medians
        print(f"{design:9s} {d:9.4f} {g:12.4f} {g / d:16.2f}")


if __name__ == "__main__":
    typer.run(main)
