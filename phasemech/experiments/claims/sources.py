"""What the claims report reads: the figures run's tables and links
(:class:`Sources`) and the recorded results (``Sources.results``: ``analyses/results/``), and
the helpers every section formats them with.

Axes: rows of the figures run's per-phase table are (design x stride x heads x T x grid x
phase); a model row (:func:`model_rows`) is one model on its own grid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

#: the paper's largest gap: "accuracy swings by up to 40 percentage points across phases"
CLAIM_GAP_PP = 40
#: the level every verdict's test is read at
ALPHA = 0.05

# ------------------------------------------------------------------------ reading result files


def load_json(path: Path) -> dict | None:
    """The parsed JSON file at ``path``, or ``None`` where nothing is recorded there."""
    return json.loads(path.read_text()) if path.is_file() else None


def pp(x: float) -> str:
    return f"{100 * x:.1f} pp"


def f3(x: float) -> str:
    return "nan" if x is None or not np.isfinite(x) else f"{x:.3f}"


@dataclass
class Sources:
    # make figures' per-phase table (phasemech.measure.stats.per_phase rows) and model panels
    # (experiments.showcase.panels.model_panel); None: a report from the recorded results alone
    table: pd.DataFrame | None
    panels: list[dict] | None
    figures: dict[str, str]  # figure name -> link relative to the report
    theory: dict  # phasemech.theory.dynamics.predictions()
    command: str  # the command that made the table and panels
    results: Path  # the recorded results (analyses/results/)


def not_measured(what: str, command: str) -> str:
    """The line standing in for a result not recorded yet, with the command that makes it."""
    return f"*Not measured yet*: `{what}` is missing; run `{command}`."


def figures_run_note(src: Sources) -> str:
    """Why the ``make figures`` run's own default models are not what a verdict reads."""
    made = (
        f"this report's run (`{src.command}`)"
        if src.table is not None
        else "a `make figures` run (this report was written from the recorded results alone)"
    )
    return (
        f"The default models of {made} stop on or near the loss plateau; their numbers vary "
        "by machine (float drift across CPUs on a plateau; two runs on one machine are "
        "bit-identical), so no verdict reads them (`analyses/results/figures_default.json` "
        "records one run's captions)."
    )


def holm_floor(n_tests: int, n_perm: int) -> float:
    """The smallest Holm-corrected p a family of ``n_tests`` permutation tests of ``n_perm``
    permutations each can reach: ``n_tests`` times the smallest raw p, ``1 / (n_perm + 1)``
    (Bonferroni's floor too: Holm's step for the smallest p is Bonferroni's)."""
    if n_tests < 1 or n_perm < 1:
        raise ValueError(
            f"holm_floor: n_tests={n_tests!r}, n_perm={n_perm!r} are invalid: both must be >= 1"
        )
    return min(1.0, n_tests / (n_perm + 1))


def figure_line(src: Sources, *names: str) -> str:
    """The ``Figure:`` line linking the named figures that the figures run drew."""
    links = [f"[{n}]({src.figures[n]})" for n in names if n in src.figures]
    return "Figure: " + (", ".join(links) if links else "(not drawn in this run)")


def model_rows(src: Sources) -> pd.DataFrame:
    """One row per model of the figures run on its own grid: acc, weakest phase, gap, CI."""
    if src.table is None:
        raise ValueError("model_rows: this report has no figures run's table (table=None)")
    t = src.table[src.table["grid"] == src.table["stride"]]
    rows = []
    for (design, d, h, T), g in t.groupby(["design", "stride", "heads", "seq_len"]):
        g = g.sort_values("phase")
        weak = g.loc[g["accuracy"].idxmin()]
        rows.append(
            {
                "model": f"{design} d={d} H={h} T={T}",
                "design": design,
                "accuracy": float(g["overall"].iloc[0]),
                "weak_phase": int(weak["phase"]),
                "weak_accuracy": float(weak["accuracy"]),
                "gap": float(g["debiased_gap"].iloc[0]),
                "lo": float(g["gap_lo"].iloc[0]),
                "hi": float(g["gap_hi"].iloc[0]),
            }
        )
    return pd.DataFrame(rows).sort_values("gap", ascending=False)


__all__ = [
    "ALPHA",
    "CLAIM_GAP_PP",
    "Sources",
    "f3",
    "figure_line",
    "figures_run_note",
    "holm_floor",
    "load_json",
    "model_rows",
    "not_measured",
    "pp",
]
