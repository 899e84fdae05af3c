"""Exact patching of every head of SmolLM2 on many prompt pairs, timed on N worker processes.

Usage: ``python bench/explain_heads.py [--pairs 100] [--workers 2] [--design route]
[--top-k 1] [--context 1024] [--phases 3,1]``. Each pair is one content of the audit's
prompts at two phases (clean, corrupted; decode regime): both prefills, the clean run's
activations, and ``patch_heads`` over all 30 x 9 heads with the clean ``z`` as source, as
``phasemech explain`` runs it. Workers are processes with one torch thread each, loading the
model once. Prints the wall time (model loads included and excluded) and the per-pair time;
writes ``bench/results/explain_heads.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

_STATE: dict = {}


def _load(design: str, top_k: int, context: int, contents: int) -> None:
    import torch

    torch.set_num_threads(1)
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.jobs import explain_models

    cfg = ExplainConfig.of(design=design, top_k=top_k, layers=tuple(range(2, 30)),
                        context=context, contents=contents)  # fmt: skip
    _STATE["cfg"], _STATE["models"] = cfg, explain_models(cfg)


def _pair(clean_i: int, corrupt_i: int) -> float:
    import torch

    from phasemech.experiments.explain.jobs import run_prompt
    from phasemech.interventions.patching_fast import patch_heads
    from phasemech.interventions.prompts import bound, clean_run, cross_source, self_contrast

    t0 = time.perf_counter()
    base, model, batch = _STATE["models"]
    clean, corrupt = (run_prompt(base, model, batch, i, "decode") for i in (clean_i, corrupt_i))
    names = [f"blocks.{i}.attn.hook_z" for i in range(model.cfg.n_layers)]
    cl = clean_run(model, clean, names)
    with bound(model, corrupt), torch.inference_mode():
        res = patch_heads(model, self_contrast(corrupt, 4), source=cross_source(cl))
    assert res.values.shape[0] * res.values.shape[2] == 270
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--design", default="route")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--phases", default="3,1", help="clean,corrupted phase")
    args = ap.parse_args()
    strong, weak = (int(x) for x in args.phases.split(","))
    t0 = time.perf_counter()
    init = (args.design, args.top_k, args.context, args.pairs)
    with ProcessPoolExecutor(args.workers, initializer=_load, initargs=init) as pool:
        pairs = [(4 * g + strong, 4 * g + weak) for g in range(args.pairs)]
        per_pair = list(pool.map(_pair, *zip(*pairs, strict=True)))
    t_end = time.perf_counter()
    report = dict(model="smollm2-135m", design=args.design, top_k=args.top_k,
                  context=args.context, regime="decode", heads=270, pairs=args.pairs,
                  workers=args.workers, threads_per_worker=1, phases=[strong, weak],
                  wall_min=(t_end - t0) / 60, pair_s_mean=sum(per_pair) / args.pairs)  # fmt: skip
    print(f"{args.pairs} pairs x 270 heads on {args.workers} workers: "
          f"{report['wall_min']:.1f} min wall (model loads included), "
          f"{report['pair_s_mean']:.1f} s per pair per worker")  # fmt: skip
    out = Path(__file__).parent / "results" / "explain_heads.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
