"""phasemech's batched head patching vs TransformerLens' patching functions, side by side.

What is measured
    On a trained 2-layer, 4-head attention-only MQAR model (``--checkpoint``, or one trained here
    once and cached under ``bench/results/patching_model``), over ``--pairs`` clean/corrupted
    pairs (one target each): the time of

    * TransformerLens: ``run_with_cache`` of the clean run, then
      ``transformer_lens.patching.get_act_patch_attn_head_out_by_pos`` (and ``_all_pos``) with a
      logit-difference metric read at each pair's answer position;
    * phasemech: ``patch_heads(model, contrast, by_pos=True)`` (and ``by_pos=False``), which
      computes the clean and corrupted runs itself.

    Both run in this one process, single-threaded (``--threads``), alternating, ``--repeats``
    times each; the median is reported, and the two results are checked equal (max abs diff).
    Contrasts: ``answer`` (the needle's value corrupted: the standard pair, every later position
    differs) and ``grid`` (same tokens, grid shifted by d/2: only compressed layers differ).

Output
    A table with both times and the ratio TL / phasemech per contrast and mode, how many patched
    copies phasemech actually ran (the rest are exact by causality or identity), and JSON at
    ``bench/results/patching.json``. ``--quick`` is a smoke run (tiny model, few pairs).

Usage::

    .venv/bin/python bench/patching.py
    .venv/bin/python bench/patching.py --checkpoint runs/phase_sweep_default/route_d8_h4_T64_s0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
from transformer_lens import patching as tl_patching

from phasemech.core.config import CompressionConfig
from phasemech.data.tasks import MQARTask, generate
from phasemech.interventions.contrasts import make_contrast, metric_values
from phasemech.interventions.patching_fast import patch_heads
from phasemech.training.checkpoints import checkpoint_dirs, load_trained
from phasemech.training.config import ModelSpec, TrainConfig
from phasemech.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def bench_model(checkpoint: Path | None, quick: bool):
    """The model to patch: ``checkpoint``, or a route (MoBA) d=8 model trained here once (it
    learns MQAR in a few hundred steps on one thread) and cached."""
    if checkpoint is None:
        name = "patching_model_quick" if quick else "patching_model"
        checkpoint = ROOT / "bench/results" / name
        if not checkpoint_dirs(checkpoint):
            cfg = TrainConfig(
                task=MQARTask(seq_len=32 if quick else 64, n_pairs=4 if quick else 8, stride=8),
                model=ModelSpec(n_layers=2, d_model=32 if quick else 64, n_heads=4),
                compression=CompressionConfig("route", stride=8, window=16, layers=(1,)),
                steps=20 if quick else 1500,
                eval_every=10 if quick else 100,
                target_accuracy=0.99,
                eval_sequences=64 if quick else 512,
            )
            print(f"training the benchmark model into {checkpoint} (once) ...")
            train(cfg, checkpoint, progress=False)
    model, cfg, model_dir = load_trained(checkpoint)
    if cfg is None:
        raise SystemExit(f"{checkpoint} is not part of a training run: its task is unknown")
    return model, cfg.task, model_dir


def tl_run(model, contrast, foil, by_pos: bool) -> torch.Tensor:
    """TransformerLens' own path: clean cache, then its patching function."""
    ar = torch.arange(len(contrast))
    qpos = contrast.corrupted_query_pos

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return metric_values(logits[ar, qpos], contrast.answer, foil, "logit_diff").mean()

    fn = (
        tl_patching.get_act_patch_attn_head_out_by_pos
        if by_pos
        else tl_patching.get_act_patch_attn_head_out_all_pos
    )
    with model.shift_grid(contrast.clean_grid):
        _, cache = model.run_with_cache(contrast.clean_tokens)
    with model.shift_grid(contrast.corrupted_grid):
        return fn(model, contrast.corrupted_tokens, cache, metric)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="run folder or checkpoint (default: train)")
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contrasts", nargs="+", default=["answer", "grid"])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, 16 pairs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/patching.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")
    if args.quick:
        args.pairs, args.repeats = min(args.pairs, 16), 1
    model, task, source = bench_model(args.checkpoint, args.quick)
    stride = model.cfg.compression.stride
    ds = generate(task, args.pairs, seed=2024)
    rows = []
    print(
        f"model: {source}; {args.pairs} pairs; {args.threads} thread(s); median of {args.repeats}"
    )
    print(
        f"{'contrast':>8} {'mode':>8} {'TL s':>8} {'ours s':>8} {'ratio':>7} "
        f"{'max|diff|':>10} {'copies run':>16}"
    )
    for kind in args.contrasts:
        contrast = make_contrast(ds, kind, stride=stride, n_pairs=args.pairs)
        for by_pos in (True, False):
            t_tl, t_us = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                ours = patch_heads(model, contrast, by_pos=by_pos)
                t_us.append(time.perf_counter() - t0)
                foil = torch.tensor(ours.pairs["foil"].to_numpy())
                t0 = time.perf_counter()
                ref = tl_run(model, contrast, foil, by_pos)
                t_tl.append(time.perf_counter() - t0)
            diff = float((ours.tensor().float() - ref).abs().max())
            n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
            total = (
                n_layers * n_heads * args.pairs * (contrast.clean_tokens.shape[1] if by_pos else 1)
            )
            row = {
                "contrast": kind,
                "mode": "by_pos" if by_pos else "all_pos",
                "tl_s": statistics.median(t_tl),
                "ours_s": statistics.median(t_us),
                "max_abs_diff": diff,
                "copies_run": ours.n_run,
                "copies_total": total,
            }
            row["ratio"] = row["tl_s"] / row["ours_s"]
            rows.append(row)
            print(
                f"{kind:>8} {row['mode']:>8} {row['tl_s']:8.2f} {row['ours_s']:8.3f} "
                f"{row['ratio']:6.1f}x {diff:10.1e} {ours.n_run:>7}/{total:<8}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": str(source), "pairs": args.pairs, "threads": args.threads, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    goal = [r for r in rows if r["contrast"] == "answer" and r["mode"] == "by_pos"]
    if goal and not args.quick:
        verdict = "met" if goal[0]["ratio"] >= 10 else "NOT met"
        print(f"GOAL (>= 10x TL's _by_pos, answer contrast): {goal[0]['ratio']:.1f}x, {verdict}")


if __name__ == "__main__":
    main()
