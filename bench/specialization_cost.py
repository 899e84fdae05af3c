"""What :func:`~phasemech.interventions.specialization.specialization` costs on an explain-sized
frame: 540 units (270 heads x zero/mean) x 200 prompts (50 contents x 4 phases, one target
each), accuracy effects, one planted unit that removes the answer at phase 2 for 70% of its
prompts. Times ``n_perm=1000`` (the old fixed count) and ``n_perm="auto"`` on one thread and
prints the planted unit's p, Holm p and the Holm floor.

Usage: ``python bench/specialization_cost.py [--units 540] [--contents 50]``; writes
``bench/results/specialization_cost.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch


def planted_frame(n_units: int, contents: int, stride: int = 4, seed: int = 0) -> pd.DataFrame:
    """Accuracy of ``n_units`` head ablations on ``contents x stride`` prompts: the intact
    model answers 80% of them; each unit flips 5% of answers at random, unit 0 (``layer 0,
    unit 0``) also removes 70% of the answers at phase 2."""
    rng = np.random.default_rng(seed)
    n = contents * stride
    group, phase = np.repeat(np.arange(contents), stride), np.tile(np.arange(stride), contents)
    base = (rng.random(n) < 0.8).astype(float)
    ablated = np.where(rng.random((n_units, n)) < 0.05, 1.0 - base, base)
    ablated[0, (phase == 2) & (rng.random(n) < 0.7)] = 0.0
    heads = n_units // 2
    return pd.DataFrame(
        dict(
            component="head",
            mode=np.repeat(np.where(np.arange(n_units) < heads, "zero", "mean"), n),
            layer=np.repeat(np.arange(n_units) % heads // 9, n),
            unit=np.repeat(np.arange(n_units) % 9, n),
            seq_id=np.tile(np.arange(n), n_units),
            group_id=np.tile(group, n_units),
            target=0,
            phase=np.tile(phase, n_units),
            depth=np.tile(rng.uniform(0, 1, n).round(2), n_units),
            accuracy_base=np.tile(base, n_units),
            accuracy=ablated.ravel(),
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=540)
    ap.add_argument("--contents", type=int, default=50)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "specialization_cost.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    from phasemech.core.io import write_json_atomic
    from phasemech.interventions.specialization import specialization

    df = planted_frame(args.units, args.contents)
    out = {"units": args.units, "prompts": args.contents * 4}
    for n_perm in (1000, "auto"):
        t0 = time.perf_counter()
        sp = specialization(df, "accuracy", n_perm=n_perm, seed=0, stride=4)
        wall = time.perf_counter() - t0
        row = sp[(sp["mode"] == "zero") & (sp.layer == 0) & (sp.unit == 0)].iloc[0]
        out[str(n_perm)] = dict(
            seconds=round(wall, 2),
            planted_p_perm=float(row.p_perm),
            planted_p_holm=float(row.p_holm),
            planted_served_phase=int(row.served_phase),
            holm_floor=float(sp.p_holm_floor.min()),
            rejected_0_05=int((sp.p_holm < 0.05).sum()),
            draws_total=int(sp["n_perm"].sum()),
        )
        print(n_perm, out[str(n_perm)], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)  # bench/results: absent on a fresh clone
    write_json_atomic(args.out, out)


if __name__ == "__main__":
    main()
