"""plotly figures. Every function returns a ``go.Figure`` and never calls ``.show()``.

Axes: ``layer, head, phase``. Figures read results computed elsewhere (``PhaseAttention``,
tidy frames, metric rows, numpy arrays); they never run a model.

One template for all figures: :func:`apply_template` (``simple_white``, :data:`FONT`, a paper
column of :data:`COLUMN_WIDTH` px). Designs keep one colour (:data:`DESIGN_COLORS`, Okabe-Ito:
colour-blind safe, different lightness), one dash (:data:`DESIGN_DASH`) and one marker
(:data:`DESIGN_SYMBOL`) in every figure, so lines stay apart in greyscale. Phases use
:data:`PHASE_SCALE` (Cividis); signed effects :data:`EFFECT_SCALE` (RdBu, centred at 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.colors as pcolors
import plotly.graph_objects as go
from jaxtyping import Float
from plotly.subplots import make_subplots

from phasemech.phase import PhaseAttention

#: one template for every phasemech figure: paper-column width, readable in greyscale
FONT = dict(family="Helvetica, Arial, sans-serif", size=12)
PHASE_SCALE = "Cividis"  # perceptually uniform and monotone in lightness: survives greyscale
#: plotly.py's RdBu runs red (low) -> white -> blue (high): a negative effect (ablating the unit
#: hurts) is red, a positive one blue; every effect figure is centred at 0 with a symmetric range
EFFECT_SCALE = "RdBu"
COLUMN_WIDTH = 480  # px: one column of a two-column paper at ~100 dpi
MARGIN = dict(l=60, r=20, t=60, b=50)

#: Okabe-Ito colours, ordered dark -> light so they also differ in greyscale
DESIGN_COLORS: dict[str, str] = {
    "none": "#000000",  # black: the dense reference
    "mean": "#0072B2",  # blue
    "gated": "#E69F00",  # orange
    "mlp": "#009E73",  # bluish green
    "route": "#CC79A7",  # reddish purple
}
#: one dash per design (``"dot"`` is kept for mean / reference lines, see :data:`MEAN_DASH`)
DESIGN_DASH: dict[str, str] = {
    "none": "solid",
    "mean": "dash",
    "gated": "longdash",
    "mlp": "dashdot",
    "route": "longdashdot",
}
DESIGN_SYMBOL: dict[str, str] = {
    "none": "circle",
    "mean": "square",
    "gated": "diamond",
    "mlp": "triangle-up",
    "route": "x",
}
MEAN_DASH = "dot"  # the horizontal "average that hides the cycle" lines
#: colours for series that name no design and for clusters: Okabe-Ito, non-design ones first
#: (its yellow is left out: it vanishes on white)
OTHER_COLORS = ("#D55E00", "#56B4E9", "#0072B2", "#009E73", "#CC79A7", "#E69F00", "#000000")
FLAT_COLOR, UNCLUSTERED_COLOR = "#999999", "#444444"
_OTHER_DASH = ("solid", "dash", "longdash", "dashdot", "longdashdot")
_OTHER_SYMBOL = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star")


def apply_template(
    fig: go.Figure,
    width: int = COLUMN_WIDTH,
    height: int = 340,
    title: str | None = None,
) -> go.Figure:
    """Apply the phasemech template in place and return ``fig``: ``simple_white``, :data:`FONT`,
    paper-column ``width`` (px), ``height`` and :data:`MARGIN`; ``title`` when given."""
    fig.update_layout(
        template="simple_white",
        font=FONT,
        width=int(width),
        height=int(height),
        margin=MARGIN,
        legend=dict(font=dict(size=FONT["size"] - 2)),
    )
    if title is not None:
        fig.update_layout(title=title)
    return fig


def design_of(label: str) -> str | None:
    """The design a series label starts with (``"mean d=4"`` -> ``"mean"``), else ``None``."""
    low = str(label).lower()
    for name in sorted(DESIGN_COLORS, key=len, reverse=True):
        if low.startswith(name):
            return name
    return None


def _style(label: str, i: int) -> tuple[str, str, str]:
    """(colour, dash, marker symbol) of the ``i``-th series, by design when the label names one."""
    d = design_of(label)
    if d is not None:
        return DESIGN_COLORS[d], DESIGN_DASH[d], DESIGN_SYMBOL[d]
    return (
        OTHER_COLORS[i % len(OTHER_COLORS)],
        _OTHER_DASH[i % len(_OTHER_DASH)],
        _OTHER_SYMBOL[i % len(_OTHER_SYMBOL)],
    )


def _rgba(color: str, alpha: float) -> str:
    r, g, b = pcolors.hex_to_rgb(color) if color.startswith("#") else pcolors.unlabel_rgb(color)
    return f"rgba({int(r)},{int(g)},{int(b)},{alpha})"


def _band_style(label: str, color: str) -> dict[str, Any]:
    """Trace settings of a shaded 95% band (no line, no hover, grouped with its curve)."""
    return dict(
        fill="toself",
        fillcolor=_rgba(color, 0.18),
        mode="lines",
        line=dict(width=0),
        hoverinfo="skip",
        showlegend=False,
        legendgroup=label,
        name=f"{label} 95% CI",
    )


def _check_stride(where: str, stride: Any, low: int = 2) -> int:
    if isinstance(stride, bool) or not isinstance(stride, int | np.integer) or stride < low:
        raise ValueError(f"{where}: stride={stride!r} is invalid: expected an int >= {low}")
    return int(stride)


def _need(where: str, name: str, frame: Any, columns: Sequence[str]) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"{where}: {name} is a {type(frame).__name__}: expected a DataFrame")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{where}: {name} lacks column(s) {missing}; got {list(map(str, frame.columns))}"
        )


def _plain(v: Any) -> Any:
    """A numpy scalar as its Python value (for error messages)."""
    return v.item() if isinstance(v, np.generic) else v


def _pick(where: str, name: str, frame: pd.DataFrame, options: Sequence[str]) -> str:
    for c in options:
        if c in frame.columns:
            return c
    raise ValueError(
        f"{where}: {name} lacks column(s) {list(options)[0]!r} (or {list(options)[1:]}); "
        f"got {list(map(str, frame.columns))}"
    )


def head_phase_heatmap(
    pa: PhaseAttention | pd.DataFrame,
    title: str | None = None,
    layer_names: dict[int, str] | None = None,
) -> go.Figure:
    """Heatmap per layer: rows heads, columns source phase, colour = attention mass.

    ``pa``: a :class:`PhaseAttention` or its ``frame`` (e.g. read back from parquet).
    For ``kind="query_mean"`` each row sums to 1 and ``1/stride`` is "no phase preference"; for
    ``kind="pair"`` a cell is the mean mass from the answer position onto needles of that phase.
    Hover shows the value and ``n``; approximate (gradient-attributed) layers are marked.
    """
    frame = pa.frame if isinstance(pa, PhaseAttention) else pa
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
    kind = pa.kind if isinstance(pa, PhaseAttention) else str(frame["kind"].iloc[0])
    stride = pa.stride if isinstance(pa, PhaseAttention) else int(frame["phase"].max()) + 1
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
    :func:`phasemech.stats.per_phase` / ``PhaseReport.per_phase``), and optionally an interval:
    ``ci_low, ci_high``, else ``boot_lo, boot_hi`` (cluster bootstrap), else ``wilson_lo,
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
SELECTOR_COLUMNS = ("component", "mode", "metric", "pos", "unit_kind", "site", "design")


def effect_heatmap(
    frame: pd.DataFrame,
    value: str = "effect",
    title: str | None = None,
    zmax: float | None = None,
    width: int = COLUMN_WIDTH,
    height: int | None = None,
) -> go.Figure:
    """Signed per-phase effect per unit: rows ``L{layer}H{unit}``, columns phase, colour ``value``.

    ``frame``: ``AblationResult.effects`` filtered to one component, mode and metric, or
    ``PatchResult.by_phase()`` (one ``pos`` when patched by position); columns ``layer``,
    ``unit`` (or ``head``), ``phase`` and ``value``. A column of :data:`SELECTOR_COLUMNS` with
    several values raises ``ValueError`` naming it. :data:`EFFECT_SCALE` (negative = red),
    ``zmid=0``, range ``[-zmax, zmax]`` (default: the largest ``|value|``). Hover shows the value
    and, when the frame has them, ``95% CI [ci_low, ci_high]`` and ``n`` (``customdata`` columns
    ``ci_low, ci_high, n``; NaN where absent). Missing cells are blank.
    """
    where = "effect_heatmap"
    _need(where, "frame", frame, ["layer", "phase", value])
    unit = _pick(where, "frame", frame, ("unit", "head"))
    multi = [c for c in SELECTOR_COLUMNS if c in frame.columns and frame[c].nunique() > 1]
    if multi:
        vals = {c: sorted(map(str, frame[c].unique())) for c in multi}
        raise ValueError(
            f"{where}: column(s) {multi} hold several values {vals}: filter the frame to one "
            "(component, mode, metric[, pos]) first"
        )
    if frame.duplicated(["layer", unit, "phase"]).any():
        raise ValueError(f"{where}: frame has duplicate (layer, {unit}, phase) rows")
    if len(frame) == 0:
        raise ValueError(f"{where}: frame is empty")

    def wide(col: str) -> pd.DataFrame:
        return (
            frame.pivot(index=["layer", unit], columns="phase", values=col)
            .sort_index()
            .sort_index(axis=1)
        )

    z = wide(value)
    blank = np.full(z.shape, np.nan)
    extra = [
        wide(c).to_numpy(float) if c in frame.columns else blank for c in ("ci_low", "ci_high")
    ]
    extra.append(wide("n").to_numpy(float) if "n" in frame.columns else blank)
    custom = np.stack(extra, axis=-1)
    zv = z.to_numpy(float)
    if zmax is None:
        zmax = float(np.nanmax(np.abs(zv))) if np.isfinite(zv).any() else 1.0
    if not (isinstance(zmax, int | float) and math.isfinite(zmax) and zmax >= 0):
        raise ValueError(f"{where}: zmax={zmax!r} is invalid: expected a finite number >= 0")
    zmax = float(zmax) or 1.0
    rows = [f"L{int(layer)}H{int(u)}" for layer, u in z.index]
    hover = f"%{{y}}<br>phase %{{x}}<br>{value} %{{z:.4f}}"
    if "ci_low" in frame.columns and "ci_high" in frame.columns:
        hover += "<br>95% CI [%{customdata[0]:.4f}, %{customdata[1]:.4f}]"
    if "n" in frame.columns:
        hover += "<br>n %{customdata[2]:.0f}"
    fig = go.Figure(
        go.Heatmap(
            z=zv,
            x=[str(int(p)) for p in z.columns],
            y=rows,
            customdata=custom,
            colorscale=EFFECT_SCALE,
            zmid=0.0,
            zmin=-zmax,
            zmax=zmax,
            colorbar=dict(title=value, thickness=12),
            hovertemplate=hover + "<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="needle phase", type="category")
    fig.update_yaxes(title_text="unit", autorange="reversed", type="category")
    if title is None:
        sel = {c: str(frame[c].iloc[0]) for c in ("metric", "mode", "component") if c in frame}
        title = (
            f"{sel.get('metric', value)} {value}: {sel.get('mode', '')} ablation of "
            f"{sel.get('component', 'unit')}s, by phase"
            if "component" in sel
            else f"{value} by phase"
        )
    return apply_template(fig, width, height or 140 + 22 * len(rows), title)


# --------------------------------------------------------------------------- specialisation


def specialization_scatter(
    spec: pd.DataFrame,
    clusters: pd.DataFrame | None = None,
    title: str | None = None,
    alpha: float = 0.05,
    width: int = COLUMN_WIDTH,
    height: int = 360,
) -> go.Figure:
    """One point per ablated unit: x = ``overall`` effect, y = specialisation index ``si``.

    ``spec``: :func:`phasemech.ablation.specialization` (``layer, unit, overall, si``; hover
    also shows ``served_phase`` and ``p_holm`` when present; filled markers for ``p_holm <
    alpha``, open ones otherwise). ``clusters``: ``HeadClusters.labels`` or any frame with
    ``layer``, ``head`` or ``unit``, ``name``: one trace (colour) per cluster name, units
    without a label in ``"unclustered"``; without it a single trace. Units of several models:
    give both frames a ``model`` column (matched on it, and shown in the hover).
    """
    where = "specialization_scatter"
    _need(where, "spec", spec, ["layer", "unit", "overall", "si"])
    df = spec.copy()
    df["layer"] = df["layer"].astype(int)
    df["unit"] = df["unit"].astype(int)
    if clusters is not None:
        _need(where, "clusters", clusters, ["layer", "name"])
        cu = _pick(where, "clusters", clusters, ("unit", "head"))
        # units of several models: (model, layer, unit) when both frames name the model
        keys = ["model"] if "model" in df.columns and "model" in clusters.columns else []
        lab = clusters[[*keys, "layer", cu, "name"]].rename(columns={cu: "unit"})
        lab = lab.astype({"layer": int, "unit": int}).drop_duplicates([*keys, "layer", "unit"])
        df = df.merge(lab, on=[*keys, "layer", "unit"], how="left")
        df["name"] = df["name"].astype(object).where(df["name"].notna(), "unclustered")
    else:
        df["name"] = "unit"
    for col in ("served_phase", "p_holm"):
        if col not in df.columns:
            df[col] = np.nan
    names = list(dict.fromkeys(df["name"]))
    fig = go.Figure()
    for i, name in enumerate(names):
        sub = df[df["name"] == name]
        p = pd.to_numeric(sub["p_holm"], errors="coerce").to_numpy(float)
        served = sub["served_phase"].astype(object).where(sub["served_phase"].notna(), "-")
        color = {"flat": FLAT_COLOR, "unclustered": UNCLUSTERED_COLOR}.get(
            str(name), OTHER_COLORS[i % len(OTHER_COLORS)]
        )
        if clusters is None:
            color = "#333333"
        fig.add_trace(
            go.Scatter(
                x=sub["overall"].to_numpy(float),
                y=sub["si"].to_numpy(float),
                mode="markers",
                name=str(name),
                showlegend=clusters is not None,
                marker=dict(
                    color=color,
                    size=9,
                    symbol=["circle" if q < alpha else "circle-open" for q in p],
                    line=dict(width=1.5, color=color),
                ),
                customdata=np.c_[
                    sub["layer"],
                    sub["unit"],
                    served.to_numpy(),
                    p,
                    sub["model"] if "model" in sub.columns else np.full(len(sub), ""),
                ],
                hovertemplate=(
                    "%{customdata[4]} L%{customdata[0]}H%{customdata[1]}<br>overall %{x:.4f}"
                    "<br>si %{y:.3f}"
                    "<br>served phase %{customdata[2]}<br>p_holm %{customdata[3]:.3g}"
                    f"<br>cluster {name}<extra></extra>"
                ),
            )
        )
    fig.add_vline(x=0, line=dict(color="#999999", width=1, dash=MEAN_DASH))
    fig.update_xaxes(title_text="overall effect (ablated - intact)")
    fig.update_yaxes(title_text="specialisation index", range=[-0.02, 1.02])
    return apply_template(
        fig,
        width,
        height,
        title or f"Phase specialisation of units (filled: Holm p < {alpha:g})",
    )


# --------------------------------------------------------------------------- training


def training_dynamics(
    metrics: Sequence[Mapping[str, Any]] | pd.DataFrame,
    stride: int,
    title: str | None = None,
    width: int = COLUMN_WIDTH,
    height: int = 340,
) -> go.Figure:
    """Held-out accuracy per needle phase over training steps.

    ``metrics``: :func:`phasemech.train.read_metrics` rows (or a frame of them) with ``step``,
    ``accuracy_by_phase`` (a list of ``stride`` values) and ``accuracy``; rows without
    ``accuracy_by_phase`` (e.g. the ``"done"`` line) are skipped. Traces: one line per phase
    (colours from :data:`PHASE_SCALE`, phase order), then the overall accuracy as a thick dark
    line.
    """
    where = "training_dynamics"
    d = _check_stride(where, stride)
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
    rows = sorted(rows, key=lambda r: r["step"])
    steps = np.array([r["step"] for r in rows])
    by = []
    for r in rows:
        v = r["accuracy_by_phase"]
        if len(v) != d:
            raise ValueError(
                f"{where}: accuracy_by_phase at step {r['step']} has {len(v)} values, "
                f"not stride={d}"
            )
        by.append([math.nan if x is None else float(x) for x in v])
    acc = np.array(by, dtype=float)  # [step, phase]
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


# --------------------------------------------------------------------------- token pattern


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
    _need(where, "frame", frame, need)
    fig = go.Figure()
    for i, key in enumerate(dict.fromkeys(frame[series])):
        sub = frame[frame[series] == key].sort_values(x)
        label = str(key)
        color, dash, symbol = _style(label, i)
        xs = sub[x].to_numpy()
        if band is not None:
            lo, hi = sub[band[0]].to_numpy(float), sub[band[1]].to_numpy(float)
            fig.add_trace(
                go.Scatter(
                    x=np.r_[xs, xs[::-1]],
                    y=np.r_[hi, lo[::-1]],
                    **_band_style(label, color),
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
    _need(where, "frame", frame, [x, y, series])
    fig = go.Figure()
    for i, key in enumerate(dict.fromkeys(frame[series])):
        sub = frame[frame[series] == key]
        color, _, symbol = _style(str(key), i)
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


__all__ = [
    "COLUMN_WIDTH",
    "DESIGN_COLORS",
    "DESIGN_DASH",
    "DESIGN_SYMBOL",
    "EFFECT_SCALE",
    "FONT",
    "PHASE_SCALE",
    "apply_template",
    "attention_pattern_phases",
    "design_of",
    "effect_heatmap",
    "head_phase_heatmap",
    "per_phase_accuracy",
    "per_phase_polar",
    "prediction_scatter",
    "specialization_scatter",
    "theory_curves",
    "training_dynamics",
]
