"""Forward time and peak memory of ONE compressed attention layer vs the dense TL layer.

What is measured
    ``model.blocks[0].attn(x, x, x)`` under ``torch.inference_mode()``, with ``x`` a random
    ``[batch, T, d_model]`` residual, for a 1-layer attention-only ``PhaseTransformer``. The dense
    reference is TransformerLens' own ``Attention`` (``CompressionConfig("none")``); every
    compressed layer is made from that dense model with ``PhaseTransformer.from_hooked``, so all
    variants share the same Q/K/V/O weights. Grid: for T in {512, 1024, 2048, 4096}, stride d in
    {4, 8}, designs ``mean``, ``gated`` (the goal), ``mlp`` and ``route`` (reported only; ``route``
    materialises ``T x T`` scores by design). Everything runs on CPU, single-threaded by default
    (``--threads``), in one run, so dense and compressed share machine state and method.

Time
    One fresh process per T holds the dense layer and every compressed variant. After
    ``--warmup`` forwards each, ``--repeats`` rounds time every variant once per round with
    ``time.perf_counter`` (the variant order rotates each round, so load drift on a shared
    machine hits all variants alike). Reported: the median. A variant slower than
    ``--budget-s`` seconds in total stops after at least 3 repeats (only ``route`` at large T).

Memory (peak extra RSS, the headline number)
    One fresh process per (design, d, T) case, and one per T for dense (forked from a clean
    ``forkserver`` that has only imported torch/phasemech; ``spawn`` where forkserver is missing).
    In it: build the model and the input, run one full-size warm-up forward (first-call lazy
    init, BLAS buffers), ``gc.collect()`` and glibc ``malloc_trim(0)`` (so memory that the warm-up
    freed but glibc kept cannot be silently reused and hide the peak), read the current RSS
    (``VmRSS``: weights, input and warm state are in the baseline), reset the kernel's RSS
    high-water mark (``echo 5 > /proc/self/clear_refs``), run ONE forward, read the high-water
    mark (``VmHWM``). Peak extra MiB = HWM - baseline, output tensor included. ``VmHWM`` is used
    rather than ``getrusage().ru_maxrss`` because the latter cannot be reset and, in a child,
    also carries the parent's high-water mark from fork/exec; where ``clear_refs`` is not
    writable, the script falls back to ``ru_maxrss`` (flagged ``rss_method`` in the JSON).

Memory (secondary, ``alloc``)
    In the same child, one more forward under ``torch.profiler.profile(profile_memory=True)``:
    the running sum of the CPU allocator's ``[memory]`` events (allocations +, frees -) gives
    torch's exact peak of live tensor bytes during the forward, free of page granularity and
    glibc caching. It is printed as ``alloc ratio`` as a cross-check of the RSS ratio.

Output
    A table of ratios (compressed / dense, same T), the growth exponents (least-squares slope of
    log(value) vs log(T)) per design and stride (and for dense), a GOAL line (``mean`` and
    ``gated`` at T=4096, d=8 need time and RSS ratio <= 0.3) and JSON at
    ``bench/results/attention_scaling.json``. ``--quick`` runs T in {512, 1024} only with fewer
    repeats (CI smoke, ~20 s; the goal is then not evaluated). ``--check`` exits 1 unless the
    goal is evaluated and met. ``--help`` lists the model, window and timing flags.

Usage::

    .venv/bin/python bench/attention_scaling.py            # full run (a few minutes)
    .venv/bin/python bench/attention_scaling.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from phasemech.core.config import CompressionConfig, PhaseTransformerConfig
from phasemech.model.transformer import PhaseTransformer

FULL_SEQ_LENS = (512, 1024, 2048, 4096)
QUICK_SEQ_LENS = (512, 1024)
DEFAULT_STRIDES = (4, 8)
DEFAULT_DESIGNS = ("mean", "gated", "mlp", "route")
GOAL_DESIGNS = ("mean", "gated")
MIB = 2.0**20
RESULTS = Path(__file__).resolve().parent / "results" / "attention_scaling.json"


@dataclass(frozen=True)
class Spec:
    """Everything a child process needs to build one layer and its input."""

    d_model: int
    n_heads: int
    d_head: int
    n_ctx: int
    batch: int
    seed: int
    rotary: bool
    window_factor: int
    window: int | None
    block_len_factor: int
    threads: int

    def model_config(self, compression: CompressionConfig) -> PhaseTransformerConfig:
        extra: dict[str, Any] = {}
        if self.rotary:
            extra = {"positional_embedding_type": "rotary", "rotary_dim": self.d_head}
        return PhaseTransformerConfig(
            n_layers=1,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_head=self.d_head,
            n_ctx=self.n_ctx,
            d_vocab=16,
            attn_only=True,
            act_fn=None,
            seed=self.seed,
            device="cpu",
            compression=compression,
            **extra,
        )

    def compression(self, design: str, stride: int) -> CompressionConfig:
        if design == "none":
            return CompressionConfig("none")
        window = self.window if self.window is not None else self.window_factor * stride
        return CompressionConfig(
            design, stride=stride, block_len=self.block_len_factor * stride, window=window
        )


# ---------------------------------------------------------------------- child-side helpers
def _setup_child(spec: Spec) -> None:
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)


def _build(spec: Spec, variants: list[tuple[str, int]]) -> dict[tuple[str, int], torch.nn.Module]:
    """Attention layers keyed by (design, stride); ``("none", 0)`` is the dense TL layer."""
    dense = PhaseTransformer(spec.model_config(CompressionConfig("none"))).eval()
    layers: dict[tuple[str, int], torch.nn.Module] = {}
    for design, stride in variants:
        if design == "none":
            layers[(design, stride)] = dense.blocks[0].attn
        else:
            comp = PhaseTransformer.from_hooked(dense, spec.compression(design, stride)).eval()
            layers[(design, stride)] = comp.blocks[0].attn
    return layers


def _input(spec: Spec, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(spec.seed + seq)
    return torch.randn(spec.batch, seq, spec.d_model, generator=gen)


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _maxrss_kib() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r // 1024 if sys.platform == "darwin" else r  # bytes on macOS, KiB on Linux


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (kineto prints profiler start/stop lines there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _profiled_peak_mib(layer: torch.nn.Module, x: torch.Tensor) -> float:
    """Peak of live CPU tensor bytes during one forward, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = layer(x, x, x)
        del out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
            peak = max(peak, live)
    return peak / MIB


def child_memory(spec: Spec, design: str, stride: int, seq: int) -> dict[str, Any]:
    """Peak extra memory of one forward of one layer, in this (fresh) process."""
    _setup_child(spec)
    layer = _build(spec, [(design, stride)])[(design, stride)]
    x = _input(spec, seq)
    with torch.inference_mode():
        layer(x, x, x)  # warm-up: lazy init must not count as the forward's memory
        gc.collect()
        _malloc_trim()
        base = _status_kib("VmRSS")
        reset = base is not None and _reset_hwm()
        maxrss0 = _maxrss_kib()
        out = layer(x, x, x)
        hwm = _status_kib("VmHWM") if reset else None
        maxrss1 = _maxrss_kib()
        del out
        if reset and hwm is not None and base is not None:
            rss_mib, method = (hwm - base) / 1024, "VmHWM-reset"
        else:
            rss_mib, method = (maxrss1 - maxrss0) / 1024, "ru_maxrss"
        alloc_mib = _profiled_peak_mib(layer, x)
    return {"rss_mib": rss_mib, "alloc_mib": alloc_mib, "rss_method": method}


def child_time(
    spec: Spec, variants: list[tuple[str, int]], seq: int, warmup: int, repeats: int, budget: float
) -> dict[str, Any]:
    """Median forward time (ms) of every variant at one T, interleaved round-robin."""
    _setup_child(spec)
    layers = _build(spec, variants)
    x = _input(spec, seq)
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    with torch.inference_mode():
        for v in variants:
            for _ in range(warmup):
                layers[v](x, x, x)
        for r in range(repeats):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                done = times[v]
                if len(done) >= 3 and sum(done) > budget:
                    continue
                t0 = time.perf_counter()
                out = layers[v](x, x, x)
                done.append(time.perf_counter() - t0)
                del out
    return {
        f"{d}/{s}": {"ms": 1e3 * statistics.median(t), "n": len(t), "min_ms": 1e3 * min(t)}
        for (d, s), t in times.items()
    }


def _call(job: tuple[str, tuple]) -> dict[str, Any]:
    kind, args = job
    return child_memory(*args) if kind == "memory" else child_time(*args)


# ---------------------------------------------------------------------- parent side
def _context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Children fork with these already imported. (Not "__main__": CPython 3.11's forkserver
        # drops the main path, so that preload silently does nothing.)
        ctx.set_forkserver_preload(["torch", "torch.profiler", "phasemech.model.transformer"])
        return ctx
    return mp.get_context("spawn")


def run_fresh(ctx: mp.context.BaseContext, job: tuple[str, tuple]) -> dict[str, Any]:
    """Run one job in a brand-new process (one worker, one task)."""
    with ctx.Pool(processes=1, maxtasksperchild=1) as pool:
        return pool.apply(_call, (job,))


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x); points with y <= 0 are skipped."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) and b > 0 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="T values (None: all)")
    p.add_argument("--strides", type=int, nargs="+", default=list(DEFAULT_STRIDES))
    p.add_argument("--designs", nargs="+", default=list(DEFAULT_DESIGNS), choices=DEFAULT_DESIGNS)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--d-head", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rotary", action="store_true", help="rotary positions (default: standard)")
    p.add_argument("--window-factor", type=int, default=2, help="raw window W = factor * d")
    p.add_argument("--window", type=int, default=None, help="absolute W (overrides the factor)")
    p.add_argument("--block-len-factor", type=int, default=1, help="block length l = factor * d")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per child")
    p.add_argument("--warmup", type=int, default=None, help="warm-up forwards (None: 2, --quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (None: 7, --quick 3)")
    p.add_argument(
        "--budget-s", type=float, default=20.0, help="timing seconds per variant before stopping"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory children")
    p.add_argument("--quick", action="store_true", help="T in {512, 1024}, fewer repeats")
    p.add_argument("--goal-seq", type=int, default=4096)
    p.add_argument("--goal-stride", type=int, default=8)
    p.add_argument("--goal-ratio", type=float, default=0.3)
    p.add_argument(
        "--check", action="store_true", help="exit 1 when the goal is missed or not evaluated"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results path")
    args = p.parse_args(argv)
    if args.seq_lens is None:
        args.seq_lens = list(QUICK_SEQ_LENS if args.quick else FULL_SEQ_LENS)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seqs, strides, designs = sorted(args.seq_lens), sorted(args.strides), list(args.designs)
    spec = Spec(
        d_model=args.d_model,
        n_heads=args.n_heads,
        d_head=args.d_head,
        n_ctx=max(seqs),
        batch=args.batch,
        seed=args.seed,
        rotary=args.rotary,
        window_factor=args.window_factor,
        window=args.window,
        block_len_factor=args.block_len_factor,
        threads=args.threads,
    )
    for d in strides:  # fail fast on bad choices, before any child starts
        for design in designs:
            spec.compression(design, d)
    variants = [("none", 0)] + [(de, d) for de in designs for d in strides]
    ctx = _context()
    t_start = time.perf_counter()

    timing: dict[int, dict[str, Any]] = {}
    memory: dict[tuple[str, int, int], dict[str, Any]] = {}
    for seq in seqs:
        t0 = time.perf_counter()
        job = (spec, variants, seq, args.warmup, args.repeats, args.budget_s)
        timing[seq] = run_fresh(ctx, ("time", job))
        print(f"[time]   T={seq:5d}  done in {time.perf_counter() - t0:6.1f}s", flush=True)
        if args.no_memory:
            continue
        for design, d in variants:
            t0 = time.perf_counter()
            memory[(design, d, seq)] = run_fresh(ctx, ("memory", (spec, design, d, seq)))
            m = memory[(design, d, seq)]
            print(
                f"[memory] T={seq:5d} {design:>5s} d={d}  rss {m['rss_mib']:8.1f} MiB  "
                f"alloc {m['alloc_mib']:8.1f} MiB  ({time.perf_counter() - t0:4.1f}s)",
                flush=True,
            )

    def mem(design: str, d: int, seq: int, key: str) -> float | None:
        m = memory.get((design, d, seq))
        return None if m is None else m[key]

    rows = []
    for design in designs:
        for d in strides:
            for seq in seqs:
                dense_t = timing[seq]["none/0"]["ms"]
                comp_t = timing[seq][f"{design}/{d}"]["ms"]
                row = {
                    "design": design,
                    "stride": d,
                    "T": seq,
                    "dense_ms": dense_t,
                    "comp_ms": comp_t,
                    "time_ratio": comp_t / dense_t,
                    "comp_repeats": timing[seq][f"{design}/{d}"]["n"],
                    "dense_mib": mem("none", 0, seq, "rss_mib"),
                    "comp_mib": mem(design, d, seq, "rss_mib"),
                    "dense_alloc_mib": mem("none", 0, seq, "alloc_mib"),
                    "comp_alloc_mib": mem(design, d, seq, "alloc_mib"),
                }
                row["mem_ratio"] = _ratio(row["comp_mib"], row["dense_mib"])
                row["alloc_ratio"] = _ratio(row["comp_alloc_mib"], row["dense_alloc_mib"])
                rows.append(row)

    exponents = [
        {
            "design": "dense",
            "stride": None,
            "time": fit_exponent(seqs, [timing[s]["none/0"]["ms"] for s in seqs]),
            "mem": fit_exponent(seqs, [mem("none", 0, s, "rss_mib") for s in seqs]),
            "alloc": fit_exponent(seqs, [mem("none", 0, s, "alloc_mib") for s in seqs]),
        }
    ]
    for design in designs:
        for d in strides:
            sel = [r for r in rows if r["design"] == design and r["stride"] == d]
            exponents.append(
                {
                    "design": design,
                    "stride": d,
                    "time": fit_exponent(seqs, [r["comp_ms"] for r in sel]),
                    "mem": fit_exponent(seqs, [r["comp_mib"] for r in sel]),
                    "alloc": fit_exponent(seqs, [r["comp_alloc_mib"] for r in sel]),
                }
            )

    goal: dict[str, Any] = {
        "T": args.goal_seq,
        "stride": args.goal_stride,
        "max_ratio": args.goal_ratio,
        "designs": {},
    }
    for design in GOAL_DESIGNS:
        hit = [
            r
            for r in rows
            if r["design"] == design and r["stride"] == args.goal_stride and r["T"] == args.goal_seq
        ]
        if not hit or hit[0]["mem_ratio"] is None:
            goal["designs"][design] = None
            continue
        r = hit[0]
        goal["designs"][design] = {
            "time_ratio": r["time_ratio"],
            "mem_ratio": r["mem_ratio"],
            "met": r["time_ratio"] <= args.goal_ratio and r["mem_ratio"] <= args.goal_ratio,
        }
    evaluated = [v for v in goal["designs"].values() if v is not None]
    goal["evaluated"] = len(evaluated) == len(GOAL_DESIGNS)
    goal["met"] = goal["evaluated"] and all(v["met"] for v in evaluated)

    _print(rows, exponents, goal, spec, args)
    meta = {
        "spec": asdict(spec),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "start_method": ctx.get_start_method(),
        "rss_method": sorted({m["rss_method"] for m in memory.values()}),
        "wall_s": time.perf_counter() - t_start,
    }
    payload = {"meta": meta, "rows": rows, "exponents": exponents, "goal": goal}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"results written to {args.out}")
    return 1 if args.check and not goal["met"] else 0


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print(rows, exponents, goal, spec: Spec, args) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain fallback
        Console = Table = None  # noqa: N806

    window = f"{spec.window}" if spec.window is not None else f"{spec.window_factor}d"
    head = (
        f"one attention layer, d_model={spec.d_model} heads={spec.n_heads} d_head={spec.d_head} "
        f"batch={spec.batch} W={window} l={spec.block_len_factor}d threads={spec.threads} "
        f"warmup={args.warmup} repeats={args.repeats} (median)"
    )
    cols = [
        "design",
        "d",
        "T",
        "dense ms",
        "comp ms",
        "time ratio",
        "dense MiB",
        "comp MiB",
        "mem ratio",
        "alloc ratio",
    ]
    body = [
        [
            r["design"],
            str(r["stride"]),
            str(r["T"]),
            _fmt(r["dense_ms"], ".1f"),
            _fmt(r["comp_ms"], ".1f"),
            _fmt(r["time_ratio"], ".3f"),
            _fmt(r["dense_mib"], ".1f"),
            _fmt(r["comp_mib"], ".1f"),
            _fmt(r["mem_ratio"], ".3f"),
            _fmt(r["alloc_ratio"], ".3f"),
        ]
        for r in rows
    ]
    ecols = ["design", "d", "time exp", "mem exp (RSS)", "mem exp (alloc)"]
    ebody = [
        [
            e["design"],
            "-" if e["stride"] is None else str(e["stride"]),
            _fmt(e["time"], ".2f"),
            _fmt(e["mem"], ".2f"),
            _fmt(e["alloc"], ".2f"),
        ]
        for e in exponents
    ]
    if Table is not None:
        console = Console(width=140)
        console.print(head)
        t = Table()
        for c in cols:
            t.add_column(c, justify="left" if c == "design" else "right")
        prev = None
        for r, line in zip(rows, body, strict=True):
            if prev is not None and (r["design"], r["stride"]) != prev:
                t.add_section()
            prev = (r["design"], r["stride"])
            t.add_row(*line)
        console.print(t)
        et = Table(title="growth exponents: slope of log(value) vs log(T)", title_justify="left")
        for c in ecols:
            et.add_column(c, justify="left" if c == "design" else "right")
        for line in ebody:
            et.add_row(*line)
        console.print(et)
    else:
        print(head)
        for table in ((cols, body), (ecols, ebody)):
            print(" | ".join(table[0]))
            for line in table[1]:
                print(" | ".join(line))
    thr = goal["max_ratio"]
    where = f"T={goal['T']}, d={goal['stride']}"
    if not goal["evaluated"]:
        missing = [de for de, v in goal["designs"].items() if v is None]
        print(f"GOAL not evaluated: no {where} time+memory measurement for {', '.join(missing)}")
        return
    parts = [
        f"{de}: time {v['time_ratio']:.3f}x, mem {v['mem_ratio']:.3f}x "
        f"({'ok' if v['met'] else 'MISSED'})"
        for de, v in goal["designs"].items()
    ]
    verdict = "met" if goal["met"] else "NOT met"
    print(f"GOAL {verdict} (mean & gated at {where}, both ratios <= {thr}): " + "; ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
