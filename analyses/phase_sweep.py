"""Headline reproduction: do from-scratch compressed models retrieve worse at some phases?

Same-size 2-layer attention-only models (d_model 64), trained on phase-uniform MQAR (V=64,
8 pairs), layer 2 compressed with a raw window of 2d, designs ``none`` (dense control),
``mean``, ``gated``, ``mlp``, ``route``; stride 4 and 8; 2 and 4 heads; T = 64 (and 128 for a
subset); 3 seeds each. Every model is scored on one shared phase-balanced test set per length
(4096 sequences: 512 contents at each of 8 shifts) at its final checkpoint and at
intermediate ones, with the full statistics template of ``phasemech.measure.stats``.

Stages (each cached under ``RUNS/phase_sweep_<profile>/``; rerunning skips finished work):

1. train every missing model, one process per core, one torch thread each;
2. score the chosen checkpoints of each model on the test set (``targets_<step>.parquet``);
3. aggregate: per model and pooled over seeds, the per-phase accuracy, gaps (raw, permutation
   null, debiased with CI) and tests; plus held-out gap versus accuracy along training, for
   every design against the dense control at the same accuracy.

Writes ``results.parquet`` (one row per design x stride x heads x T x seed|pooled x step),
``gap_vs_accuracy.parquet``, ``summary.md`` and ``summary.json`` in the sweep folder.

``--profile long`` trains gated and dense 4-head models for 5000 steps (the budget axis).

Usage: ``python analyses/phase_sweep.py [--profile tiny|default|long|full] [--runs runs]
[--workers N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from phasemech.core.config import DESIGNS
from phasemech.core.grid import phase_of

console = Console()


@dataclass(frozen=True)
class Profile:
    designs: tuple[str, ...]
    strides: tuple[int, ...]
    heads: tuple[int, ...]
    seq_lens: tuple[int, ...]
    seeds: tuple[int, ...]
    steps: int
    eval_every: int
    checkpoint_every: int
    target_accuracy: float | None
    test_sequences: int
    n_boot: int
    n_perm: int
    # longer contexts are expensive: only these designs/heads are trained at seq_lens[1:]
    long_designs: tuple[str, ...] = ("none", "gated", "mean")
    long_heads: tuple[int, ...] = (4,)
    long_strides: tuple[int, ...] = (4, 8)
    n_pairs: int = 8


_SWEEP = dict(designs=DESIGNS, strides=(4, 8), heads=(2, 4), seeds=(0, 1, 2), eval_every=100)
PROFILES = {
    "tiny": Profile(
        designs=("none", "gated"),
        strides=(4,),
        heads=(2,),
        seq_lens=(32,),
        seeds=(0,),
        steps=30,
        eval_every=10,
        checkpoint_every=10,
        target_accuracy=None,
        test_sequences=64,
        n_boot=50,
        n_perm=50,
        long_designs=(),
        long_heads=(),
        n_pairs=4,
    ),
    "default": Profile(
        **_SWEEP,
        seq_lens=(64, 128),
        steps=2000,
        checkpoint_every=500,
        target_accuracy=0.995,
        test_sequences=4096,
        n_boot=400,
        n_perm=400,
        long_designs=("none", "gated"),
        long_strides=(8,),
    ),
    # the budget axis: does a longer run escape the plateau, and does the gap close?
    "long": Profile(
        **{**_SWEEP, "designs": ("none", "gated"), "heads": (4,)},
        seq_lens=(64,),
        steps=5000,
        checkpoint_every=500,
        target_accuracy=0.995,
        test_sequences=4096,
        n_boot=400,
        n_perm=400,
        long_designs=(),
        long_heads=(),
    ),
    "full": Profile(
        **{**_SWEEP, "seeds": (0, 1, 2, 3, 4)},
        seq_lens=(64, 128),
        steps=4000,
        checkpoint_every=500,
        target_accuracy=None,
        test_sequences=8192,
        n_boot=1000,
        n_perm=1000,
        long_heads=(2, 4),
    ),
}


@dataclass(frozen=True)
class RunSpec:
    design: str
    stride: int  # dense runs: the largest stride (phases on smaller grids derive from it)
    heads: int
    seq_len: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.design}_d{self.stride}_h{self.heads}_T{self.seq_len}_s{self.seed}"


def run_specs(p: Profile) -> list[RunSpec]:
    specs = []
    for t_i, seq_len in enumerate(p.seq_lens):
        designs = p.designs if t_i == 0 else p.long_designs
        heads = p.heads if t_i == 0 else p.long_heads
        for design in designs:
            strides = p.strides if t_i == 0 else p.long_strides
            strides = (max(strides),) if design == "none" else strides
            for d in strides:
                for h in heads:
                    for s in p.seeds:
                        specs.append(RunSpec(design, d, h, seq_len, s))
    return specs


def train_config(spec: RunSpec, p: Profile):
    from phasemech.core.config import CompressionConfig
    from phasemech.data.tasks import MQARTask
    from phasemech.training.config import ModelSpec, TrainConfig

    # one task stride for all runs: the same data stream and test set for every design
    task = MQARTask(vocab_size=64, seq_len=spec.seq_len, n_pairs=p.n_pairs, stride=max(p.strides))
    if spec.design == "none":
        comp = CompressionConfig("none", stride=spec.stride)
    else:
        comp = CompressionConfig(
            spec.design, stride=spec.stride, window=2 * spec.stride, layers=(1,)
        )
    return TrainConfig(
        task=task,
        model=ModelSpec(n_layers=2, d_model=64, n_heads=spec.heads),
        compression=comp,
        steps=p.steps,
        eval_every=p.eval_every,
        checkpoint_every=p.checkpoint_every,
        eval_sequences=512 if p.test_sequences >= 512 else 8 * 8,
        target_accuracy=p.target_accuracy,
        seed=spec.seed,
    )


def run_one(spec: RunSpec, p: Profile, sweep_dir: str) -> dict:
    """Worker: train if needed, then score the chosen checkpoints. Returns timing info."""
    import torch

    torch.set_num_threads(1)
    from phasemech.data.tasks import balanced_test_set
    from phasemech.measure.evaluate import predict
    from phasemech.model.transformer import PhaseTransformer
    from phasemech.training.checkpoints import checkpoint_dirs
    from phasemech.training.trainer import train

    run_dir = Path(sweep_dir) / spec.name
    cfg = train_config(spec, p)
    t0 = time.perf_counter()
    result = train(cfg, run_dir, resume=True, progress=False)
    t_train = time.perf_counter() - t0
    ckpts = checkpoint_dirs(run_dir)
    test = balanced_test_set(cfg.task, p.test_sequences, seed=777)
    for ckpt in ckpts:
        out = run_dir / f"targets_{ckpt.name}.parquet"
        if out.exists():
            continue
        model = PhaseTransformer.load(ckpt)
        df = predict(model, test)
        df["step"] = int(ckpt.name.removeprefix("step_"))
        tmp = out.with_suffix(".tmp")
        df.to_parquet(tmp)
        os.replace(tmp, out)
    return {
        "name": spec.name,
        "train_seconds": t_train,
        "step": result.step,
        "accuracy": result.accuracy,
        "total_seconds": time.perf_counter() - t0,
    }


# ----------------------------------------------------------------------------------- aggregate


def load_targets(sweep_dir: Path, specs: list[RunSpec]) -> pd.DataFrame:
    frames = []
    for spec in specs:
        for f in sorted((sweep_dir / spec.name).glob("targets_step_*.parquet")):
            df = pd.read_parquet(
                f,
                columns=[
                    "group_id",
                    "target",
                    "source_pos",
                    "depth",
                    "distance",
                    "correct",
                    "step",
                ],
            )
            df["run"] = spec.name
            for k in ("design", "stride", "heads", "seq_len", "seed"):
                df[k] = getattr(spec, k)
            frames.append(df)
    return pd.concat(frames, ignore_index=True)


def _grids(design: str, stride: int, p: Profile) -> list[int]:
    """Phase grids a run is reported on: a dense run on every stride that divides its own."""
    return [s for s in p.strides if s <= stride] if design == "none" else [stride]


def report_row(key: dict, df: pd.DataFrame, stride: int, n_boot: int, n_perm: int) -> dict:
    from phasemech.measure.stats import phase_report

    if key["targets"] == "far":
        # sources at least W + d - 1 = 3d - 1 back are read only through blocks (W = 2d)
        df = df[df["distance"] >= 3 * stride - 1]
    sdf = df.assign(phase=phase_of(df["source_pos"].to_numpy(), stride))
    # clusters: contents; with several seeds, seeds then contents (stats resamples both)
    sdf["seq_id"] = sdf["group_id"] + 1_000_000 * sdf["seed"]
    # paired blocks: one target of one content (and seed) seen at every shift
    sdf["pair_id"] = sdf["seq_id"] * 1024 + sdf["target"]
    if key.get("seed") != "pooled":
        sdf = sdf.drop(columns="seed")
    rep = phase_report(sdf, stride, n_boot=n_boot, n_perm=n_perm, seed=0)
    pp = rep.per_phase
    h = rep.harmonics
    return {
        **key,
        "phase_stride": stride,
        "n": rep.n,
        "accuracy": rep.accuracy,
        "acc_by_phase": [round(float(x), 4) for x in pp["accuracy"]],
        "n_per_phase": int(pp["n"].min()),
        "raw_gap": rep.gap["raw_gap"],
        "null_median": rep.gap["null_median"],
        "null_p95": rep.gap["null_p95"],
        "p_perm": rep.gap["p_perm"],
        "debiased_gap": rep.gap["debiased_gap"],
        "debiased_lo": rep.gap["debiased_lo"],
        "debiased_hi": rep.gap["debiased_hi"],
        "weak_phase": rep.gap["argmin_phase"],
        "p_logistic": rep.logistic["p"],
        "p_chi2": rep.chi2["p"],
        "p_paired": rep.paired.get("p", float("nan")),
        "p_harmonic_min_holm": float(h["p_holm"].min()),
        "guard_uniform_p": rep.guard["uniform_p"],
        "guard_independence_p": rep.guard["independence_p"],
    }


def _report_job(args):
    from threadpoolctl import threadpool_limits

    # one BLAS thread: the workers already fill the cores, and BLAS threads spinning on a busy
    # 2-core box made the logistic fits several times slower
    with threadpool_limits(1):
        return report_row(*args)


def aggregate(sweep_dir: Path, specs: list[RunSpec], p: Profile, workers: int) -> pd.DataFrame:
    from phasemech.training.checkpoints import read_metrics

    targets = load_targets(sweep_dir, specs)
    final_steps = targets.groupby("run")["step"].max().to_dict()
    jobs = []
    group_cols = ["design", "stride", "heads", "seq_len"]
    for keys, g in targets.groupby(group_cols):
        key = dict(zip(group_cols, keys, strict=True))
        fin = g[g["step"] == g["run"].map(final_steps)]
        for stride in _grids(key["design"], key["stride"], p):
            for targets in ("all", "far"):
                pooled = {**key, "seed": "pooled", "step": "final", "targets": targets}
                jobs.append((pooled, fin, stride, p.n_boot, p.n_perm))
            for (seed, step), gs in g.groupby(["seed", "step"]):
                stage = "final" if final_steps[gs["run"].iat[0]] == step else int(step)
                jobs.append(
                    (
                        {**key, "seed": int(seed), "step": stage, "targets": "all"},
                        gs,
                        stride,
                        min(p.n_boot, 200),
                        min(p.n_perm, 200),
                    )
                )
    rows = []
    with _progress() as bar, ProcessPoolExecutor(workers) as pool:
        task = bar.add_task("statistics", total=len(jobs))
        for row in pool.map(_report_job, jobs, chunksize=4):
            rows.append(row)
            bar.advance(task)
    results = pd.DataFrame(rows)
    results["step"] = results["step"].astype(str)
    results["seed"] = results["seed"].astype(str)
    results.to_parquet(sweep_dir / "results.parquet")

    # held-out gap along training, for matching compressed runs to dense ones by accuracy
    curve = []
    for spec in specs:
        for m in read_metrics(sweep_dir / spec.name):
            by = np.asarray(m["accuracy_by_phase"], dtype=float)
            for stride in _grids(spec.design, spec.stride, p):
                # accuracy by phase on a coarser grid: phases fold (mod), counts are equal
                folded = by.reshape(-1, stride).mean(0) if len(by) != stride else by
                curve.append(
                    {
                        "design": spec.design,
                        "stride": stride,
                        "heads": spec.heads,
                        "seq_len": spec.seq_len,
                        "seed": spec.seed,
                        "step": m["step"],
                        "accuracy": m["accuracy"],
                        "raw_gap": float(folded.max() - folded.min()),
                    }
                )
    pd.DataFrame(curve).to_parquet(sweep_dir / "gap_vs_accuracy.parquet")
    return results


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def _fmt(x: float) -> str:
    return "nan" if x is None or not np.isfinite(x) else f"{x:.3f}"


def _pooled_table(fin: pd.DataFrame) -> list[str]:
    lines = [
        "| design | d | heads | T | n | acc | acc by phase | raw gap | null p95 | debiased gap "
        "[95% CI] | p (logistic) | p (perm) | p (paired) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {d: i for i, d in enumerate(DESIGNS)}
    fin = fin.iloc[
        np.lexsort((fin["design"].map(order), fin["heads"], fin["phase_stride"], fin["seq_len"]))
    ]
    for r in fin.itertuples():
        phases = " ".join(f"{x:.3f}" for x in r.acc_by_phase)
        lines.append(
            f"| {r.design} | {r.phase_stride} | {r.heads} | {r.seq_len} | {r.n} | "
            f"{r.accuracy:.3f} | {phases} | {_fmt(r.raw_gap)} | {_fmt(r.null_p95)} | "
            f"{_fmt(r.debiased_gap)} [{_fmt(r.debiased_lo)}, {_fmt(r.debiased_hi)}] | "
            f"{r.p_logistic:.2g} | {r.p_perm:.2g} | {r.p_paired:.2g} |"
        )
    return lines


def write_summary(
    sweep_dir: Path, results: pd.DataFrame, seconds: float | None, p: Profile, n_models: int
) -> str:
    fin = results[(results["step"] == "final") & (results["seed"] == "pooled")]
    far, fin = fin[fin["targets"] == "far"], fin[fin["targets"] == "all"]
    timing = (
        f"Wall time {seconds / 60:.1f} min for {n_models} models."
        if seconds is not None
        else f"Aggregated from the {n_models} runs scored so far (no timing)."
    )
    lines = [
        f"# Phase sweep ({sweep_dir.name})",
        "",
        f"{timing} Test set: {p.test_sequences} phase-balanced "
        "sequences per length; seeds pooled (clusters: seed, then content); p (paired): "
        "Cochran's Q over each target seen at every phase.",
        "",
        *_pooled_table(fin),
        "",
        "## Targets beyond the raw window (distance >= 3d - 1: read through blocks only)",
        "",
        *_pooled_table(far),
    ]
    lines += [
        "",
        "## Per seed, final",
        "",
        "| design | d | heads | T | seed | step | acc | raw gap | debiased gap | p (perm) "
        "| p (paired) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    per = results[(results["seed"] != "pooled") & (results["step"] == "final")]
    for r in per.sort_values(["seq_len", "phase_stride", "heads", "design", "seed"]).itertuples():
        lines.append(
            f"| {r.design} | {r.phase_stride} | {r.heads} | {r.seq_len} | {r.seed} | "
            f"final | {r.accuracy:.3f} | {_fmt(r.raw_gap)} | {_fmt(r.debiased_gap)} | "
            f"{r.p_perm:.2g} | {r.p_paired:.2g} |"
        )
    lines += _budget_table(results) + _matched_table(sweep_dir)
    text = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(text)
    return text


def _budget_table(results: pd.DataFrame) -> list[str]:
    """Mean over seeds of accuracy and debiased gap at each scored checkpoint."""
    per = results[results["seed"] != "pooled"].copy()
    steps = sorted({s for s in per["step"] if s != "final"}, key=int) + ["final"]
    lines = [
        "",
        "## Training budget (mean over seeds: accuracy / debiased gap)",
        "",
        "| design | d | heads | T | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|---|---|---|" + "---|" * len(steps),
    ]
    keys = ["design", "phase_stride", "heads", "seq_len"]
    for key, g in per.groupby(keys, sort=True):
        cells = []
        for s in steps:
            gs = g[g["step"] == s]
            cells.append(
                f"{gs['accuracy'].mean():.3f} / {gs['debiased_gap'].mean():.3f} ({len(gs)})"
                if len(gs)
                else ""
            )
        lines.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "(n) = seeds with a checkpoint at that step; runs that stopped early at the "
        "target accuracy only have a final row."
    )
    return lines


ACC_BINS = [0.0, 0.3, 0.6, 0.9, 0.99, 1.0001]


def _matched_table(sweep_dir: Path) -> list[str]:
    """Held-out raw gap along training, binned by held-out accuracy: designs vs dense."""
    curve = pd.read_parquet(sweep_dir / "gap_vs_accuracy.parquet")
    labels = ["<0.3", "0.3-0.6", "0.6-0.9", "0.9-0.99", ">=0.99"]
    curve["bin"] = pd.cut(curve["accuracy"], ACC_BINS, labels=labels, right=False)
    lines = [
        "",
        "## Matched accuracy: held-out raw gap by accuracy band (mean over evaluations, n)",
        "",
        "Every evaluation (each 100 steps, 512 held-out sequences) of every seed, binned by "
        "its accuracy: compare each design with the dense row at the same accuracy.",
        "",
        "| design | d | heads | T | " + " | ".join(labels) + " |",
        "|---|---|---|---|" + "---|" * len(labels),
    ]
    keys = ["seq_len", "stride", "heads", "design"]
    order = {d: i for i, d in enumerate(DESIGNS)}
    groups = sorted(
        curve.groupby(keys, observed=True), key=lambda kv: (*kv[0][:3], order.get(kv[0][3], 9))
    )
    for (seq_len, stride, heads, design), g in groups:
        cells = []
        for lab in labels:
            gb = g[g["bin"] == lab]
            cells.append(f"{gb['raw_gap'].mean():.3f} ({len(gb)})" if len(gb) else "")
        lines.append(f"| {design} | {stride} | {heads} | {seq_len} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps", type=int, default=None, help="override the profile's steps")
    parser.add_argument(
        "--aggregate-only",
        action="store_true",
        help="skip training and scoring: report on the runs already scored",
    )
    args = parser.parse_args()
    p = PROFILES[args.profile]
    if args.steps:
        p = replace(p, steps=args.steps)
    # a different step budget is a different sweep: its own cache
    suffix = f"_steps{args.steps}" if args.steps else ""
    sweep_dir = args.runs / f"phase_sweep_{args.profile}{suffix}"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    specs = run_specs(p)
    console.print(
        f"[bold]phase sweep[/] profile {args.profile}: {len(specs)} models, "
        f"{args.workers} worker processes, cache {sweep_dir}"
    )
    t0 = time.perf_counter()
    timings = []
    if args.aggregate_only:
        specs = [s for s in specs if list((sweep_dir / s.name).glob("targets_step_*.parquet"))]
        console.print(f"aggregating the {len(specs)} runs already scored")
    with _progress() as bar, ProcessPoolExecutor(args.workers) as pool:
        task = bar.add_task("train + score", total=len(specs))
        todo = [] if args.aggregate_only else specs
        futures = {pool.submit(run_one, s, p, str(sweep_dir)): s for s in todo}
        for fut in as_completed(futures):
            info = fut.result()
            timings.append(info)
            bar.console.print(
                f"  {info['name']}: step {info['step']}, held-out acc "
                f"{info['accuracy']:.3f}, {info['total_seconds']:.0f}s"
            )
            bar.advance(task)
    results = aggregate(sweep_dir, specs, p, args.workers)
    seconds = time.perf_counter() - t0
    n_models = len(specs)
    if args.aggregate_only:  # the wall time of the run that trained and scored, if recorded
        done = sweep_dir / "summary.json"
        recorded = json.loads(done.read_text()) if done.is_file() else {}
        seconds, n_models = recorded.get("wall_seconds"), recorded.get("models", n_models)
    text = write_summary(sweep_dir, results, seconds, p, n_models)
    print(text)
    if args.aggregate_only:
        return
    (sweep_dir / "summary.json").write_text(
        json.dumps(
            {
                "profile": args.profile,
                "models": len(specs),
                "wall_seconds": seconds,
                "workers": args.workers,
                "runs": timings,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
