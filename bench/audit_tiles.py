"""The audit's ``trained`` regime with the selecting engine's tiles and with its per-query
gather, side by side on the same prompts (one thread, CPU).

Runs the jobs ``phasemech audit --design D --regime trained`` would run (the default audit:
SmolLM2-135M, T = 1024, d = 4, top-k 8, W = 16, every layer, 50 contents x 4 phases, 5 of
them reading per-head attention), in this process, twice: the designs' attention through the
tiles (``SelectingAttention.tiled``, the default), then through the gather. Prints each
setting's forward seconds per prompt (median and sum), the audit's total time both ways, and
how far the two runs' scores are apart: the paths are equal to float rounding per layer (the
tests compare them in float64), but through 28 float32 layers a rounding difference can flip
a near-tied top-k pick, so the verdicts that differ and the log-prob differences are counted
(every row both ways in ``audit_tiles.parquet`` beside the JSON).
Prompts whose attention is read carry hooks, which always take the gather.

Usage: ``python bench/audit_tiles.py [--design route] [--start 0] [--prompts 200] [--context
1024]`` (``--start S --prompts N``: prompts S to S + N - 1 of the audit; all 200 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "audit_tiles.json"


def run(job, tiled: bool) -> tuple[pd.DataFrame, float]:
    """``(the job's rows, its wall seconds)`` with every compressed model's tiles on or off."""
    from phasemech.experiments.probe.worker import WORKER

    a = job.audit
    WORKER.model(a.probe.model, job.context + 64, torch.device("cpu"))
    for _, comp in a.settings()[1:]:  # the compressed settings (the null is first)
        for block in WORKER.setting(comp).blocks:
            if hasattr(block.attn, "tiled"):
                block.attn.tiled = tiled
    t0 = time.perf_counter()
    out = job.run(Path("."))
    return pd.DataFrame(out["targets"]), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from phasemech.experiments.audit.config import AuditConfig
    from phasemech.experiments.audit.jobs import AuditJob

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--design", default="route")
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts (default all)")
    p.add_argument("--start", type=int, default=0, help="the first prompt")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    a = AuditConfig.of(designs=(args.design,), regime="trained", contexts=(args.context,))
    n = a.probe.contents * a.probe.stride - args.start if args.prompts is None else args.prompts
    job = AuditJob(a, args.context, args.start, args.start + n)
    run(AuditJob(a, args.context, 0, 1), True)  # warm-up: loads the model and the prompts
    tiles, t_tiles = run(job, True)
    gather, t_gather = run(job, False)
    flips = int((tiles.correct != gather.correct).sum())
    diff = (tiles.logprob - gather.logprob).abs()
    print(f"audit --design {args.design} --regime trained, T={args.context}, prompts "
          f"{args.start}-{args.start + n - 1}: tiles {t_tiles:.1f} s, gather {t_gather:.1f} s "
          f"({t_tiles / t_gather:.2f}x); verdicts that differ: {flips} of {len(tiles)} rows; "
          f"log-probs: {int((diff > 1e-4).sum())} rows differ by > 1e-4 (max {diff.max():.2g}, "
          f"median {diff.median():.2g})")  # fmt: skip
    rows = []
    for setting in tiles.setting.unique():
        s_t = tiles.seconds[tiles.setting == setting]
        s_g = gather.seconds[gather.setting == setting]
        row = dict(setting=setting, tiles_median_s=statistics.median(s_t),
                   gather_median_s=statistics.median(s_g), tiles_sum_s=float(s_t.sum()),
                   gather_sum_s=float(s_g.sum()))  # fmt: skip
        rows.append(row)
        print(f"  {setting:>8s}: per prompt median tiles {row['tiles_median_s']:.2f} s, gather "
              f"{row['gather_median_s']:.2f} s; summed {row['tiles_sum_s']:.1f} s vs "
              f"{row['gather_sum_s']:.1f} s")  # fmt: skip
    meta = dict(vars(args), out=str(args.out), prompts=n, tiles_s=t_tiles, gather_s=t_gather,
                verdict_flips=flips, logprob_max_diff=float(diff.max()),
                torch=torch.__version__)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    os.replace(tmp, args.out)
    pd.concat([tiles.assign(path="tiles"), gather.assign(path="gather")]).to_parquet(
        args.out.with_suffix(".parquet")
    )  # every row, both ways: which prompts differ
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
