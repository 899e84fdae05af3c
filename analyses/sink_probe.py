"""Why grid offsets hurt ``route`` at top-1: which block each head keeps at the answer row.

Axes: ``offset`` (the grid offset of every compressed layer and KV head), ``layer``, ``head``;
one row per (offset, layer, head).

One passkey prompt of the bundled SmolLM2-135M (``--context`` tokens, content 0 at
``--phase``), ``route`` with d = 4, W = 16, top-1 on layers 2-29, run whole (trained regime)
under each ``--offsets``. Per probed layer and head: the block ranked first at the row that
predicts the answer (``hook_route_selected`` less the forced own block), whether that block
holds only token 0 (the attention sink) or the needle, and whether the prompt is answered.
With offset ``o > 0``, block 0 covers ``[o - 4, o - 1]``: token 0 alone, its key undiluted by
a block mean. Prints the table; ``--out FILE.json`` records it.

Usage: ``python analyses/sink_probe.py [--offsets 0 1 2 3] [--layers 5 15 25] [--out F]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.core.io import write_text_atomic
from phasemech.data.retrieval import RetrievalTask, build_retrieval_prompts
from phasemech.model.pretrained import load_pretrained

D, WINDOW = 4, 16


def probe(base, batch, i: int, offset: int, layers: list[int]) -> list[dict]:
    info = batch.frame.iloc[i]
    start, needle = int(info.answer_start), int(info.needle_pos)
    x = batch.tokens[i : i + 1, : start + batch.answer.shape[1] - 1]
    comp = CompressionConfig("route", stride=D, window=WINDOW, top_k=1,
                             layers=tuple(range(2, 30)), offsets=offset)  # fmt: skip
    model = PhaseTransformer.from_hooked(base, comp).eval()
    names = {f"blocks.{layer}.attn.hook_route_scores": layer for layer in layers}
    with torch.inference_mode():
        logits, cache = model.run_with_cache(x, names_filter=lambda n: n in names)
    correct = bool((logits[0, start - 1 :].argmax(-1) == batch.answer[i]).all())
    needle_block = (needle - offset) // D + 1  # block i covers [i*d + o - d, i*d + o - 1]
    rows = []
    for name, layer in names.items():
        top = cache[name][0, :, start - 1].argmax(-1)  # [head]: the ranked pick
        for head, block in enumerate(top.tolist()):
            rows.append(dict(offset=offset, layer=layer, head=head, block=block,
                             sink_alone=offset > 0 and block == 0,
                             needle=block == needle_block, correct=correct))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--offsets", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--layers", type=int, nargs="+", default=[5, 15, 25])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--phase", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = load_pretrained("smollm2-135m", n_ctx=args.context)
    batch = build_retrieval_prompts(base.tokenizer, RetrievalTask(context=args.context), 1, 0)
    rows = [r for o in args.offsets for r in probe(base, batch, args.phase, o, args.layers)]
    df = pd.DataFrame(rows)
    summary = df.groupby(["offset", "layer"]).agg(
        sink_alone=("sink_alone", "sum"), needle=("needle", "sum"), heads=("head", "size"),
        correct=("correct", "first"))  # fmt: skip
    print(summary.to_string())
    if args.out:
        write_text_atomic(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
