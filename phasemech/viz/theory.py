"""Figures of the theory model: curves along flow time and predicted against measured values.

Axes: ``time`` (flow time) or any two columns of a tidy frame.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from phasemech.theory.dynamics import fmt_num, fmt_time, predictions
from phasemech.viz.style import (
    COLUMN_WIDTH,
    MEAN_DASH,
    apply_template,
    band_style,
    need_columns,
    series_style,
)


def theory_curves(
    frame: pd.DataFrame,
    x: str,
    y: str,
    series: str,
    title: str | None = None,
    band: tuple[str, str] | None = None,
    width: int = COLUMN_WIDTH,
    height: int = 340,
) -> go.Figure:
    """Generic lines: ``y`` against ``x`` (sorted), one line+markers per value of ``series``
    (design styles when the value starts with a design name). ``band=(low, high)`` adds a
    shaded interval trace before each line. Traces: [band,] line per series, in order of
    first appearance.
    """
    where = "theory_curves"
    need = [x, y, series, *(band or ())]
    need_columns(where, "frame", frame, need)
    fig = go.Figure()
    for i, key in enumerate(dict.fromkeys(frame[series])):
        sub = frame[frame[series] == key].sort_values(x)
        label = str(key)
        color, dash, symbol = series_style(label, i)
        xs = sub[x].to_numpy()
        if band is not None:
            lo, hi = sub[band[0]].to_numpy(float), sub[band[1]].to_numpy(float)
            fig.add_trace(
                go.Scatter(
                    x=np.r_[xs, xs[::-1]],
                    y=np.r_[hi, lo[::-1]],
                    **band_style(label, color),
                )
            )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=sub[y].to_numpy(float),
                mode="lines+markers",
                name=label,
                legendgroup=label,
                line=dict(color=color, dash=dash, width=2),
                marker=dict(symbol=symbol, size=6, color=color),
            )
        )
    fig.update_xaxes(title_text=x)
    fig.update_yaxes(title_text=y)
    return apply_template(fig, width, height, title or f"{y} vs {x} by {series}")


def prediction_scatter(
    frame: pd.DataFrame,
    x: str,
    y: str,
    series: str,
    title: str | None = None,
    width: int = COLUMN_WIDTH,
    height: int = 380,
) -> go.Figure:
    """Predicted (``x``) against observed (``y``) values, markers only, one trace per value of
    ``series`` (in order of first appearance), and the dotted ``y = x`` line last."""
    where = "prediction_scatter"
    need_columns(where, "frame", frame, [x, y, series])
    fig = go.Figure()
    for i, key in enumerate(dict.fromkeys(frame[series])):
        sub = frame[frame[series] == key]
        color, _, symbol = series_style(str(key), i)
        fig.add_trace(
            go.Scatter(
                x=sub[x].to_numpy(float),
                y=sub[y].to_numpy(float),
                mode="markers",
                name=str(key),
                marker=dict(color=color, symbol=symbol, size=8),
            )
        )
    both = frame[[x, y]].to_numpy(float)
    lo, hi = float(np.nanmin(both)), float(np.nanmax(both))
    fig.add_trace(
        go.Scatter(
            x=[lo, hi],
            y=[lo, hi],
            mode="lines",
            name="y = x",
            line=dict(color="#888888", dash=MEAN_DASH, width=1),
        )
    )
    fig.update_xaxes(title_text=x)
    fig.update_yaxes(title_text=y)
    return apply_template(fig, width, height, title or f"{y} vs {x}")


def theory_plateau(pred: dict | None = None) -> dict:
    """Flow time to specialise: mean over heads of the max pooling weight against flow time, one
    line per context size ``N`` (d = H = 8, beta = 8). Returns ``{name, figure, caption}``."""
    pred = predictions() if pred is None else pred  # the math only: no model is run
    frame = pd.DataFrame(pred["plateau_curves"]).assign(
        series=lambda f: "N = " + f["n_windows"].astype(str)
    )
    fig = theory_curves(
        frame,
        "time",
        "mean_max_weight",
        "series",
        title="Idealized model: the plateau before phase specialisation grows with N",
    )
    fig.update_layout(xaxis_title="flow time", yaxis_title="mean max pooling weight")
    times = ", ".join(f"N={r['n_windows']}: {fmt_time(r['time'])}" for r in pred["plateau"])
    final = frame.groupby("n_windows")["mean_max_weight"].last()
    ends = ", ".join(f"{v:.2f}" for v in final.to_numpy())
    return {
        "name": "theory_plateau",
        "figure": fig,
        "caption": (
            "Gradient flow of the idealized model (d = H = 8, beta = 8, alpha 8, V 64): flow "
            f"time until the mean max weight exceeds 0.5 is {times} (log-log slope "
            f"{fmt_num(pred['plateau_loglog_slope'])}); mean max weight at the end of each "
            f"run {ends}."
        ),
    }
