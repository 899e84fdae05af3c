"""The fixes experiment's ``summary.md``: its tables as markdown for a reader (the numbers are in
``results.parquet``, ``comparison.parquet`` and ``summary.json``).

Axes: ``phase`` columns; rows one per fix (seeds pooled) or per comparison with a baseline.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phasemech.experiments.experiment import Profile
from phasemech.experiments.fixes.profiles import GOAL_REDUCTION, NONINFERIORITY
from phasemech.experiments.sweep.summary import BAND_LABELS
from phasemech.measure.learning import PLATEAU_EXIT, seeds_off_plateau


def _f(x: float, spec: str = ".3f") -> str:
    return "nan" if x is None or not np.isfinite(x) else format(x, spec)


def summary_markdown(
    results: pd.DataFrame, comparison: pd.DataFrame, p: Profile, train_min: float
) -> str:
    """The fixes' ``summary.md``: per fix seeds pooled, and against its baseline."""
    timing = f"Training {train_min:.0f} min summed over the models (1 thread each). "
    threshold = p.get("min_accuracy", PLATEAU_EXIT)
    learned = "converged" if threshold > PLATEAU_EXIT else "off the plateau"
    design, d, heads, seq_len = p.designs[0], p.strides[0], p.heads[0], p.seq_lens[0]
    lines = [
        f"# Fixes for phase weak spots ({design}, d = {d}, {heads} heads, "
        f"T = {seq_len}, {len(p.seeds)} seeds, {p.steps} steps)",
        "",
        f"{timing}Layer 2 compressed ("
        + (
            "layers 2-3 of 3 for the per-layer pair; "
            if "staggered_layer" in p.get("fixes")
            else ""
        )
        + "raw window 2d); "
        "one shared phase-balanced test set of "
        f"{p.test_sequences} sequences (never jittered); phases absolute (pos mod {d}); "
        "seeds pooled (clusters: seed, then content).",
        "",
        "| fix | acc | acc by phase | weakest | debiased gap [95% CI] | null p95 | p (perm) | "
        f"p (paired) | per seed: acc / debiased gap | seeds {learned} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pooled = results[(results["seed"] == "pooled") & (results["targets"] == "all")]
    per = results[results["seed"] != "pooled"]
    for r in pooled.itertuples():
        seeds = per[per["fix"] == r.fix].sort_values("seed")
        seed_cells = ", ".join(
            f"{a:.3f} / {_f(g)}"
            for a, g in zip(seeds["accuracy"], seeds["debiased_gap"], strict=True)
        )
        lines.append(
            f"| {r.fix} | {r.accuracy:.3f} | {' '.join(f'{x:.3f}' for x in r.acc_by_phase)} | "
            f"{r.weak_phase} | {_f(r.debiased_gap)} [{_f(r.debiased_lo)}, {_f(r.debiased_hi)}] "
            f"| {_f(r.null_p95)} | {r.p_perm:.2g} | {r.p_paired:.2g} | {seed_cells} | "
            "{} / {} |".format(*seeds_off_plateau(results, r.fix, threshold))
        )
    lines += [
        "",
        f"## Against the aligned baseline (goal: debiased gap cut by >= {GOAL_REDUCTION:.0%}, "
        "its CI above 0, "
        f"mean accuracy not lower by more than {NONINFERIORITY:.0%} (95% CI), every seed of the "
        f"fix and of its baseline {learned}: test accuracy >= {threshold})",
        "",
        "Paired cluster bootstrap: test contents resampled once for both models, seeds "
        "independently. Far: targets at distance >= 3d - 1 (read only through blocks). "
        f"Off the plateau: held-out accuracy >= {PLATEAU_EXIT} (stuck models sit at 0.20-0.22 "
        "and retrieve nothing, so a small gap there is not a fix).",
        "",
        "| fix | baseline | targets | acc change [95% CI] | gap: baseline -> fix [CI of fix] | "
        "reduction [95% CI] | meets goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in comparison.itertuples():
        lines.append(
            f"| {r.fix} | {r.baseline} | {r.targets} | {r.accuracy_diff:+.3f} "
            f"[{r.accuracy_diff_lo:+.3f}, {r.accuracy_diff_hi:+.3f}] | "
            f"{_f(r.gap_baseline)} -> {_f(r.gap_other)} "
            f"[{_f(r.gap_other_lo)}, {_f(r.gap_other_hi)}] | {_f(r.reduction, '.0%')} "
            f"[{_f(r.reduction_lo, '.0%')}, {_f(r.reduction_hi, '.0%')}] | "
            f"{_meets(r)} |"
        )
    return "\n".join(lines) + "\n"


def _meets(r) -> str:
    if r.meets_goal:
        return "yes"
    # older recorded comparisons carry no baseline_learned column
    learned = getattr(r, "baseline_learned", True)
    return "no (baseline did not learn)" if pd.notna(learned) and not learned else "no"


def convergence_markdown(conv: pd.DataFrame) -> str:
    """Fix x seed: steps to 0.95 held-out accuracy, final step and accuracies."""
    if not len(conv):
        return ""
    lines = [
        "",
        "## Convergence (held-out accuracy every eval step; converged = it reached 0.95)",
        "",
        "| fix | seed | budget | steps to 0.95 | final step | held-out acc | test acc | "
        "seconds | converged |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in conv.sort_values(["fix", "seed"], kind="stable").itertuples():
        first = "never" if pd.isna(r.steps_to_95) else f"{int(r.steps_to_95)}"
        lines.append(
            f"| {r.fix} | {r.seed} | {r.budget} | {first} | {r.step} | {r.heldout_accuracy:.3f} "
            f"| {r.test_accuracy:.3f} | {r.train_seconds:.0f} | {'yes' if r.converged else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def matched_markdown(matched: pd.DataFrame) -> str:
    """Each fix's held-out raw gap beside its baseline's at the same accuracy band."""
    if not len(matched):
        return ""
    lines = [
        "",
        "## At equal accuracy (held-out raw gap by accuracy band, mean over evaluations (n): "
        "fix / its baseline)",
        "",
        "| fix | baseline | " + " | ".join(BAND_LABELS) + " |",
        "|---|---|" + "---|" * len(BAND_LABELS),
    ]
    for fix, g in matched.groupby("fix", sort=False):
        at, base = g.set_index("band"), g["baseline"].iloc[0]
        base = None if pd.isna(base) else base  # a fix without a baseline (parquet: NaN)
        cells = []
        for b in BAND_LABELS:
            if b not in at.index:
                cells.append("")
                continue
            r = at.loc[b]
            mine = f"{r['raw_gap']:.3f} ({r['n']})"
            theirs = "" if pd.isna(r["baseline_raw_gap"]) else f"{r['baseline_raw_gap']:.3f}"
            cells.append(f"{mine} / {theirs or '-'}" if base else mine)
        lines.append(f"| {fix} | {base or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_markdown(budget: pd.DataFrame, every: int = 500) -> str:
    """Each fix beside its baseline at equal training budget (every ``every`` steps)."""
    if not len(budget):
        return ""
    lines = [
        "",
        "## At equal training budget (held-out, mean over seeds: accuracy / raw gap)",
        "",
        "A run that stopped early at its target accuracy keeps its last evaluation.",
        "",
    ]
    steps = sorted(s for s in budget["step"].unique() if s % every == 0)
    lines += ["| fix | " + " | ".join(f"step {s}" for s in steps) + " |"]
    lines += ["|---|" + "---|" * len(steps)]
    for fix, g in budget.groupby("fix", sort=False):
        at = g.set_index("step")
        cells = [
            f"{at.loc[s, 'accuracy']:.3f} / {at.loc[s, 'raw_gap']:.3f}" if s in at.index else ""
            for s in steps
        ]
        lines.append(f"| {fix} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["budget_markdown", "convergence_markdown", "matched_markdown", "summary_markdown"]
