"""The selecting engine's attention step on one real SmolLM2-135M layer: tiles against the
per-query gather, side by side (one thread, CPU; random tokens as in ``bench/selection.py``).

Prints the median time of ``attend`` (block scores, ranking and attention, no projections)
with ``tiled`` on and off, the key-list size the tiles used (blocks per tile's union), and the
largest difference of the two paths' outputs in float64 (equal up to rounding, on real data).

Usage: ``python bench/selection_tiles.py [--seq 4096] [--design route] [--layer 5] [--rows 8]``
(``--rows N``: then the tiles' top N operators by self CPU time).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from selection import load
from selection_profile import median_s, print_ops


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    import phasemech.attention.tiles as tiles
    from phasemech import CompressionConfig, PhaseTransformer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--design", default="route")
    p.add_argument("--layer", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=0, help="then profile the tiles: top operators")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    _, base = load(False, args.seq)
    comp = CompressionConfig(args.design, stride=4, top_k=8, window=16)
    model = PhaseTransformer.from_hooked(base, comp).eval()
    gen = torch.Generator().manual_seed(args.seq)  # bench/selection.py's tokens
    x = torch.randint(0, base.cfg.d_vocab, (1, args.seq), generator=gen)
    names = [f"blocks.{args.layer}.attn.hook_{n}" for n in ("rot_q", "rot_k", "v", "grid_offset")]
    _, cache = model.run_with_cache(x, names_filter=names, stop_at_layer=args.layer + 1)
    attn = model.blocks[args.layer].attn
    q, k, v = (cache[n] for n in names[:3])
    geo = attn._geometry(cache[names[3]], args.seq, None)
    unions, union = [], tiles._union
    tiles._union = lambda *a: (out := union(*a), unions.append(out[0].shape[-1]))[0]
    times, zs, q64, k64, v64 = {}, {}, q.double(), k.double(), v.double()
    for attn.tiled in (True, False):
        times[attn.tiled] = median_s(lambda: attn.attend(None, q, k, v, geo), args.repeats)
        # the same step in float64, where rounding cannot flip a near-tied pick
        zs[attn.tiled] = attn.attend(None, q64, k64, v64, geo)[0]
    gap = float((zs[True] - zs[False]).abs().max())
    t, g = times[True] * 1e3, times[False] * 1e3
    print(f"{args.design} layer {args.layer}, T={args.seq}: tiles {t:.0f} ms, gather {g:.0f} ms "
          f"({t / g:.2f}x); union per chunk: median {statistics.median(unions)} blocks, "
          f"max {max(unions)}; float64 max |tiles - gather| {gap:.1e}")  # fmt: skip
    if args.rows:
        attn.tiled = True
        print_ops(lambda: attn.attend(None, q, k, v, geo), f"{args.design} (tiles)", args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
