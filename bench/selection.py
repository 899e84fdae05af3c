"""Whole SmolLM2-135M forwards: the selecting designs against the same weights in
``transformers`` with SDPA, time and peak memory, side by side in one process.

Variants (one thread, CPU; each a whole forward to the last block, no unembedding)
    * ``hf``: the baseline, what a user already runs: ``LlamaModel`` from ``transformers``
      (``attn_implementation="sdpa"``) with the weights phasemech loads;
    * ``sdpa``: phasemech's dense model (the same weights as a ``HookedTransformer``) with its
      attention through SDPA (``use_eval_sdpa``) and no per-forward weight copies
      (``linear_layout``), what the audit runs uncompressed;
    * ``floor``: ``hf`` with the attention step itself skipped (the query passed through as its
      output): projections, RoPE and the rest of the forward, the time no design that keeps
      the model's projections can go below (its attention ratio is the floor of ``attn_s``);
    * ``tl``: TransformerLens' own dense attention (explicit score matrix and mask), for
      reference only: no user runs it for speed;
    * each design (``route``, ``quest``, ``kpool``, ``evict``) applied post hoc to every layer
      (d = 4, top-k 8, raw window 16 by default), with ``linear_layout``;
    * with ``--gather``, each design again through the engine's per-query gather instead of
      its tiles (``phasemech.attention.tiles``): the same outputs, the engine before the tiles.
      ``--no-tl`` skips the (slow) TransformerLens reference.

Per variant: ``forward_s`` (median of ``--repeats`` forwards; rounds rotate the order so load
drift hits every variant alike), ``attn_s`` (time inside the attention modules, summed over
layers, median), ``outside_s`` (the rest: for ``hf`` the floor no attention can go below),
``attn_mib`` (peak extra resident memory of one attention module, layer 2: RSS high-water mark
reset in its pre-hook with ``/proc/self/clear_refs``, read in its post-hook) and
``forward_mib`` (the same over a whole forward). Ratios are against ``hf`` in the same run.

The goal (issue 34), printed per T as GOAL lines: at T = 4096 a design's forward <= 0.8x
``hf``, its attention <= 0.3x ``hf``'s and its attention peak <= ``hf``'s; at T = 1024 its
forward <= 1.0x.

Usage: ``python bench/selection.py [--seq-lens 1024 2048 4096] [--repeats 3] [--threads 1]``;
``--tiny`` runs a random 2-layer llama with SmolLM2's head shapes (the smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from phasemech.core.config import CompressionConfig
from phasemech.model.fast import linear_layout, use_eval_sdpa
from phasemech.model.transformer import PhaseTransformer

RESULTS = Path(__file__).resolve().parent / "results" / "selection.json"
DESIGNS = ("route", "quest", "kpool", "evict")
GOAL_DESIGNS = ("route", "quest", "kpool")


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

    def __init__(self, attn_modules: list, probe_layer: int = 2) -> None:
        self.attn_s, self.peak_mib, self._t0, self._base = 0.0, None, 0.0, 0
        self.probe = min(probe_layer, len(attn_modules) - 1)
        self.measure_memory = False
        for i, module in enumerate(attn_modules):
            module.register_forward_pre_hook(lambda m, a, i=i: self._pre(i))
            module.register_forward_hook(lambda m, a, o, i=i: self._post(i))

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
    """``(transformers LlamaForCausalLM with SDPA, the same weights as a HookedTransformer)``."""
    from phasemech.model.pretrained import hf_model, hooked_from_hf

    if not tiny:
        hf, tok = hf_model("smollm2-135m")
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=100, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=n_ctx,
        )  # fmt: skip
        hf, tok = LlamaForCausalLM(cfg).eval(), None
    hf.config._attn_implementation = "sdpa"  # the default; said so the baseline is fixed
    return hf, hooked_from_hf(hf, tok, n_ctx=n_ctx)


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention step that attends nothing: the query, in SDPA's output layout."""
    return query.transpose(1, 2), None


def floor_model(hf):
    """``hf`` with every attention step skipped (its projections and RoPE kept)."""
    from transformers import AttentionInterface

    AttentionInterface.register("phasemech_floor", _no_attention)
    floor = copy.deepcopy(hf)
    floor.config._attn_implementation = "phasemech_floor"
    return floor


def variants(hf, base, args) -> dict[str, tuple]:
    """``name -> (forward callable, attention modules)``."""
    stop = base.cfg.n_layers
    floor = floor_model(hf)
    sdpa = copy.deepcopy(base)
    use_eval_sdpa(sdpa)
    linear_layout(sdpa)
    out = {
        "hf": (lambda x: hf.model(input_ids=x, use_cache=False),
               [b.self_attn for b in hf.model.layers]),
        "floor": (lambda x: floor.model(input_ids=x, use_cache=False),
                  [b.self_attn for b in floor.model.layers]),
        "sdpa": (lambda x: sdpa(x, stop_at_layer=stop), [b.attn for b in sdpa.blocks]),
        "tl": (lambda x: base(x, stop_at_layer=stop), [b.attn for b in base.blocks]),
    }  # fmt: skip
    if args.no_tl:
        del out["tl"]
    for design in args.designs:
        extra = {"obs_window": args.obs_window} if design == "evict" else {}
        comp = CompressionConfig(design, stride=args.stride, top_k=args.top_k,
                                 window=args.window, **extra)  # fmt: skip
        model = PhaseTransformer.from_hooked(base, comp).eval()
        linear_layout(model)
        out[design] = (lambda x, m=model: m(x, stop_at_layer=stop), [b.attn for b in model.blocks])
        if args.gather and design != "mean":  # the engine's per-query gather, for before/after
            gathered = copy.deepcopy(model)
            for b in gathered.blocks:
                b.attn.tiled = False
            out[f"{design}/gather"] = (lambda x, m=gathered: m(x, stop_at_layer=stop),
                                       [b.attn for b in gathered.blocks])  # fmt: skip
    return out


@torch.inference_mode()
def measure(models: dict, seq: int, repeats: int, vocab: int) -> dict[str, dict]:
    x = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    meters = {name: Meter(mods) for name, (_, mods) in models.items()}
    times: dict[str, list] = {n: [] for n in models}
    attn: dict[str, list] = {n: [] for n in models}
    names = list(models)
    for name in names:  # warm-up
        models[name][0](x)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            meters[name].attn_s = 0.0
            t0 = time.perf_counter()
            models[name][0](x)
            times[name].append(time.perf_counter() - t0)
            attn[name].append(meters[name].attn_s)
    out = {}
    for name in names:
        meters[name].measure_memory = True
        _reset_hwm()
        base = _status_kib("VmRSS")
        models[name][0](x)
        forward_mib = (_status_kib("VmHWM") - base) / 1024
        meters[name].measure_memory = False
        fwd, att = statistics.median(times[name]), statistics.median(attn[name])
        out[name] = dict(forward_s=fwd, attn_s=att, outside_s=fwd - att,
                         attn_mib=meters[name].peak_mib, forward_mib=forward_mib)  # fmt: skip
    return out


def goal_lines(rows: list[dict], seq: int) -> list[str]:
    """The issue's goal at this T, per design, as measured (nothing for other lengths)."""
    lines = []
    for r in (r for r in rows if r["T"] == seq and r["variant"] in GOAL_DESIGNS):
        if seq == 4096:
            checks = [("forward", r["forward_s_ratio"], 0.8), ("attention", r["attn_s_ratio"], 0.3),
                      ("attention peak", r["attn_mib_ratio"], 1.0)]  # fmt: skip
        elif seq == 1024:
            checks = [("forward", r["forward_s_ratio"], 1.0)]
        else:
            continue
        parts = [f"{n} {v:.2f}x <= {g}x {'met' if v <= g else 'MISSED'}" for n, v, g in checks]
        lines.append(f"GOAL T={seq} {r['variant']}: " + "; ".join(parts))
    return lines


def _row(seq: int, name: str, r: dict, ref: dict) -> dict:
    row = dict(T=seq, variant=name, **r)
    for key in ("forward_s", "attn_s", "attn_mib", "forward_mib"):
        row[f"{key}_ratio"] = r[key] / ref[key] if ref[key] else None
    print(f"T={seq:5d} {name:>6s} forward {r['forward_s']:7.2f}s ({row['forward_s_ratio']:.2f}x)"
          f"  attention {r['attn_s']:7.2f}s ({row['attn_s_ratio']:.2f}x)  outside "
          f"{r['outside_s']:6.2f}s  attention peak {r['attn_mib']:7.1f} MiB "
          f"({row['attn_mib_ratio'] or 0:.2f}x)  forward peak {r['forward_mib']:7.1f} MiB",
          flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS + ("mean",))
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--obs-window", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-tl", action="store_true", help="skip TransformerLens' dense reference")
    p.add_argument("--gather", action="store_true",
                   help="also each design through the per-query gather (no tiles)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a random 2-layer llama (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    hf, base = load(args.tiny, max(args.seq_lens))
    models = variants(hf, base, args)
    rows = []
    for seq in sorted(args.seq_lens):
        res = measure(models, seq, args.repeats, base.cfg.d_vocab)
        rows += [_row(seq, name, r, res["hf"]) for name, r in res.items()]
        print("\n".join(goal_lines(rows, seq)), flush=True)
    meta = dict(vars(args), out=str(args.out), wall_s=time.perf_counter() - t_start,
                torch=torch.__version__, threads=torch.get_num_threads())  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    os.replace(tmp, args.out)  # atomic: a killed run leaves the last complete file
    print(f"results written to {args.out} ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
