"""The theory-vs-trained experiment's ``summary.md`` (the numbers are in ``results.parquet``
and ``summary.json``).

Axes: ``phase`` columns; one row per trained model.
"""

from __future__ import annotations

import pandas as pd

from phasemech.experiments.experiment import Profile
from phasemech.measure.learning import PLATEAU_EXIT


def summary_markdown(results: pd.DataFrame, p: Profile, pooled: dict) -> str:
    """The theory-vs-trained ``summary.md``: one row per model, then the pooled rank test."""
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
        "| H | seed | step | acc | acc by phase | effective weight per head: max (phase) | bias "
        "alone: max | theory acc from W | Spearman (p) | weak obs / pred | covered (W>=0.5 / "
        "acc>=0.9) | specialised heads, phases served | theory from scratch: covered, served |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.itertuples():
        heads = ", ".join(f"{m:.2f} ({a})" for m, a in zip(r.max_weight, r.assignment, strict=True))
        lines.append(
            f"| {r.heads} | {r.seed} | {r.step} | {r.accuracy:.3f} | "
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
    return "\n".join(lines) + "\n"


__all__ = ["summary_markdown"]
