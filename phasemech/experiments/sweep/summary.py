"""The phase sweep's ``summary.md``: its results tables as markdown for a reader (the numbers
themselves are in ``results.parquet`` and ``summary.json``).

Axes: ``phase`` columns of per-phase accuracy; rows design x stride x heads x T (x seed).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phasemech.core.config import DESIGNS
from phasemech.experiments.experiment import Profile


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


def summary_markdown(
    title: str,
    results: pd.DataFrame,
    curve: pd.DataFrame,
    seconds: float | None,
    p: Profile,
    n_models: int,
) -> str:
    """The sweep's ``summary.md``: pooled tables (all targets, and those beyond the raw window),
    per seed, along the training budget, and at matched held-out accuracy."""
    fin = results[(results["step"] == "final") & (results["seed"] == "pooled")]
    far, fin = fin[fin["targets"] == "far"], fin[fin["targets"] == "all"]
    timing = (
        f"Training took {seconds / 60:.1f} worker-minutes for {n_models} models (the sum "
        "over jobs; the launcher runs them in parallel)."
        if seconds is not None
        else f"{n_models} models."
    )
    lines = [
        f"# Phase sweep ({title})",
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
    lines += _budget_table(results) + _matched_table(curve)
    return "\n".join(lines) + "\n"


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


BAND_LABELS = ["<0.3", "0.3-0.6", "0.6-0.9", "0.9-0.99", ">=0.99"]


def matched_gaps(
    curve: pd.DataFrame, by: tuple[str, ...] = ("design", "stride", "heads", "seq_len")
) -> pd.DataFrame:
    """Held-out raw gap by accuracy band: one row per (``by`` columns, band) with the mean gap
    over every evaluation of every seed in that band (``n`` evaluations)."""
    if not len(curve):
        return pd.DataFrame()
    c = curve.assign(band=pd.cut(curve["accuracy"], ACC_BINS, labels=BAND_LABELS, right=False))
    keys = [*by, "band"]
    out = c.groupby(keys, observed=True)["raw_gap"].agg(["mean", "count"]).reset_index()
    out["band"] = out["band"].astype(str)
    return out.rename(columns={"mean": "raw_gap", "count": "n"})


def _matched_table(curve: pd.DataFrame) -> list[str]:
    """Held-out raw gap along training, binned by held-out accuracy: designs vs dense."""
    lines = [
        "",
        "## Matched accuracy: held-out raw gap by accuracy band (mean over evaluations, n)",
        "",
        "Every evaluation (each 100 steps, 512 held-out sequences) of every seed, binned by "
        "its accuracy: compare each design with the dense row at the same accuracy.",
        "",
        "| design | d | heads | T | " + " | ".join(BAND_LABELS) + " |",
        "|---|---|---|---|" + "---|" * len(BAND_LABELS),
    ]
    keys = ["seq_len", "stride", "heads", "design"]
    order = {d: i for i, d in enumerate(DESIGNS)}
    groups = sorted(
        matched_gaps(curve).groupby(keys),
        key=lambda kv: (*kv[0][:3], order.get(kv[0][3], 9)),
    )
    for (seq_len, stride, heads, design), g in groups:
        at = g.set_index("band")
        cells = [
            f"{at.loc[b, 'raw_gap']:.3f} ({at.loc[b, 'n']})" if b in at.index else ""
            for b in BAND_LABELS
        ]
        lines.append(f"| {design} | {stride} | {heads} | {seq_len} | " + " | ".join(cells) + " |")
    return lines


def convergence_markdown(conv: pd.DataFrame, search: pd.DataFrame) -> str:
    """The convergence table (setting x seed at the chosen rate) and the learning-rate search."""
    if not len(conv):
        return ""
    lines = [
        "",
        "## Convergence (chosen learning rate; converged = held-out accuracy reached 0.95)",
        "",
        "| design | d | heads | T | lr | seed | budget | steps to 0.95 | final step | held-out acc "
        "| converged |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ["seq_len", "stride", "heads", "design", "seed"]
    for r in conv.sort_values(keys).itertuples():
        first = "never" if pd.isna(r.steps_to_95) else str(int(r.steps_to_95))
        lines.append(
            f"| {r.design} | {r.stride} | {r.heads} | {r.seq_len} | {r.lr:g} | {r.seed} | "
            f"{r.budget} | {first} | {r.step} | {r.heldout_accuracy:.3f} | "
            f"{'yes' if r.converged else 'NO'} |"
        )
    if search["lr"].nunique() > 1:
        lines += [
            "",
            "## Learning-rate search (search seed; every rate tried)",
            "",
            "| design | d | heads | T | lr | steps to 0.95 | final step | held-out acc | kept |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        first_seed = search.groupby(keys[:4])["seed"].transform("min")
        for r in search[search["seed"] == first_seed].sort_values(keys[:4] + ["lr"]).itertuples():
            first = "never" if pd.isna(r.steps_to_95) else str(int(r.steps_to_95))
            lines.append(
                f"| {r.design} | {r.stride} | {r.heads} | {r.seq_len} | {r.lr:g} | {first} | "
                f"{r.step} | {r.heldout_accuracy:.3f} | {'yes' if r.chosen else ''} |"
            )
    return "\n".join(lines) + "\n"


__all__ = ["convergence_markdown", "matched_gaps", "summary_markdown"]
