"""Head-by-source-phase attention of a small compressed model trained on a copy task.

What it does (a standalone analysis; ``make figures`` draws its own head-phase heatmap):

1. trains (only if ``RUNS/<name>/model.safetensors`` is missing) a 2-layer attention-only
   ``PhaseTransformer`` whose layers use ``gated`` compression (stride 4, raw window 8) on a
   repeated-random-sequence task: tokens ``x_0..x_{P-1}`` followed by the same ``P`` tokens.
   Predicting the second copy needs the token after the previous occurrence, ``P`` positions
   back: far outside the raw window, so it must be read through compressed blocks;
2. measures attention mass per (layer, head, source phase), averaged over queries and from each
   answer position onto its needle (the source token, ``P - 1`` back), and the copy accuracy by
   needle phase;
3. writes ``figures/head_phase_attention.html`` (query mean) and
   ``figures/head_phase_needle.html`` (answer -> needle), and the numbers as parquet + JSON
   under the run folder.

Profiles: default (about a minute on one CPU thread), ``--full`` (longer training, more
evaluation sequences), ``--tiny`` (seconds; used by the end-to-end test).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from phasemech import (
    CompressionConfig,
    PhaseTransformer,
    PhaseTransformerConfig,
    phase_attention,
    phase_of,
)
from phasemech.viz import head_phase_heatmap

console = Console()


@dataclass(frozen=True)
class Profile:
    steps: int
    batch: int
    eval_sequences: int
    half: int  # P: length of the random sequence that is then repeated


PROFILES = {
    "tiny": Profile(steps=20, batch=16, eval_sequences=32, half=16),
    "default": Profile(steps=1200, batch=32, eval_sequences=256, half=32),
    "full": Profile(steps=4000, batch=64, eval_sequences=2048, half=32),
}
VOCAB = 64


def copy_batch(gen: torch.Generator, batch: int, half: int) -> torch.Tensor:
    """``[batch, 2*half]``: random tokens, then the same tokens again."""
    first = torch.randint(0, VOCAB, (batch, half), generator=gen)
    return torch.cat([first, first], dim=1)


def build_model(half: int, seed: int) -> PhaseTransformer:
    cfg = PhaseTransformerConfig(
        n_layers=2,
        d_model=64,
        n_heads=4,
        d_head=16,
        n_ctx=2 * half,
        d_vocab=VOCAB,
        attn_only=True,
        act_fn=None,
        normalization_type="LN",
        seed=seed,
        compression=CompressionConfig("gated", stride=4, window=8),
    )
    return PhaseTransformer(cfg)


def copy_loss(model: PhaseTransformer, tokens: torch.Tensor, half: int) -> torch.Tensor:
    """Next-token loss on the predictable part (second copy) only."""
    logits = model(tokens)
    pred = logits[:, half - 1 : -1]
    return torch.nn.functional.cross_entropy(pred.reshape(-1, VOCAB), tokens[:, half:].reshape(-1))


def train(model: PhaseTransformer, prof: Profile, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1e-3, total_steps=prof.steps, pct_start=0.1
    )
    losses = []
    model.train()
    with Progress(
        TextColumn("[bold]train[/] gated d=4"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("train", total=prof.steps, loss=float("nan"))
        for _ in range(prof.steps):
            loss = copy_loss(model, copy_batch(gen, prof.batch, prof.half), prof.half)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]))
    model.eval()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--seed", type=int, default=0)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="paper-quality profile")
    group.add_argument("--tiny", action="store_true", help="seconds; for the end-to-end test")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: faster than two on a busy 2-core box
    name = "full" if args.full else "tiny" if args.tiny else "default"
    prof = PROFILES[name]
    run_dir = args.runs / f"head_phase_{name}_seed{args.seed}"
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    if (run_dir / "model.safetensors").is_file():
        console.print(f"[green]reusing[/] {run_dir}")
        model = PhaseTransformer.load(run_dir)
    else:
        torch.manual_seed(args.seed)
        model = build_model(prof.half, args.seed)
        losses = train(model, prof, args.seed)
        model.save(run_dir)
        (run_dir / "train_loss.json").write_text(json.dumps(losses))
    model.eval()

    console.print("[bold]measure[/] attention mass by source phase")
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    tokens = copy_batch(gen, prof.eval_sequences, prof.half)
    stride = model.cfg.compression.stride
    # queries of the second copy only: early queries see few tokens and favour phase 0
    mean_pa = phase_attention(model, tokens, query_pos=list(range(prof.half, 2 * prof.half)))
    # answer -> needle: query at P + i predicts token i + 1, which sits at source i + 1
    i = torch.arange(0, prof.half - 1)
    query = (prof.half + i).expand(len(tokens), -1)
    needle = (i + 1).expand(len(tokens), -1)
    pair_pa = phase_attention(model, tokens, query_pos=query, key_pos=needle)

    with torch.no_grad():
        logits = model(tokens)
    correct = logits[:, prof.half + i].argmax(-1) == tokens[:, i + 1]
    phases = phase_of(i + 1, stride)
    acc = {int(p): float(correct[:, phases == p].float().mean()) for p in range(stride)}

    mean_pa.frame.to_parquet(run_dir / "phase_attention_mean.parquet")
    pair_pa.frame.to_parquet(run_dir / "phase_attention_needle.parquet")
    summary = {
        "profile": name,
        "copy_accuracy": float(correct.float().mean()),
        "copy_accuracy_by_needle_phase": acc,
        "eval_sequences": prof.eval_sequences,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    layer_names = {0: "layer 0 (gated, d=4)", 1: "layer 1 (gated, d=4)"}
    fig = head_phase_heatmap(
        mean_pa,
        title="Attention mass by source phase, mean over queries",
        layer_names=layer_names,
    )
    fig.write_html(args.out / "head_phase_attention.html", include_plotlyjs=True)
    fig = head_phase_heatmap(
        pair_pa,
        title="Attention from answer to needle, by needle phase",
        layer_names=layer_names,
    )
    fig.write_html(args.out / "head_phase_needle.html", include_plotlyjs=True)

    console.print(mean_pa.table().round(3).to_string())
    console.print("answer -> needle mass:")
    console.print(pair_pa.table().round(3).to_string())
    console.print(
        f"copy accuracy {summary['copy_accuracy']:.3f}; by needle phase "
        + ", ".join(f"{p}: {a:.3f}" for p, a in acc.items())
    )
    console.print(
        f"wrote {args.out}/head_phase_attention.html, head_phase_needle.html "
        f"in {time.perf_counter() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
