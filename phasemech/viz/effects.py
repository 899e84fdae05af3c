"""Figures of intervention effects: unit x phase heatmaps and the specialisation scatter.

Axes: ``layer, unit, phase``. Inputs are the tidy frames of ``phasemech.interventions``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from phasemech.viz.style import (
    COLUMN_WIDTH,
    EFFECT_SCALE,
    FLAT_COLOR,
    MEAN_DASH,
    OTHER_COLORS,
    UNCLUSTERED_COLOR,
    apply_template,
    need_columns,
    pick_column,
)

#: columns that select one analysis out of a tidy effects frame; several values = ambiguous
SELECTOR_COLUMNS = ("component", "mode", "metric", "pos", "unit_kind", "site", "design")


def _check_effects(where: str, frame: pd.DataFrame, value: str) -> str:
    """The unit column (``unit`` or ``head``) of a frame holding one analysis."""
    need_columns(where, "frame", frame, ["layer", "phase", value])
    unit = pick_column(where, "frame", frame, ("unit", "head"))
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
    return unit


def _effect_grid(frame: pd.DataFrame, unit: str, value: str) -> tuple[pd.DataFrame, np.ndarray]:
    """``value`` as (layer, unit) x phase, and the ``ci_low, ci_high, n`` hover data of every
    cell (NaN where the frame lacks the column)."""

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
    return z, np.stack(extra, axis=-1)


def _check_zmax(where: str, zmax: float | None, zv: np.ndarray) -> float:
    if zmax is None:
        zmax = float(np.nanmax(np.abs(zv))) if np.isfinite(zv).any() else 1.0
    if not (isinstance(zmax, int | float) and math.isfinite(zmax) and zmax >= 0):
        raise ValueError(f"{where}: zmax={zmax!r} is invalid: expected a finite number >= 0")
    return float(zmax) or 1.0  # an all-zero table still needs a non-empty colour range


def _effect_hover(frame: pd.DataFrame, value: str) -> str:
    hover = f"%{{y}}<br>phase %{{x}}<br>{value} %{{z:.4f}}"
    if "ci_low" in frame.columns and "ci_high" in frame.columns:
        hover += "<br>95% CI [%{customdata[0]:.4f}, %{customdata[1]:.4f}]"
    if "n" in frame.columns:
        hover += "<br>n %{customdata[2]:.0f}"
    return hover + "<extra></extra>"


def _effect_title(frame: pd.DataFrame, value: str) -> str:
    sel = {c: str(frame[c].iloc[0]) for c in ("metric", "mode", "component") if c in frame}
    if "component" not in sel:
        return f"{value} by phase"
    return (
        f"{sel.get('metric', value)} {value}: {sel.get('mode', '')} ablation of "
        f"{sel.get('component', 'unit')}s, by phase"
    )


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
    unit = _check_effects(where, frame, value)
    z, custom = _effect_grid(frame, unit, value)
    zv = z.to_numpy(float)
    zmax = _check_zmax(where, zmax, zv)
    rows = [f"L{int(layer)}H{int(u)}" for layer, u in z.index]
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
            hovertemplate=_effect_hover(frame, value),
        )
    )
    fig.update_xaxes(title_text="needle phase", type="category")
    fig.update_yaxes(title_text="unit", autorange="reversed", type="category")
    title = _effect_title(frame, value) if title is None else title
    return apply_template(fig, width, height or 140 + 22 * len(rows), title)


# --------------------------------------------------------------------------- specialisation


def _label_units(where: str, spec: pd.DataFrame, clusters: pd.DataFrame | None) -> pd.DataFrame:
    """``spec`` with a ``name`` per unit (its cluster, ``"unclustered"`` or ``"unit"``) and
    ``served_phase``, ``p_holm`` (NaN where ``spec`` lacks them)."""
    need_columns(where, "spec", spec, ["layer", "unit", "overall", "si"])
    df = spec.copy()
    df["layer"] = df["layer"].astype(int)
    df["unit"] = df["unit"].astype(int)
    if clusters is not None:
        need_columns(where, "clusters", clusters, ["layer", "name"])
        cu = pick_column(where, "clusters", clusters, ("unit", "head"))
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
    return df


def _cluster_color(name: object, i: int, clustered: bool) -> str:
    if not clustered:
        return "#333333"
    return {"flat": FLAT_COLOR, "unclustered": UNCLUSTERED_COLOR}.get(
        str(name), OTHER_COLORS[i % len(OTHER_COLORS)]
    )


def _units_trace(
    sub: pd.DataFrame, name: object, color: str, alpha: float, clustered: bool
) -> go.Scatter:
    """The units of one cluster; filled markers for ``p_holm < alpha``."""
    p = pd.to_numeric(sub["p_holm"], errors="coerce").to_numpy(float)
    served = sub["served_phase"].astype(object).where(sub["served_phase"].notna(), "-")
    return go.Scatter(
        x=sub["overall"].to_numpy(float),
        y=sub["si"].to_numpy(float),
        mode="markers",
        name=str(name),
        showlegend=clustered,
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


def specialization_scatter(
    spec: pd.DataFrame,
    clusters: pd.DataFrame | None = None,
    title: str | None = None,
    alpha: float = 0.05,
    width: int = COLUMN_WIDTH,
    height: int = 360,
) -> go.Figure:
    """One point per ablated unit: x = ``overall`` effect, y = specialisation index ``si``.

    ``spec``: :func:`phasemech.interventions.ablation.specialization` (``layer, unit, overall, si``;
    hover also shows ``served_phase`` and ``p_holm`` when present; filled markers for ``p_holm <
    alpha``, open ones otherwise). ``clusters``: ``HeadClusters.labels`` or any frame with
    ``layer``, ``head`` or ``unit``, ``name``: one trace (colour) per cluster name, units
    without a label in ``"unclustered"``; without it a single trace. Units of several models:
    give both frames a ``model`` column (matched on it, and shown in the hover).
    """
    where = "specialization_scatter"
    df = _label_units(where, spec, clusters)
    clustered = clusters is not None
    fig = go.Figure()
    for i, name in enumerate(dict.fromkeys(df["name"])):
        color = _cluster_color(name, i, clustered)
        fig.add_trace(_units_trace(df[df["name"] == name], name, color, alpha, clustered))
    fig.add_vline(x=0, line=dict(color="#999999", width=1, dash=MEAN_DASH))
    fig.update_xaxes(title_text="overall effect (ablated - intact)")
    fig.update_yaxes(title_text="specialisation index", range=[-0.02, 1.02])
    return apply_template(
        fig,
        width,
        height,
        title or f"Phase specialisation of units (filled: Holm p < {alpha:g})",
    )
