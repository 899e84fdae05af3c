"""``linear_layout`` side by side: zero ablation of every SmolLM2 head on one decode-regime
prompt, with the weights in the layout ``F.linear`` reads and in TransformerLens' own.

Usage: ``python bench/linear_layout.py [--reps 2] [--context 1024]``. One process, one thread,
the two layouts alternated ``reps`` times on the same model (the tensors moved back and forth
in place); checks that both give the same values bit for bit and prints the times.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.jobs import explain_models, run_prompt
    from phasemech.interventions.patching_fast import patch_heads, zero_source
    from phasemech.interventions.prompts import bound, self_contrast
    from phasemech.model.fast import linear_layout

    cfg = ExplainConfig.of(design="route", top_k=1, layers=tuple(range(2, 30)),
                        context=args.context, contents=1)  # fmt: skip
    base, model, batch = explain_models(cfg)  # the audit's worker: linear_layout already applied
    run = run_prompt(base, model, batch, 1, "decode")
    c = self_contrast(run, 4)

    def ablate() -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        with bound(model, run):
            res = patch_heads(model, c, metric="margin", source=zero_source)
        return time.perf_counter() - t0, res.values

    for _ in range(args.reps):
        t_fast, v_fast = ablate()
        for p in model.parameters():
            p.data = p.data.contiguous()  # TransformerLens' own layout
        t_plain, v_plain = ablate()
        linear_layout(model)
        same = np.array_equal(v_fast, v_plain, equal_nan=True)
        print(f"zero ablation of 270 heads: linear_layout {t_fast:.1f} s, TransformerLens "
              f"layout {t_plain:.1f} s ({t_plain / t_fast:.2f}x); identical: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
