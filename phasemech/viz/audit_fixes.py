"""The fixes frontier of an audit: KV budget against mean accuracy and the debiased phase gap.

Axes: ``setting`` (a design under a variant: ``aligned`` or a fix), ``budget`` (most tokens or
compressed entries one query reads; log scale), ``accuracy`` (mean over phases), ``gap`` (the
debiased best-minus-worst phase accuracy, with its 95% cluster-bootstrap CI).

Input: the audit's ``summary`` rows of one context, with ``design``, ``variant``, ``budget``,
``accuracy``, ``debiased_gap``, ``gap_lo``, ``gap_hi`` (:mod:`phasemech.experiments.audit.summary`).
Each design keeps one colour; its budget path (``aligned`` then more top-k) is a line, every
other fix a marker by variant, so a fix above and left of the line beats buying budget.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phasemech.viz.style import OTHER_COLORS, apply_template

#: the variants on each design's budget path, in order of budget
BUDGET_PATH = ("aligned", "topk_x2", "topk_x4", "topk_x8")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "pentagon",
            "hexagon", "star-triangle-up", "circle-open")  # fmt: skip
_COLS = ("design", "variant", "budget", "accuracy", "debiased_gap", "gap_lo", "gap_hi")


def frontier_figure(summary: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Two panels sharing a log budget axis: mean accuracy (top) and debiased gap with its 95%
    CI (bottom), one colour per design, one marker per variant, the budget path as a line."""
    missing = [c for c in _COLS if c not in summary.columns]
    if missing:
        raise ValueError(f"frontier_figure: summary lacks columns {missing}; needs {_COLS}")
    s = summary[summary["design"] != "null"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06)
    variants = list(dict.fromkeys(s["variant"]))
    for i, (design, g) in enumerate(s.groupby("design", sort=False)):
        color = OTHER_COLORS[i % len(OTHER_COLORS)]
        path = g[g["variant"].isin(BUDGET_PATH)].sort_values("budget")
        for row, y in ((1, "accuracy"), (2, "debiased_gap")):
            line = go.Scatter(x=path["budget"], y=path[y], mode="lines", hoverinfo="skip",
                              line=dict(color=color, width=1), showlegend=False)  # fmt: skip
            fig.add_trace(line.update(legendgroup=design), row=row, col=1)
        for _, r in g.iterrows():
            symbol = _SYMBOLS[variants.index(r["variant"]) % len(_SYMBOLS)]
            for row, trace in enumerate(_points(r, color, symbol), start=1):
                fig.add_trace(trace, row=row, col=1)
    fig.update_xaxes(type="log", title_text="KV budget (tokens read per query)", row=2, col=1)
    fig.update_yaxes(title_text="mean accuracy", range=[-0.02, 1.02], row=1, col=1)
    fig.update_yaxes(title_text="debiased gap", row=2, col=1)
    fig.add_hline(y=0, line=dict(color="#999999", width=1, dash="dot"), row=2, col=1)
    return apply_template(fig, width=760, height=620, title=title)


def _points(r: pd.Series, color: str, symbol: str) -> tuple[go.Scatter, go.Scatter]:
    """One setting's accuracy marker (top) and gap marker with its CI (bottom)."""
    name = f"{r['design']} / {r['variant']}"
    common = dict(
        x=[r["budget"]], mode="markers", name=name, legendgroup=r["design"],
        hovertext=f"{name}<br>budget {r['budget']}", hoverinfo="text+y",
        marker=dict(color=color, symbol=symbol, size=8, line=dict(width=0.5, color="black")),
    )  # fmt: skip
    gap, lo, hi = r["debiased_gap"], r["gap_lo"], r["gap_hi"]
    err = dict(type="data", symmetric=False, array=[hi - gap], arrayminus=[gap - lo],
               thickness=1, width=2)  # fmt: skip
    return (
        go.Scatter(y=[r["accuracy"]], **common),
        go.Scatter(y=[gap], error_y=err, showlegend=False, **common),
    )


__all__ = ["BUDGET_PATH", "frontier_figure"]
