"""Where a selecting design's attention layer spends its time: one SmolLM2-shaped layer
(d_model 576, 9 query heads over 3 KV heads of 64, rotary; random weights), one thread.

Prints the layer's wall time beside ``transformers``' ``LlamaAttention`` (SDPA) on the same
input, then the design's operators by self CPU time (``torch.profiler``), grouped by name.

Usage: ``python bench/selection_profile.py [--seq 4096] [--design route] [--rows 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def layers(seq: int, design: str, top_k: int, window: int):
    """``(transformers LlamaAttention, its rotary, the design's compressed layer)``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from phasemech import CompressionConfig, PhaseTransformer
    from phasemech.model.pretrained import hooked_from_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=seq,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(cfg).eval()
    base = hooked_from_hf(hf, None, n_ctx=seq)
    comp = CompressionConfig(design, stride=4, top_k=top_k, window=window)
    ours = PhaseTransformer.from_hooked(base, comp).eval().blocks[0].attn
    return hf.model.layers[0].self_attn, LlamaRotaryEmbedding(cfg), ours


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--design", default="route")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    hf_attn, rope, ours = layers(args.seq, args.design, args.top_k, args.window)
    x = torch.randn(1, args.seq, 576)
    pos = torch.arange(args.seq)[None]
    emb = rope(x, pos)

    def run_hf():
        return hf_attn(x, position_embeddings=emb, attention_mask=None)

    def run_ours():
        return ours(x, x, x)

    run_hf(), run_ours()  # warm-up
    t_hf, t_ours = median_s(run_hf, args.repeats), median_s(run_ours, args.repeats)
    print(f"T={args.seq} transformers LlamaAttention (SDPA) {t_hf * 1e3:.0f} ms; "
          f"{args.design} {t_ours * 1e3:.0f} ms ({t_ours / t_hf:.2f}x)")  # fmt: skip
    print_ops(run_ours, args.design, args.rows)
    return 0


def print_ops(fn, name: str, rows: int) -> None:
    """One call of ``fn`` under ``torch.profiler``: its operators by self CPU time."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{name}: self CPU time by operator (total {total / 1e3:.0f} ms)")
    for e in events[:rows]:
        share = e.self_cpu_time_total / total
        print(f"  {e.key:28s} {e.self_cpu_time_total / 1e3:8.1f} ms {share:6.1%}  x{e.count}")


if __name__ == "__main__":
    raise SystemExit(main())
