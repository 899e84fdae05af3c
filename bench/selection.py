"""Whole SmolLM2-135M forwards: dense vs each selecting design, time and peak memory.

What is measured (one process, one torch thread, CPU, side by side)
    For each T (default 512, 1024, 2048, 4096), a random token sequence of length T runs through
    the uncompressed model (dense: TransformerLens' own attention) and through each design
    applied post hoc to every layer (``route``, ``quest``, ``kpool``, ``evict``; d = 4, top-k 8,
    raw window 16 by default), up to the last block (no unembedding). Per variant:

    * ``forward_s``: the median of ``--repeats`` whole forwards; rounds rotate the variant order,
      so load drift on a shared machine hits every variant alike;
    * ``attn_s``: of that forward, the time spent inside the 30 attention modules (wall time
      between forward pre- and post-hooks, summed), the median over the same rounds;
    * ``attn_mib``: the peak extra resident memory of ONE attention module (layer 2) during a
      forward: in its pre-hook, ``gc`` + ``malloc_trim`` and the kernel's RSS high-water mark
      is reset (``/proc/self/clear_refs``); in its post-hook the high-water mark minus the RSS
      at the pre-hook is read (inputs and weights are in the baseline; the output is not);
    * ``forward_mib``: the same over a whole forward (the residual stream included).

Ratios are against dense in the same run. The issue's goal at T = 4096, d = 4, top-k 8:
attention time and memory <= 0.3x dense attention, whole forward <= 0.8x dense.

Usage: ``python bench/selection.py [--seq-lens 512 1024 2048 4096] [--repeats 3]``;
``--tiny`` runs a random 2-layer model with SmolLM2's head shapes (the smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from phasemech.core.config import CompressionConfig
from phasemech.model.transformer import PhaseTransformer

RESULTS = Path(__file__).resolve().parent / "results" / "selection.json"
DESIGNS = ("route", "quest", "kpool", "evict")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_hwm() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Meter:
    """Forward hooks on every attention module: summed wall time, and one module's peak."""

    def __init__(self, model, probe_layer: int = 2) -> None:
        self.attn_s, self.peak_mib, self._t0, self._base = 0.0, None, 0.0, 0
        self.probe = probe_layer
        self.measure_memory = False
        for i, block in enumerate(model.blocks):
            block.attn.register_forward_pre_hook(lambda m, a, i=i: self._pre(i))
            block.attn.register_forward_hook(lambda m, a, o, i=i: self._post(i))

    def _pre(self, i: int) -> None:
        if self.measure_memory and i == self.probe:
            _reset_hwm()
            self._base = _status_kib("VmRSS")
        self._t0 = time.perf_counter()

    def _post(self, i: int) -> None:
        self.attn_s += time.perf_counter() - self._t0
        if self.measure_memory and i == self.probe:
            self.peak_mib = (_status_kib("VmHWM") - self._base) / 1024


def load(tiny: bool, n_ctx: int):
    if tiny:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        cfg = HookedTransformerConfig(
            n_layers=3, d_model=96, n_heads=3, n_key_value_heads=1, d_head=32, d_mlp=128,
            n_ctx=n_ctx, d_vocab=100, act_fn="silu", normalization_type="RMS",
            positional_embedding_type="rotary", rotary_dim=32, device="cpu",
        )  # fmt: skip
        return HookedTransformer(cfg).eval()
    from phasemech.model.pretrained import load_pretrained

    return load_pretrained("smollm2-135m", n_ctx=n_ctx)


def variants(base, args) -> dict[str, object]:
    out = {"dense": base}
    for design in args.designs:
        extra = {"obs_window": args.obs_window} if design == "evict" else {}
        comp = CompressionConfig(design, stride=args.stride, top_k=args.top_k,
                                 window=args.window, **extra)  # fmt: skip
        out[design] = PhaseTransformer.from_hooked(base, comp).eval()
    return out


@torch.inference_mode()
def measure(models: dict, seq: int, repeats: int, vocab: int) -> dict[str, dict]:
    x = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    meters = {name: Meter(m) for name, m in models.items()}
    times: dict[str, list] = {n: [] for n in models}
    attn: dict[str, list] = {n: [] for n in models}
    names = list(models)
    for name in names:  # warm-up
        models[name](x, stop_at_layer=models[name].cfg.n_layers)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            meters[name].attn_s = 0.0
            t0 = time.perf_counter()
            models[name](x, stop_at_layer=models[name].cfg.n_layers)
            times[name].append(time.perf_counter() - t0)
            attn[name].append(meters[name].attn_s)
    out = {}
    for name in names:
        meters[name].measure_memory = True
        _reset_hwm()
        base = _status_kib("VmRSS")
        models[name](x, stop_at_layer=models[name].cfg.n_layers)
        forward_mib = (_status_kib("VmHWM") - base) / 1024
        meters[name].measure_memory = False
        out[name] = dict(forward_s=statistics.median(times[name]),
                         attn_s=statistics.median(attn[name]),
                         attn_mib=meters[name].peak_mib, forward_mib=forward_mib)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS + ("mean",))
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--obs-window", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a random 3-layer model (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    base = load(args.tiny, max(args.seq_lens))
    models = variants(base, args)
    rows = []
    for seq in sorted(args.seq_lens):
        res = measure(models, seq, args.repeats, base.cfg.d_vocab)
        dense = res["dense"]
        for name, r in res.items():
            row = dict(T=seq, variant=name, **r)
            for key in ("forward_s", "attn_s", "attn_mib", "forward_mib"):
                row[f"{key}_ratio"] = r[key] / dense[key] if dense[key] else None
            rows.append(row)
            print(f"T={seq:5d} {name:>6s} forward {r['forward_s']:7.2f}s "
                  f"({row['forward_s_ratio']:.2f}x)  attention {r['attn_s']:7.2f}s "
                  f"({row['attn_s_ratio']:.2f}x)  attention peak {r['attn_mib']:7.1f} MiB "
                  f"({row['attn_mib_ratio'] or 0:.2f}x)  forward peak {r['forward_mib']:7.1f} MiB",
                  flush=True)  # fmt: skip
    meta = dict(vars(args), out=str(args.out), wall_s=time.perf_counter() - t_start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"results written to {args.out} ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
