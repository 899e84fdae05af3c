"""Per-phase figures: accuracy by phase (lines and polar), head x phase heatmaps and
attention patterns by phase.

Axes: ``layer, head, phase``. Inputs are tables computed elsewhere; nothing here runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from jaxtyping import Float
from plotly.subplots import make_subplots

from phasemech.viz.style import (
    COLUMN_WIDTH,
    FONT,
    MEAN_DASH,
    PHASE_SCALE,
    apply_template,
    band_style,
    check_stride,
    need_columns,
    pick_column,
    plain_scalar,
    series_style,
)


def _layer_titles(frame: pd.DataFrame, layers: list, names: dict[int, str]) -> list[str]:
    titles = []
    for layer in layers:
        exact = bool(frame[frame.layer == layer].exact.all())
        label = names.get(layer, f"layer {layer}")
        titles.append(label if exact else f"{label} (approx.)")
    return titles


def _head_phase_trace(df: pd.DataFrame, layer: int, zmax: float, showscale: bool) -> go.Heatmap:
    """One layer's heads x phases; every layer shares ``zmax`` so colours compare across them."""
    wide = df.pivot(index="head", columns="phase", values="mass").sort_index()
    n = df.pivot(index="head", columns="phase", values="n").sort_index()
    return go.Heatmap(
        z=wide.values,
        x=[str(c) for c in wide.columns],
        y=[f"H{h}" for h in wide.index],
        customdata=n.values,
        zmin=0.0,
        zmax=zmax,
        colorscale=PHASE_SCALE,
        showscale=showscale,
        colorbar=dict(title="mass", thickness=12),
        texttemplate="%{z:.2f}",
        hovertemplate=(
            f"layer {layer}<br>head %{{y}}<br>phase %{{x}}<br>mass %{{z:.4f}}"
            "<br>n %{customdata}<extra></extra>"
        ),
    )


def _head_phase_layout(
    fig: go.Figure, pa: Any, frame: pd.DataFrame, title: str | None, n_layers: int
) -> go.Figure:
    # a frame read back from disk has lost kind and stride: recover them from its columns
    table = isinstance(pa, pd.DataFrame)
    kind = str(frame["kind"].iloc[0]) if table else pa.kind
    stride = int(frame["phase"].max()) + 1 if table else pa.stride
    what = "mean over queries" if kind == "query_mean" else "answer -> needle"
    fig.update_layout(
        title=title or f"Attention mass by source phase ({what}, stride {stride})",
        font=FONT,
        template="simple_white",
        width=max(360, 260 * n_layers + 120),
        height=120 + 34 * int(frame["head"].nunique()) + 80,
        margin=dict(l=60, r=20, t=70, b=50),
    )
    return fig


def head_phase_heatmap(
    pa: Any,
    title: str | None = None,
    layer_names: dict[int, str] | None = None,
) -> go.Figure:
    """Heatmap per layer: rows heads, columns source phase, colour = attention mass.

    ``pa``: a :class:`PhaseAttention` or its ``frame`` (e.g. read back from parquet).
    For ``kind="query_mean"`` each row sums to 1 and ``1/stride`` is "no phase preference"; for
    ``kind="pair"`` a cell is the mean mass from the answer position onto needles of that phase.
    Hover shows the value and ``n``; approximate (gradient-attributed) layers are marked.
    """
    # a PhaseAttention is read by its attributes: figures never import the model layer
    frame = getattr(pa, "frame", pa)
    need_columns(
        "head_phase_heatmap", "pa", frame, ["layer", "head", "phase", "mass", "n", "exact"]
    )
    layers = sorted(frame.layer.unique())
    subtitles = _layer_titles(frame, layers, layer_names or {})
    fig = make_subplots(rows=1, cols=len(layers), subplot_titles=subtitles, shared_yaxes=True)
    zmax = float(frame.mass.max()) if frame.mass.notna().any() else 1.0
    for col, layer in enumerate(layers, start=1):
        trace = _head_phase_trace(frame[frame.layer == layer], layer, zmax, col == len(layers))
        fig.add_trace(trace, row=1, col=col)
        fig.update_xaxes(title_text="source phase", row=1, col=col)
    fig.update_yaxes(title_text="head", autorange="reversed", row=1, col=1)
    return _head_phase_layout(fig, pa, frame, title, len(layers))


# --------------------------------------------------------------------------- per-phase accuracy

#: accepted column names of a per-phase accuracy frame, first match wins
ACC_COLUMNS = ("acc", "accuracy")
CI_COLUMNS = (("ci_low", "ci_high"), ("boot_lo", "boot_hi"), ("wilson_lo", "wilson_hi"))


def _phase_curve(where: str, label: str, frame: Any, stride: int) -> dict[str, Any]:
    """Columns of one per-phase series: ``phase``, ``acc``, ``lo``, ``hi`` (or None), ``mean``."""
    name = f"series[{label!r}]"
    need_columns(where, name, frame, ["phase"])
    acc_col = pick_column(where, name, frame, ACC_COLUMNS)
    df = frame.sort_values("phase")
    phase = pd.to_numeric(df["phase"], errors="coerce").to_numpy(float)
    bad = ~np.isfinite(phase) | (phase < 0) | (phase >= stride) | (phase != np.round(phase))
    if bad.any():
        raise ValueError(
            f"{where}: {name} has phase {plain_scalar(df['phase'].to_numpy()[bad][0])!r}: expected "
            f"an int in 0..{stride - 1} (stride={stride})"
        )
    acc = df[acc_col].to_numpy(float)
    lo = hi = None
    for a, b in CI_COLUMNS:  # the first pair present with any finite value
        if a in df.columns and b in df.columns:
            la, hb = df[a].to_numpy(float), df[b].to_numpy(float)
            if np.isfinite(la).any() and np.isfinite(hb).any():
                lo, hi = la, hb
                break
    ok = np.isfinite(acc)
    if "n" in df.columns and (df["n"].to_numpy(float)[ok] > 0).any():
        w = df["n"].to_numpy(float)
        mean = float(np.sum(acc[ok] * w[ok]) / np.sum(w[ok]))
    else:
        mean = float(np.mean(acc[ok])) if ok.any() else math.nan
    return dict(phase=phase.astype(int), acc=acc, lo=lo, hi=hi, mean=mean)


def _series_items(where: str, series: Any) -> list[tuple[str, pd.DataFrame]]:
    if not isinstance(series, Mapping) or not series:
        raise ValueError(
            f"{where}: series must be a non-empty dict label -> DataFrame, got "
            f"{type(series).__name__}"
        )
    return [(str(k), v) for k, v in series.items()]


def _curve_style(label: str, color: str, dash: str, symbol: str) -> dict[str, Any]:
    """Trace settings of a series' accuracy curve (the legend entry of its group)."""
    return dict(
        mode="lines+markers",
        name=label,
        legendgroup=label,
        line=dict(color=color, dash=dash, width=2),
        marker=dict(symbol=symbol, size=7, color=color),
    )


def _mean_style(label: str, color: str) -> dict[str, Any]:
    """Trace settings of a series' dotted mean line."""
    return dict(
        mode="lines",
        name=f"{label} mean",
        legendgroup=label,
        line=dict(color=color, dash=MEAN_DASH, width=1.5),
    )


def _accuracy_traces(label: str, i: int, c: dict[str, Any], d: int) -> list[go.Scatter]:
    """One series of :func:`per_phase_accuracy`: [band,] line, mean."""
    color, dash, symbol = series_style(label, i)
    traces = []
    if c["lo"] is not None:
        keep = np.isfinite(c["lo"]) & np.isfinite(c["hi"])
        x = c["phase"][keep]
        traces.append(
            go.Scatter(
                x=np.r_[x, x[::-1]],
                y=np.r_[c["hi"][keep], c["lo"][keep][::-1]],
                **band_style(label, color),
            )
        )
    custom = np.c_[c["lo"], c["hi"]] if c["lo"] is not None else np.full((len(c["acc"]), 2), np.nan)
    line = go.Scatter(
        x=c["phase"],
        y=c["acc"],
        customdata=custom,
        hovertemplate=(
            f"{label}<br>phase %{{x}}<br>accuracy %{{y:.3f}}"
            "<br>95% CI [%{customdata[0]:.3f}, %{customdata[1]:.3f}]<extra></extra>"
        ),
        **_curve_style(label, color, dash, symbol),
    )
    mean = go.Scatter(
        x=[-0.5, d - 0.5],
        y=[c["mean"], c["mean"]],
        hovertemplate=f"{label}<br>mean accuracy %{{y:.3f}}<extra></extra>",
        **_mean_style(label, color),
    )
    return [*traces, line, mean]


def per_phase_accuracy(
    series: Mapping[str, pd.DataFrame],
    stride: int,
    title: str | None = None,
    width: int = COLUMN_WIDTH,
    height: int = 340,
) -> go.Figure:
    """Held-out accuracy against needle phase, one line+markers per series with a 95% band.

    ``series``: label -> frame with ``phase`` and ``acc`` (or ``accuracy``: the column of
    :func:`phasemech.measure.stats.per_phase` / ``PhaseReport.per_phase``), and optionally an
    interval: ``ci_low, ci_high``, else ``boot_lo, boot_hi`` (cluster bootstrap), else ``wilson_lo,
    wilson_hi``: the first pair with a finite value is shaded. A dotted horizontal line (same
    colour) marks the series' mean accuracy, "the average that hides the cycle": weighted by
    ``n`` (= the overall accuracy) when the frame has ``n``, else the plain mean over phases.
    A label starting with a design name (``"mean d=4"``) takes that design's colour/dash/marker.

    Traces per series, in order: band (``fill="toself"``, only with an interval), line, mean.
    """
    where = "per_phase_accuracy"
    d = check_stride(where, stride)
    fig = go.Figure()
    for i, (label, frame) in enumerate(_series_items(where, series)):
        for trace in _accuracy_traces(label, i, _phase_curve(where, label, frame, d), d):
            fig.add_trace(trace)
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), range=[-0.5, d - 0.5])
    fig.update_yaxes(title_text="held-out accuracy")
    return apply_template(
        fig, width, height, title or f"Accuracy by phase (stride {d}); dotted: mean"
    )


def _polar_traces(
    label: str, i: int, c: dict[str, Any], d: int
) -> tuple[list[go.Scatterpolar], float]:
    """One series of :func:`per_phase_polar` ([band,] loop, mean circle) and its largest
    radius."""
    color, dash, symbol = series_style(label, i)
    theta = c["phase"] * 360.0 / d
    traces, rmax = [], 0.0
    if c["lo"] is not None:
        keep = np.isfinite(c["lo"]) & np.isfinite(c["hi"])
        t, lo, hi = theta[keep], c["lo"][keep], c["hi"][keep]
        # outer loop, then inner loop backwards: a ring
        traces.append(
            go.Scatterpolar(
                theta=np.r_[t, t[:1], t[:1], t[::-1]],
                r=np.r_[hi, hi[:1], lo[:1], lo[::-1]],
                **band_style(label, color),
            )
        )
        rmax = float(np.nanmax(hi, initial=0.0))
    ok = np.isfinite(c["acc"])
    t, r = theta[ok], c["acc"][ok]
    loop = go.Scatterpolar(
        theta=np.r_[t, t[:1]],
        r=np.r_[r, r[:1]],
        hovertemplate=f"{label}<br>accuracy %{{r:.3f}}<extra></extra>",
        **_curve_style(label, color, dash, symbol),
    )
    circle = np.linspace(0.0, 360.0, 121)
    mean = go.Scatterpolar(
        theta=circle,
        r=np.full(len(circle), c["mean"]),
        hovertemplate=f"{label}<br>mean accuracy %{{r:.3f}}<extra></extra>",
        **_mean_style(label, color),
    )
    return [*traces, loop, mean], max(rmax, float(np.nanmax(r, initial=0.0)))


def per_phase_polar(
    series: Mapping[str, pd.DataFrame],
    stride: int,
    title: str | None = None,
    width: int = COLUMN_WIDTH,
    height: int = 420,
) -> go.Figure:
    """:func:`per_phase_accuracy` on a clock: phase ``p`` at angle ``360 p / stride`` (phase 0
    on top, clockwise), accuracy as radius, each curve a closed loop; the band is the ring
    between the upper and the lower bound, the mean a dotted circle. Same input and styles.

    Traces per series, in order: band (only with an interval), loop, mean circle.
    """
    where = "per_phase_polar"
    d = check_stride(where, stride)
    fig = go.Figure()
    rmax = 0.0
    for i, (label, frame) in enumerate(_series_items(where, series)):
        traces, top = _polar_traces(label, i, _phase_curve(where, label, frame, d), d)
        for trace in traces:
            fig.add_trace(trace)
        rmax = max(rmax, top)
    fig.update_layout(
        polar=dict(
            angularaxis=dict(
                direction="clockwise",
                rotation=90,
                tickvals=[p * 360.0 / d for p in range(d)],
                ticktext=[f"phase {p}" if p == 0 else str(p) for p in range(d)],
            ),
            radialaxis=dict(range=[0, max(1.0, rmax)], angle=90, tickangle=90),
        )
    )
    return apply_template(
        fig,
        width,
        height,
        title or f"Accuracy (radius) by phase, d={d}; dotted: mean",
    )


# --------------------------------------------------------------------------- attention pattern


def _check_keys(
    where: str, pattern: Any, grid_offset: Any, key_positions: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(pattern, pos)``: the pattern as a float array and the position of every key column."""
    a = np.asarray(pattern, dtype=float)
    if a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"{where}: pattern has shape {a.shape}: expected [query_pos, key_pos]")
    if isinstance(grid_offset, bool) or not isinstance(grid_offset, int | np.integer):
        raise ValueError(f"{where}: grid_offset={grid_offset!r} is invalid: expected an int")
    n_k = a.shape[1]
    pos = np.arange(n_k) if key_positions is None else np.asarray(key_positions)
    if pos.shape != (n_k,) or not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(
            f"{where}: key_positions has shape {pos.shape}: expected {n_k} ints (one per key)"
        )
    return a, pos


def _check_marks(where: str, needle: Any, query: Any, pos: np.ndarray, n_q: int) -> None:
    if needle is not None and needle not in set(pos.tolist()):
        raise ValueError(f"{where}: needle={needle!r} is not a key position")
    if query is not None and not (
        isinstance(query, int | np.integer) and not isinstance(query, bool) and 0 <= query < n_q
    ):
        raise ValueError(f"{where}: query={query!r} is not a row in 0..{n_q - 1}")


def _pattern_traces(
    a: np.ndarray, phase: np.ndarray, x: list[str], d: int
) -> tuple[go.Heatmap, go.Heatmap]:
    """The strip of key phases and the pattern under it."""
    strip = go.Heatmap(
        z=phase[None, :],
        x=x,
        y=["phase"],
        colorscale=PHASE_SCALE,
        zmin=0,
        zmax=d - 1,
        showscale=False,
        hovertemplate="key %{x}<br>phase %{z}<extra></extra>",
    )
    weights = go.Heatmap(
        z=a,
        x=x,
        y=[str(i) for i in range(a.shape[0])],
        colorscale="Greys",
        zmin=0.0,
        colorbar=dict(title="attn", thickness=12, len=0.8, y=0.45),
        hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>",
    )
    return strip, weights


#: needle and query boxes: vermilion stands out on the grey pattern and the blue chunk lines
_MARK = dict(color="#D55E00", width=2)


def _mark_needle(fig: go.Figure, j: int, x: list[str], phase: int, n_q: int) -> None:
    fig.add_shape(
        type="rect", x0=j - 0.5, x1=j + 0.5, y0=-0.5, y1=n_q - 0.5, line=_MARK, row=2, col=1
    )
    fig.add_annotation(  # above the phase strip, over the needle's column
        x=x[j],
        xref="x2",
        y=1.0,
        yref="paper",
        yanchor="bottom",
        text=f"needle (phase {phase})",
        showarrow=False,
        font=dict(size=10, color=_MARK["color"]),
    )


def _mark_query(fig: go.Figure, query: int, n_k: int) -> None:
    fig.add_shape(
        type="rect",
        x0=-0.5,
        x1=n_k - 0.5,
        y0=query - 0.5,
        y1=query + 0.5,
        line=_MARK,
        row=2,
        col=1,
    )
    fig.add_annotation(
        x=n_k - 0.5,
        y=str(query),
        text="query",
        showarrow=False,
        xanchor="left",
        font=dict(size=10, color=_MARK["color"]),
        row=2,
        col=1,
    )


def _pattern_axes(fig: go.Figure, x: list[str]) -> None:
    # at most ~24 key labels: a long context would print them on top of each other
    step = max(1, math.ceil(len(x) / 24))
    ticks = [x[j] for j in range(0, len(x), step)]
    fig.update_xaxes(type="category", tickvals=ticks, row=2, col=1, title_text="key position")
    fig.update_xaxes(type="category", showticklabels=False, ticks="", row=1, col=1)
    fig.update_yaxes(showticklabels=False, ticks="", row=1, col=1)
    fig.update_yaxes(
        type="category", autorange="reversed", title_text="query position", row=2, col=1
    )


def attention_pattern_phases(
    pattern: Float[np.ndarray, "query key"],
    stride: int,
    grid_offset: int = 0,
    needle: int | None = None,
    query: int | None = None,
    title: str | None = None,
    key_positions: Sequence[int] | None = None,
    width: int = COLUMN_WIDTH,
    height: int | None = None,
) -> go.Figure:
    """One head's attention pattern on one example, with the compression grid drawn on it.

    ``pattern``: ``[query_pos, key_pos]`` (any shape: the key axis may be shorter or longer than
    the query axis). ``key_positions``: the token position of each key column (default
    ``0..key-1``); a key's phase is ``(pos - grid_offset) % stride``. Drawn: a strip of key
    phases above the pattern (:data:`PHASE_SCALE`, trace 0; the pattern is trace 1, greyscale),
    vertical dotted lines before every column that starts a chunk (phase 0; not before the first
    column), the ``needle`` key column (by position) and the ``query`` row (by row index) boxed
    and annotated.
    """
    where = "attention_pattern_phases"
    d = check_stride(where, stride)
    a, pos = _check_keys(where, pattern, grid_offset, key_positions)
    n_q, n_k = a.shape
    phase = (pos - int(grid_offset)) % d
    _check_marks(where, needle, query, pos, n_q)
    x = [str(int(p)) for p in pos]
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.06, 0.94], vertical_spacing=0.02
    )
    strip, weights = _pattern_traces(a, phase, x, d)
    fig.add_trace(strip, row=1, col=1)
    fig.add_trace(weights, row=2, col=1)
    for j in range(1, n_k):
        if phase[j] == 0:
            fig.add_vline(x=j - 0.5, line=dict(color="#56B4E9", width=1.5), row=2, col=1)
    if needle is not None:
        j = int(np.flatnonzero(pos == needle)[0])
        _mark_needle(fig, j, x, phase[j], n_q)
    if query is not None:
        _mark_query(fig, query, n_k)
    _pattern_axes(fig, x)
    return apply_template(
        fig,
        width,
        height or max(260, min(720, 120 + 10 * n_q)),
        title or f"Attention pattern with the chunk grid (stride {d}, offset {grid_offset})",
    )
