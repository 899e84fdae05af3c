"""Why the phase is weak: each selecting design's choice at the answer row, split into tokens.

Axes: ``design``, ``phase`` (the audit's, on the aligned reference grid), ``prompt``, ``layer``,
``head``, ``role`` (``needle``, ``competitor``: the last kept pick or, where that is the
needle's block, the best block left out; ``sink``: the block holding token 0), ``slot``.

SmolLM2-135M (the bundled model), decode regime, T = 1024, d = 4, W = 16, layers 2-29, the
audit's passkey prompts (``--contents`` contents x 4 phases, through the probe worker's models
and prompts: :func:`phasemech.experiments.explain.jobs.explain_models`), under ``route``
top-1, ``quest`` top-2, ``evict`` top-2 and ``kpool`` top-2. Every prompt is prefilled once by
the null model (its last ``obs_window`` queries kept for ``evict``) and shared by the designs.
Per design and prompt, :func:`phasemech.interventions.decompose.decompose` splits the needle
block's score, the competitor's and the sink's into their tokens' terms (exact: checked
against the design's own score). The needle-reading heads are the ``--top-heads`` (layer,
head) of the compressed layers whose answer row attends most to the needle under the dense
null (mean over every prompt, as explain's ``attend`` step reads it).

Records ``analyses/results/selection_mechanism.{json,md}``: per design and phase, the needle's
and the competitor's score, the oracle's margin, recall, the needle token's term and the rest
of its block's, the competitor's share that is the sink, key norms and terms by slot, over the
needle-reading heads and over every head; and per design a paragraph of what makes its weak
phase weak, its numbers read from these tables.

Usage: ``nice -n 5 python analyses/selection_mechanism.py [--contents 12] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from phasemech.core.io import json_safe, write_text_atomic
from phasemech.experiments.explain.config import ExplainConfig
from phasemech.experiments.explain.jobs import explain_models
from phasemech.experiments.probe.worker import attention_hooks
from phasemech.interventions.decompose import decompose, mechanism_table, slot_table
from phasemech.interventions.prompts import bound, prompt_run, score
from phasemech.model.decode import needed_queries

#: (design, top_k) as the issue names them
SETTINGS = (("route", 1), ("quest", 2), ("evict", 2), ("kpool", 2))
LAYERS = tuple(range(2, 30))


def null_attention(base, run) -> pd.DataFrame:
    """Per (layer, head): the null's attention from the answer row onto the needle."""
    store: dict = {}
    with torch.inference_mode(), bound(base, run):
        with base.hooks(fwd_hooks=attention_hooks(base, run.row, run.needle, store)):
            base(run.tokens, stop_at_layer=base.cfg.n_layers)
    return pd.DataFrame([dict(layer=i, head=h, mass=float(x))
                         for i, m in sorted(store.items()) for h, x in enumerate(m)])  # fmt: skip


def collect(contents: int, context: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(decomposition, answers, null attention)`` of every design on every prompt."""
    cfgs = {d: ExplainConfig.of(design=d, top_k=k, layers=LAYERS, contents=contents,
                                context=context) for d, k in SETTINGS}  # fmt: skip
    models = {}
    for d, cfg in cfgs.items():
        base, models[d], batch = explain_models(cfg)
    keep = max(needed_queries(m) for m in models.values())
    parts, answers, att = [], [], []
    for i in range(len(batch.frame)):
        run = prompt_run(base, batch, i, "decode", keep_queries=keep)
        att.append(null_attention(base, run).assign(**run.meta))
        for d, m in models.items():
            answers.append(dict(design=d, **run.meta, **score(m, run)))
            parts.append(decompose(m, run).assign(design=d, **run.meta))
        print(f"prompt {i + 1}/{len(batch.frame)}", flush=True)
    return pd.concat(parts, ignore_index=True), pd.DataFrame(answers), pd.concat(att)


def markdown(df: pd.DataFrame) -> str:
    """``df`` as a markdown table."""
    rows = [list(df.columns), ["---"] * df.shape[1], *df.astype(str).to_numpy().tolist()]
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in rows)


def paragraph(design: str, k: int, acc: pd.Series, mech: pd.DataFrame) -> str:
    """What makes ``design``'s weak phase weak, every number read from ``mech`` (the
    needle-reading heads' per-phase table) and ``acc`` (accuracy by phase)."""
    weak, strong = int(acc.idxmin()), int(acc.idxmax())
    w, s = mech.loc[weak], mech.loc[strong]
    others = mech.drop(index=weak).mean()
    return (
        f"**{design} top-{k}**: phase {weak} is the weak one (accuracy {acc[weak]:.2f} vs "
        f"{acc[strong]:.2f} at phase {strong}). On the needle-reading heads the needle's block "
        f"is kept in {w.recall:.0%} of (prompt, layer, head) at phase {weak} vs "
        f"{others.recall:.0%} at the other phases; the needle token sits in slot "
        f"{w.needle_slot:.0f} (phase {strong}: slot {s.needle_slot:.0f}) and its term is "
        f"{w.needle_term:.3f} vs {others.needle_term:.3f}, the rest of its block "
        f"{w.rest_term:.3f} vs {others.rest_term:.3f}, so the block scores "
        f"{w.needle_score:.3f} vs {others.needle_score:.3f}; the competitor scores "
        f"{w.competitor_score:.3f} vs {others.competitor_score:.3f} (margin "
        f"{w.margin:.3f} vs {others.margin:.3f}). Where the needle is missed, the block that "
        f"beats it is the sink's in {w.sink_wins:.0%} of cases (other phases "
        f"{others.sink_wins:.0%}); the sink's block outscores the needle's by "
        f"{w.sink_over_needle:.3f} (other phases {others.sink_over_needle:.3f}) and is kept in "
        f"{w.sink_kept:.0%} (other phases {others.sink_kept:.0%})."
    )


def report(df: pd.DataFrame, answers: pd.DataFrame, att: pd.DataFrame, args) -> dict:
    mass = att[att.layer.isin(LAYERS)].groupby(["layer", "head"]).mass.mean()
    top = [tuple(map(int, x)) for x in mass.nlargest(args.top_heads).index]
    out: dict = dict(
        setting=dict(
            model="smollm2-135m",
            regime="decode",
            context=args.context,
            stride=4,
            window=16,
            layers="2-29",
            contents=args.contents,
            prompts=int(answers.prompt_id.nunique()),
        ),  # fmt: skip
        needle_heads=[dict(layer=a, head=b, null_mass=float(mass[a, b])) for a, b in top],
        designs={},
    )
    lines = ["# Why the phase is weak: the selection at the answer row, token by token", "",
             f"SmolLM2-135M, decode, T = {args.context}, d = 4, W = 16, layers 2-29, "
             f"{args.contents} contents x 4 phases. Needle-reading heads (null attention onto "
             "the needle, mean): " + ", ".join(f"{a}.{b} ({mass[a, b]:.2f})" for a, b in top),
             ""]  # fmt: skip
    for d, k in SETTINGS:
        part = df[df.design == d]
        acc = answers[answers.design == d].groupby("phase").correct.mean()
        reading = part.set_index(["layer", "head"]).index.isin(top)
        mech = {"needle_heads": mechanism_table(part[reading]), "all_heads": mechanism_table(part)}
        slots = slot_table(part[reading])
        out["designs"][d] = dict(
            top_k=k, accuracy_by_phase=acc.tolist(),
            **{n: m.reset_index().to_dict("records") for n, m in mech.items()},
            slots_needle_heads=slots.to_dict("records"),
            slots_all_heads=slot_table(part).to_dict("records"),
            paragraph=paragraph(d, k, acc, mech["needle_heads"]),
        )  # fmt: skip
        accs = " / ".join(f"{a:.2f}" for a in acc)
        lines += [f"## {d} top-{k}", "", f"Accuracy by phase: {accs}",
                  "", out["designs"][d]["paragraph"], ""]  # fmt: skip
        for n, m in mech.items():
            lines += [
                f"Per phase, {n.replace('_', ' ')}:",
                "",
                markdown(m.round(3).reset_index()),
                "",
            ]
        lines += ["Needle-reading heads, by role and slot (mean term, q.k, key norm):", "",
                  markdown(slots.round(3)), ""]  # fmt: skip
    lines += [f"Command: `{args.command}`; {args.seconds:.0f} s."]
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "selection_mechanism.md", "\n".join(lines) + "\n")
    write_text_atomic(args.out / "selection_mechanism.json",
                      json.dumps(json_safe(out), indent=1))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contents", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--top-heads", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--cache", type=Path, help="keep the frames here (a rerun reports from them)")
    args = p.parse_args(argv)
    if args.contents < 1 or args.top_heads < 1:
        raise ValueError(f"--contents={args.contents}, --top-heads={args.top_heads} are "
                         "invalid: expected ints >= 1")  # fmt: skip
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    names = ("decomposition", "answers", "attention")
    if args.cache and (args.cache / "attention.parquet").exists():
        df, answers, att = (pd.read_parquet(args.cache / f"{n}.parquet") for n in names)
    else:
        frames = collect(args.contents, args.context)
        if args.cache:
            args.cache.mkdir(parents=True, exist_ok=True)
            for n, f in zip(names, frames, strict=True):
                f.to_parquet(args.cache / f"{n}.parquet")
        df, answers, att = frames
    args.seconds = time.perf_counter() - t0
    args.command = f"nice -n 5 python analyses/selection_mechanism.py --contents {args.contents}"
    out = report(df, answers, att, args)
    for d in out["designs"].values():
        print(d["paragraph"])
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
