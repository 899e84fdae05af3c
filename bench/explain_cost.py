"""What ``phasemech explain`` costs per prompt and per pair, part by part, on one thread.

Usage: ``python bench/explain_cost.py [--design route] [--top-k 1] [--context 1024]
[--pairs 2] [--groups-only]``. Prints the time of a prefill, of the observe step (selection,
oracle copies, head means), of the attend step (prefill included), of zero + mean ablation of
every head, of the groups step per prompt (the top 1/3/5/10 needle readers and every layer's
heads, zero + mean + resample, the resample source's prefill included), and of a pair's exact
head patching, residual patching, selection patching and attribution patching, then the
projected cost of exact head patching on 100 pairs on 2 cores (each pair: two prefills and the
head patching). ``--groups-only`` times the prefill, attend and groups steps alone (the head
means from the prompt itself). Writes ``bench/results/explain_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch


def _timed(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def _group_time(cfg, base, model, batch, g: int, clean, units, means) -> float:
    """The groups step on one prompt: the resample source's prefill (the next content's
    prompt at another phase) and every unit in every mode."""
    from phasemech.experiments.explain.jobs import run_prompt
    from phasemech.interventions.group_ablation import group_ablate

    t0 = time.perf_counter()
    other = run_prompt(base, model, batch, 4 * ((g + 1) % cfg.probe.contents) + 2, "decode")
    group_ablate(model, clean, [u for _, u in units], means, other)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--design", default="route")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--groups-only", action="store_true",
                    help="time the prefill, attend and groups steps only")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)

    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.groups import head_groups, needle_readers
    from phasemech.experiments.explain.jobs import (
        answer_attention,
        explain_models,
        observe_prompt,
        oracle_forces,
        run_prompt,
    )
    from phasemech.interventions.attribution import attribution_patch
    from phasemech.interventions.oracle import copy_selection
    from phasemech.interventions.patching_fast import patch_heads
    from phasemech.interventions.prompt_patching import ablate_prompt, resid_patch, z_sums
    from phasemech.interventions.prompts import bound, clean_run, cross_source, self_contrast

    cfg = ExplainConfig.of(design=args.design, top_k=args.top_k, layers=tuple(range(2, 30)),
                        context=args.context, contents=max(2, args.pairs))  # fmt: skip
    base, model, batch = explain_models(cfg)
    n = model.cfg.n_layers
    names = [f"blocks.{i}.attn.hook_z" for i in range(n)]
    names += [f"blocks.{i}.hook_resid_pre" for i in range(n)]
    parts = ("prefill", "observe", "attend", "ablation", "groups", "heads", "resid", "selection",
             "atp")  # fmt: skip
    rows: dict[str, list[float]] = {k: [] for k in parts}
    for g in range(args.pairs):
        clean_i, corrupt_i = 4 * g, 4 * g + 1
        if not args.groups_only:
            t, obs = _timed(observe_prompt, cfg, clean_i, base, model, batch)
            rows["observe"].append(t)
        t, clean = _timed(run_prompt, base, model, batch, clean_i, "decode")
        rows["prefill"].append(t)
        t, att = _timed(answer_attention, clean, base, model)
        rows["attend"].append(t)
        if args.groups_only:  # this prompt's head means (the run's: every prompt's)
            sums, n_rows = z_sums(model, clean)
            obs = {"z_sums": sums, "z_rows": n_rows}
        means = torch.as_tensor(obs["z_sums"]).float() / obs["z_rows"]
        units = head_groups(needle_readers(pd.DataFrame(att)), cfg.group_sizes, n,
                            model.cfg.n_heads)  # fmt: skip
        rows["groups"].append(_group_time(cfg, base, model, batch, g, clean, units, means))
        if args.groups_only:
            continue
        rows["ablation"].append(_timed(ablate_prompt, model, clean, cfg.probe.stride, means)[0])
        corrupt = run_prompt(base, model, batch, corrupt_i, "decode")
        cl = clean_run(model, clean, names)
        c = self_contrast(corrupt, cfg.probe.stride)
        with bound(model, corrupt), torch.inference_mode():
            t, res = _timed(patch_heads, model, c, source=cross_source(cl))
        rows["heads"].append(t)
        foil = int(res.pairs["foil"].iloc[0])
        answer = int(corrupt.answer[0])
        rows["resid"].append(_timed(resid_patch, model, cl, corrupt, answer, foil)[0])
        rows["selection"].append(_timed(copy_selection, model, clean, corrupt)[0])
        with bound(model, corrupt):
            rows["atp"].append(_timed(attribution_patch, model, c, source=cross_source(cl))[0])
    rows = {k: v for k, v in rows.items() if v}
    mean = {k: sum(v) / len(v) for k, v in rows.items()}
    per_pair = 2 * mean["prefill"] + mean["heads"] if "heads" in mean else None
    report = dict(model="smollm2-135m", design=args.design, top_k=args.top_k,
                  context=args.context, regime="decode", layers="2-29", threads=1,
                  oracle_copies=len(oracle_forces(cfg, model)), pairs_measured=args.pairs,
                  group_units=len(units),
                  seconds=mean)  # fmt: skip
    if per_pair is not None:
        report["heads_100_pairs_2_cores_min"] = 100 * per_pair / 2 / 60
    for k, v in mean.items():
        print(f"{k:>9}: {v:6.2f} s")
    if not args.groups_only:
        print(f"exact head patching, 100 pairs on 2 cores (projected): "
              f"{report['heads_100_pairs_2_cores_min']:.1f} min")  # fmt: skip
    out = Path(__file__).parent / "results" / "explain_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
