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
    _band_style,
    _check_stride,
    _need,
    _pick,
    _plain,
    _style,
    apply_template,
)


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
    _need("head_phase_heatmap", "pa", frame, ["layer", "head", "phase", "mass", "n", "exact"])
    layers = sorted(frame.layer.unique())
    names = layer_names or {}
    subtitles = []
    for layer in layers:
        exact = bool(frame[frame.layer == layer].exact.all())
        label = names.get(layer, f"layer {layer}")
        subtitles.append(label if exact else f"{label} (approx.)")
    fig = make_subplots(rows=1, cols=len(layers), subplot_titles=subtitles, shared_yaxes=True)
    zmax = float(frame.mass.max()) if frame.mass.notna().any() else 1.0
    for col, layer in enumerate(layers, start=1):
        df = frame[frame.layer == layer]
        wide = df.pivot(index="head", columns="phase", values="mass").sort_index()
        n = df.pivot(index="head", columns="phase", values="n").sort_index()
        fig.add_trace(
            go.Heatmap(
                z=wide.values,
                x=[str(c) for c in wide.columns],
                y=[f"H{h}" for h in wide.index],
                customdata=n.values,
                zmin=0.0,
                zmax=zmax,
                colorscale=PHASE_SCALE,
                showscale=col == len(layers),
                colorbar=dict(title="mass", thickness=12),
                texttemplate="%{z:.2f}",
                hovertemplate=(
                    f"layer {layer}<br>head %{{y}}<br>phase %{{x}}<br>mass %{{z:.4f}}"
                    "<br>n %{customdata}<extra></extra>"
                ),
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="source phase", row=1, col=col)
    fig.update_yaxes(title_text="head", autorange="reversed", row=1, col=1)
    table = isinstance(pa, pd.DataFrame)
    kind = str(frame["kind"].iloc[0]) if table else pa.kind
    stride = int(frame["phase"].max()) + 1 if table else pa.stride
    what = "mean over queries" if kind == "query_mean" else "answer -> needle"
    fig.update_layout(
        title=title or f"Attention mass by source phase ({what}, stride {stride})",
        font=FONT,
        template="simple_white",
        width=max(360, 260 * len(layers) + 120),
        height=120 + 34 * int(frame["head"].nunique()) + 80,
        margin=dict(l=60, r=20, t=70, b=50),
    )
    return fig


# --------------------------------------------------------------------------- per-phase accuracy

#: accepted column names of a per-phase accuracy frame, first match wins
ACC_COLUMNS = ("acc", "accuracy")
CI_COLUMNS = (("ci_low", "ci_high"), ("boot_lo", "boot_hi"), ("wilson_lo", "wilson_hi"))


def _phase_curve(where: str, label: str, frame: Any, stride: int) -> dict[str, Any]:
    """Columns of one per-phase series: ``phase``, ``acc``, ``lo``, ``hi`` (or None), ``mean``."""
    name = f"series[{label!r}]"
    _need(where, name, frame, ["phase"])
    acc_col = _pick(where, name, frame, ACC_COLUMNS)
    df = frame.sort_values("phase")
    phase = pd.to_numeric(df["phase"], errors="coerce").to_numpy(float)
    bad = ~np.isfinite(phase) | (phase < 0) | (phase >= stride) | (phase != np.round(phase))
    if bad.any():
        raise ValueError(
            f"{where}: {name} has phase {_plain(df['phase'].to_numpy()[bad][0])!r}: expected "
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
    d = _check_stride(where, stride)
    fig = go.Figure()
    for i, (label, frame) in enumerate(_series_items(where, series)):
        c = _phase_curve(where, label, frame, d)
        color, dash, symbol = _style(label, i)
        if c["lo"] is not None:
            keep = np.isfinite(c["lo"]) & np.isfinite(c["hi"])
            x = c["phase"][keep]
            fig.add_trace(
                go.Scatter(
                    x=np.r_[x, x[::-1]],
                    y=np.r_[c["hi"][keep], c["lo"][keep][::-1]],
                    **_band_style(label, color),
                )
            )
        custom = (
            np.c_[c["lo"], c["hi"]] if c["lo"] is not None else np.full((len(c["acc"]), 2), np.nan)
        )
        fig.add_trace(
            go.Scatter(
                x=c["phase"],
                y=c["acc"],
                mode="lines+markers",
                name=label,
                legendgroup=label,
                line=dict(color=color, dash=dash, width=2),
                marker=dict(symbol=symbol, size=7, color=color),
                customdata=custom,
                hovertemplate=(
                    f"{label}<br>phase %{{x}}<br>accuracy %{{y:.3f}}"
                    "<br>95% CI [%{customdata[0]:.3f}, %{customdata[1]:.3f}]<extra></extra>"
                ),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[-0.5, d - 0.5],
                y=[c["mean"], c["mean"]],
                mode="lines",
                name=f"{label} mean",
                legendgroup=label,
                line=dict(color=color, dash=MEAN_DASH, width=1.5),
                hovertemplate=f"{label}<br>mean accuracy %{{y:.3f}}<extra></extra>",
            )
        )
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), range=[-0.5, d - 0.5])
    fig.update_yaxes(title_text="held-out accuracy")
    return apply_template(
        fig, width, height, title or f"Accuracy by phase (stride {d}); dotted: mean"
    )


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
    d = _check_stride(where, stride)
    fig = go.Figure()
    circle = np.linspace(0.0, 360.0, 121)
    rmax = 0.0
    for i, (label, frame) in enumerate(_series_items(where, series)):
        c = _phase_curve(where, label, frame, d)
        color, dash, symbol = _style(label, i)
        ok = np.isfinite(c["acc"])
        theta = c["phase"] * 360.0 / d
        if c["lo"] is not None:
            keep = np.isfinite(c["lo"]) & np.isfinite(c["hi"])
            t, lo, hi = theta[keep], c["lo"][keep], c["hi"][keep]
            # outer loop, then inner loop backwards: a ring
            fig.add_trace(
                go.Scatterpolar(
                    theta=np.r_[t, t[:1], t[:1], t[::-1]],
                    r=np.r_[hi, hi[:1], lo[:1], lo[::-1]],
                    **_band_style(label, color),
                )
            )
            rmax = max(rmax, float(np.nanmax(hi, initial=0.0)))
        t, r = theta[ok], c["acc"][ok]
        fig.add_trace(
            go.Scatterpolar(
                theta=np.r_[t, t[:1]],
                r=np.r_[r, r[:1]],
                mode="lines+markers",
                name=label,
                legendgroup=label,
                line=dict(color=color, dash=dash, width=2),
                marker=dict(symbol=symbol, size=7, color=color),
                hovertemplate=f"{label}<br>accuracy %{{r:.3f}}<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatterpolar(
                theta=circle,
                r=np.full(len(circle), c["mean"]),
                mode="lines",
                name=f"{label} mean",
                legendgroup=label,
                line=dict(color=color, dash=MEAN_DASH, width=1.5),
                hovertemplate=f"{label}<br>mean accuracy %{{r:.3f}}<extra></extra>",
            )
        )
        rmax = max(rmax, float(np.nanmax(r, initial=0.0)))
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


# --------------------------------------------------------------------------- effect heatmap


#: columns that select one analysis out of a tidy effects frame; several values = ambiguous
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
    d = _check_stride(where, stride)
    a = np.asarray(pattern, dtype=float)
    if a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"{where}: pattern has shape {a.shape}: expected [query_pos, key_pos]")
    if isinstance(grid_offset, bool) or not isinstance(grid_offset, int | np.integer):
        raise ValueError(f"{where}: grid_offset={grid_offset!r} is invalid: expected an int")
    n_q, n_k = a.shape
    pos = np.arange(n_k) if key_positions is None else np.asarray(key_positions)
    if pos.shape != (n_k,) or not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(
            f"{where}: key_positions has shape {pos.shape}: expected {n_k} ints (one per key)"
        )
    phase = (pos - int(grid_offset)) % d
    if needle is not None and needle not in set(pos.tolist()):
        raise ValueError(f"{where}: needle={needle!r} is not a key position")
    if query is not None and not (
        isinstance(query, int | np.integer) and not isinstance(query, bool) and 0 <= query < n_q
    ):
        raise ValueError(f"{where}: query={query!r} is not a row in 0..{n_q - 1}")
    x = [str(int(p)) for p in pos]
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.06, 0.94], vertical_spacing=0.02
    )
    fig.add_trace(
        go.Heatmap(
            z=phase[None, :],
            x=x,
            y=["phase"],
            colorscale=PHASE_SCALE,
            zmin=0,
            zmax=d - 1,
            showscale=False,
            hovertemplate="key %{x}<br>phase %{z}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=a,
            x=x,
            y=[str(i) for i in range(n_q)],
            colorscale="Greys",
            zmin=0.0,
            colorbar=dict(title="attn", thickness=12, len=0.8, y=0.45),
            hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    for j in range(1, n_k):
        if phase[j] == 0:
            fig.add_vline(x=j - 0.5, line=dict(color="#56B4E9", width=1.5), row=2, col=1)
    box = dict(color="#D55E00", width=2)
    if needle is not None:
        j = int(np.flatnonzero(pos == needle)[0])
        fig.add_shape(
            type="rect", x0=j - 0.5, x1=j + 0.5, y0=-0.5, y1=n_q - 0.5, line=box, row=2, col=1
        )
        fig.add_annotation(  # above the phase strip, over the needle's column
            x=x[j],
            xref="x2",
            y=1.0,
            yref="paper",
            yanchor="bottom",
            text=f"needle (phase {phase[j]})",
            showarrow=False,
            font=dict(size=10, color=box["color"]),
        )
    if query is not None:
        fig.add_shape(
            type="rect",
            x0=-0.5,
            x1=n_k - 0.5,
            y0=query - 0.5,
            y1=query + 0.5,
            line=box,
            row=2,
            col=1,
        )
        fig.add_annotation(
            x=n_k - 0.5,
            y=str(query),
            text="query",
            showarrow=False,
            xanchor="left",
            font=dict(size=10, color=box["color"]),
            row=2,
            col=1,
        )
    step = max(1, math.ceil(n_k / 24))
    ticks = [x[j] for j in range(0, n_k, step)]
    fig.update_xaxes(type="category", tickvals=ticks, row=2, col=1, title_text="key position")
    fig.update_xaxes(type="category", showticklabels=False, ticks="", row=1, col=1)
    fig.update_yaxes(showticklabels=False, ticks="", row=1, col=1)
    fig.update_yaxes(
        type="category", autorange="reversed", title_text="query position", row=2, col=1
    )
    return apply_template(
        fig,
        width,
        height or max(260, min(720, 120 + 10 * n_q)),
        title or f"Attention pattern with the chunk grid (stride {d}, offset {grid_offset})",
    )


# --------------------------------------------------------------------------- theory
