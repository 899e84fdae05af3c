"""The head-attention experiment's tables over seeds, its
two heatmaps and its ``summary.md``.

Axes: ``layer, head, phase``; ``seed`` rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write
from phasemech.experiments.experiment import Done
from phasemech.experiments.head_attention.jobs import CopyTaskJob

#: the result's tables, each written as ``<name>.parquet`` with a ``seed`` column
TABLES = ("phase_attention_mean", "phase_attention_needle", "copy_accuracy", "train_loss")


def tables(done: Done) -> dict[str, pd.DataFrame]:
    """Every table of :data:`TABLES` over the seeds (a ``seed`` column)."""
    runs = done.of(CopyTaskJob)
    return {
        name: pd.concat(
            [pd.DataFrame(r[name]).assign(seed=j.seed) for j, r in runs], ignore_index=True
        )
        for name in TABLES
    }


def over_seeds(frame: pd.DataFrame) -> pd.DataFrame:
    """A phase-attention table averaged over seeds (``n`` summed): one heatmap cell per
    (layer, head, phase), as ``head_phase_heatmap`` expects; one seed is left as it is."""
    keys = ["layer", "head", "phase", "exact", "kind"]
    return frame.groupby(keys, as_index=False).agg(mass=("mass", "mean"), n=("n", "sum"))


def write_figures(mean: pd.DataFrame, needle: pd.DataFrame, stride: int, out: Path) -> list[str]:
    """The old script's two heatmaps, self-contained HTML, into the experiment folder (not
    ``figures/``, where a ``make figures`` figure has the first one's name)."""
    from phasemech.viz import head_phase_heatmap

    names = {layer: f"layer {layer} (gated, d={stride})" for layer in sorted(mean["layer"])}
    figures = {
        "head_phase_attention.html": (mean, "Attention mass by source phase, mean over queries"),
        "head_phase_needle.html": (needle, "Attention from answer to needle, by needle phase"),
    }
    for name, (frame, title) in figures.items():
        fig = head_phase_heatmap(over_seeds(frame), title=title, layer_names=names)
        atomic_write(out / name, lambda tmp, fig=fig: fig.write_html(tmp, include_plotlyjs=True))
    return list(figures)


def accuracy_by_phase(acc: pd.DataFrame) -> dict[int, float]:
    """Copy accuracy per needle phase, pooled over seeds (correct / n)."""
    pooled = acc.groupby("phase")[["correct", "n"]].sum()
    return {int(p): float(r.correct / r.n) for p, r in pooled.iterrows()}


def _wide(frame: pd.DataFrame) -> list[str]:
    """A phase-attention table as markdown: rows ``L{layer}H{head}``, columns phases."""
    wide = over_seeds(frame).pivot_table(
        index=["layer", "head"], columns="phase", values="mass", sort=True, dropna=False
    )
    lines = [
        "| head | " + " | ".join(f"phase {c}" for c in wide.columns) + " |",
        "|---|" + "---|" * len(wide.columns),
    ]
    for (layer, head), row in wide.iterrows():
        cells = " | ".join("" if np.isnan(v) else f"{v:.3f}" for v in row)
        lines.append(f"| L{layer}H{head} | {cells} |")
    return lines


def summary_markdown(t: dict[str, pd.DataFrame], summary: dict[str, Any]) -> str:
    """``summary.md``: copy accuracy by needle phase, then both attention tables."""
    pr = summary["profile"]
    by_phase = summary["copy_accuracy_by_needle_phase"]
    lines = [
        f"# Head attention by source phase: copy task, gated d = {pr['stride']}",
        "",
        f"2-layer attention-only model, both layers gated (d = {pr['stride']}, W = "
        f"{pr['window']}, {pr['heads']} heads), trained {pr['steps']} steps (batch "
        f"{pr['batch']}) on a random sequence of P = {pr['half']} tokens repeated once; "
        f"measured on {pr['eval_sequences']} fresh sequences, seeds {pr['seeds']} (tables: "
        "mean over seeds).",
        "",
        f"Copy accuracy {summary['copy_accuracy']:.3f}; by needle phase: "
        + ", ".join(f"{p}: {a:.3f}" for p, a in by_phase.items())
        + "; final training loss (mean of the last 20 steps): "
        + ", ".join(f"seed {m['seed']}: {m['final_loss']:.3f}" for m in summary["models"]),
        "",
        "## Attention mass by source phase, mean over the second copy's queries",
        "",
        "Each row sums to 1; 1/d is no phase preference.",
        "",
        *_wide(t["phase_attention_mean"]),
        "",
        "## Attention from answer to needle, by needle phase",
        "",
        *_wide(t["phase_attention_needle"]),
        "",
        f"Figures: {', '.join(summary['figures'])}.",
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "TABLES",
    "accuracy_by_phase",
    "over_seeds",
    "summary_markdown",
    "tables",
    "write_figures",
]
