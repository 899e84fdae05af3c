"""The theory-vs-trained experiment's ``summary.md`` (the numbers are in ``results.parquet``
and ``summary.json``).

Axes: ``phase`` columns; one row per trained model.
"""

from __future__ import annotations

import pandas as pd

from phasemech.experiments.experiment import Profile
from phasemech.measure.learning import PLATEAU_EXIT


def summary_markdown(
    results: pd.DataFrame, p: Profile, pooled: dict, search: pd.DataFrame | None = None
) -> str:
    """The theory-vs-trained ``summary.md``: one row per model, the pooled rank test, then
    every run of the learning-rate search (when the profile has one)."""
    d, seq_len = p.strides[0], p.seq_lens[0]
    at = p.get("min_accuracy", PLATEAU_EXIT)
    word = "converged" if at > PLATEAU_EXIT else "left the loss plateau"
    lines = [
        f"# Theory vs trained gated models (d = {d}, T = {seq_len}, N = {seq_len // d} windows)",
        "",
        "Effective weight: mean share of a gated head's pooled entry that is the target, by "
        f"the target's phase ({p.get('weight_sequences')} held-out sequences); accuracy on "
        f"{p.test_sequences} phase-balanced sequences (acc: all targets; by phase: targets "
        "beyond the raw window, read only through blocks). Theory: alpha 8, beta 8, V 64.",
        "",
        "| H | seed | lr | step | acc | acc by phase | effective weight per head: max (phase) | "
        "bias alone: max | theory acc from W | Spearman (p) | weak obs / pred | covered (W>=0.5 / "
        "acc>=0.9) | specialised heads, phases served | theory from scratch: covered, served |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.itertuples():
        heads = ", ".join(f"{m:.2f} ({a})" for m, a in zip(r.max_weight, r.assignment, strict=True))
        lines.append(
            f"| {r.heads} | {r.seed} | {getattr(r, 'lr', float('nan')):g} | {r.step} | "
            f"{r.accuracy:.3f} | "
            f"{' '.join(f'{x:.3f}' for x in r.acc_by_phase)} | {heads} | "
            f"{max(r.bias_max_weight):.2f} | "
            f"{' '.join(f'{x:.2f}' for x in r.predicted_accuracy)} | "
            f"{r.spearman:.2f} ({r.spearman_p:.2g}) | {r.weak_observed} / {r.weak_predicted} | "
            f"{r.covered_weight} / {r.covered_accuracy} | "
            f"{r.specialised_heads}, {r.served_phases} | "
            f"{r.theory_covered}, {r.theory_served} |"
        )
    lines += [
        "",
        f"Pooled rank test over the models that {word} (accuracy >= {at}; "
        f"{int(results['learned'].sum())} of {len(results)}; mean Spearman over models; "
        "null: phases permuted within each model): "
        + "; ".join(
            f"{k}: {v['mean_spearman']:.2f}, p {v['p']:.2g} ({v['n_models']} models)"
            if v["n_models"]
            else f"{k}: no model {word}"
            for k, v in pooled.items()
        ),
    ]
    if search is not None and len(search) and p.get("lrs"):
        lines += ["", *search_lines(search)]
    return "\n".join(lines) + "\n"


def search_lines(search: pd.DataFrame) -> list[str]:
    """Every run of the search: H, seed, rate, steps to 0.95 (or never), held-out accuracy at
    the end, and whether the rate is the one kept for that H."""
    lines = [
        "## Learning-rate search (seed 0 of each H at every rate; the kept rate trains the "
        "other seeds)",
        "",
        "| H | seed | lr | budget | steps to 0.95 | held-out acc | kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in search.sort_values(["heads", "seed", "lr"]).itertuples():
        first = "never" if pd.isna(r.steps_to_95) else str(int(r.steps_to_95))
        lines.append(
            f"| {r.heads} | {r.seed} | {r.lr:g} | {r.budget} | {first} | "
            f"{r.heldout_accuracy:.3f} | {'yes' if r.chosen else 'no'} |"
        )
    return lines


__all__ = ["summary_markdown"]
