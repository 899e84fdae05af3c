"""Training curves: metrics along training steps, one line per run.

Axes: ``step``. Inputs are metric rows (``metrics.jsonl``) or frames of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.colors as pcolors
import plotly.graph_objects as go

from phasemech.viz.style import (
    COLUMN_WIDTH,
    PHASE_SCALE,
    apply_template,
    check_stride,
)


def _metric_rows(where: str, metrics: Any) -> list[Mapping[str, Any]]:
    """The evaluation rows of ``metrics`` (the ``"done"`` line dropped), by step."""
    if isinstance(metrics, pd.DataFrame):
        rows = metrics.to_dict("records")
    elif isinstance(metrics, Sequence) and not isinstance(metrics, str):
        rows = list(metrics)
    else:
        raise ValueError(f"{where}: metrics is a {type(metrics).__name__}: expected rows or frame")
    for r in rows:
        if not isinstance(r, Mapping):
            raise ValueError(f"{where}: metrics row {r!r} is not a dict")
    rows = [r for r in rows if r.get("event") != "done"]
    for key in ("step", "accuracy_by_phase", "accuracy"):
        if not rows or not all(key in r for r in rows):
            raise ValueError(f"{where}: metrics rows lack key {key!r}")
    return sorted(rows, key=lambda r: r["step"])


def _accuracy_by_phase(where: str, rows: list[Mapping[str, Any]], d: int) -> np.ndarray:
    """``[step, phase]`` accuracies; a missing value (``None``) is NaN: a gap in its line."""
    by = []
    for r in rows:
        v = r["accuracy_by_phase"]
        if len(v) != d:
            raise ValueError(
                f"{where}: accuracy_by_phase at step {r['step']} has {len(v)} values, "
                f"not stride={d}"
            )
        by.append([math.nan if x is None else float(x) for x in v])
    return np.array(by, dtype=float)


def training_dynamics(
    metrics: Sequence[Mapping[str, Any]] | pd.DataFrame,
    stride: int,
    title: str | None = None,
    width: int = COLUMN_WIDTH,
    height: int = 340,
) -> go.Figure:
    """Held-out accuracy per needle phase over training steps.

    ``metrics``: :func:`phasemech.training.checkpoints.read_metrics` rows (or a frame of them) with
    ``step``, ``accuracy_by_phase`` (a list of ``stride`` values) and ``accuracy``; rows without
    ``accuracy_by_phase`` (e.g. the ``"done"`` line) are skipped. Traces: one line per phase
    (colours from :data:`PHASE_SCALE`, phase order), then the overall accuracy as a thick dark
    line.
    """
    where = "training_dynamics"
    d = check_stride(where, stride)
    rows = _metric_rows(where, metrics)
    steps = np.array([r["step"] for r in rows])
    acc = _accuracy_by_phase(where, rows, d)
    colors = pcolors.sample_colorscale(PHASE_SCALE, [p / max(1, d - 1) for p in range(d)])
    fig = go.Figure()
    for p in range(d):
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=acc[:, p],
                mode="lines",
                name=f"phase {p}",
                line=dict(color=colors[p], width=1.5),
                hovertemplate=f"phase {p}<br>step %{{x}}<br>accuracy %{{y:.3f}}<extra></extra>",
            )
        )
    overall = [math.nan if r["accuracy"] is None else float(r["accuracy"]) for r in rows]
    fig.add_trace(
        go.Scatter(
            x=steps,
            y=overall,
            mode="lines",
            name="overall",
            line=dict(color="#111111", width=4),
            hovertemplate="overall<br>step %{x}<br>accuracy %{y:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="training step")
    fig.update_yaxes(title_text="held-out accuracy")
    return apply_template(fig, width, height, title or f"Accuracy by phase during training (d={d})")
