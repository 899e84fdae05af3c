"""One forward of many copies of one frozen prefill: what each patch and ablation of
``phasemech explain`` (decode regime) runs, on one thread.

Usage: ``python bench/decode_copies.py [--designs route,quest,evict] [--copies 64] [--repeats 2]``.
Per design (SmolLM2-135M, T = 1024, d = 4, W = 16, layers 2-29; ``route`` top-1, ``quest`` and
``evict`` top-2, as the recorded explain runs): the best of ``--repeats`` timed forwards of
``--copies`` copies of the first prompt's rows after its prefill, after one warm-up forward.
Compare commits by running it with each checkout's package first on ``PYTHONPATH``. Writes
``bench/results/decode_copies.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

TOP_K = {"route": 1, "quest": 2, "evict": 2}


def _forward_seconds(design: str, copies: int, repeats: int) -> tuple[float, int]:
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.jobs import explain_models, run_prompt
    from phasemech.interventions.prompts import bound

    cfg = ExplainConfig.of(design=design, top_k=TOP_K.get(design, 2), layers=tuple(range(2, 30)),
                        context=1024, contents=1)  # fmt: skip
    base, model, batch = explain_models(cfg)
    run = run_prompt(base, model, batch, 0, "decode")
    tokens = run.tokens.expand(copies, -1)
    best = float("inf")
    with torch.inference_mode(), bound(model, run):
        model(tokens, stop_at_layer=model.cfg.n_layers)  # warm-up (and the kept rotation)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(tokens, stop_at_layer=model.cfg.n_layers)
            best = min(best, time.perf_counter() - t0)
    return best, int(run.tokens.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--designs", default="route,quest,evict")
    ap.add_argument("--copies", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode_copies.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    import phasemech

    where = Path(phasemech.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    rows = []
    for design in args.designs.split(","):
        seconds, new = _forward_seconds(design, args.copies, args.repeats)
        rows.append(
            dict(design=design, copies=args.copies, rows_after_prefill=new, seconds=seconds)
        )
        print(f"{commit} {design}: {args.copies} copies x {new} rows: {seconds:.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"commit": commit, "threads": 1, "rows": rows}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
