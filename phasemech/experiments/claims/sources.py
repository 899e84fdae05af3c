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
    table: pd.DataFrame  # make figures' per-phase table (phasemech.measure.stats.per_phase rows)
    panels: list[dict]  # make figures' model panels (experiments.showcase.panels.model_panel)
    figures: dict[str, str]  # figure name -> link relative to the report
    theory: dict  # phasemech.theory.dynamics.predictions()
    command: str  # the command that made the table and panels
    results: Path  # the recorded results (analyses/results/)


def not_measured(what: str, command: str) -> str:
    """The line standing in for a result not recorded yet, with the command that makes it."""
    return f"*Not measured yet*: `{what}` is missing; run `{command}`."


def figure_line(src: Sources, *names: str) -> str:
    """The ``Figure:`` line linking the named figures that the figures run drew."""
    links = [f"[{n}]({src.figures[n]})" for n in names if n in src.figures]
    return "Figure: " + (", ".join(links) if links else "(not drawn in this run)")


def model_rows(src: Sources) -> pd.DataFrame:
    """One row per model of the figures run on its own grid: acc, weakest phase, gap, CI."""
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


__all__ = ["Sources", "f3", "figure_line", "load_json", "model_rows", "not_measured", "pp"]
