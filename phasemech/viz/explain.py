"""The explanation of a real model's weak phase (``phasemech explain``): its figures and ONE
self-contained HTML page.

Axes: ``layer``, ``head``, ``phase`` (the needle's offset inside its chunk, ``0..stride-1``),
``site`` (what a patch copies: ``head``, ``resid``, ``selection``, ``atp``).

Inputs are the tables :mod:`phasemech.experiments.explain.tables` writes (by name, without
``.parquet``) and its ``summary.json``; nothing here runs a model. Every table but ``prompts``
is optional: a missing one drops its figure.

:func:`explain_figures` returns ``go.Figure`` s: ``"selection"`` (recall of the needle's block
at the answer row, layer x phase), ``"oracle"`` (accuracy by phase with the needle's block
forced, beside the unforced design and the null), ``"oracle_layers"`` (the oracle in one layer
at a time, layer x phase), ``"ablation"`` (zero ablation's effect on the answer's margin, head x
phase), ``"patching"`` (exact head patching and its AtP estimate, layer x head) and
``"patching_layers"`` (residual and selection patching by layer), ``"reader_recall"`` (selection
recall at the heads that read the needle most under the null, beside every selecting head, by
phase), ``"groups"`` (groups of heads ablated together, zero / mean / resample: change of
the answer's margin, group x phase) and ``"decomposition"`` (the needle block's score split
into its needle token's term and the rest, the competitor's score and how often the sink's
block beats the needle, by phase). :func:`render_explain` puts
them on one page; clicking a head in the ablation or patching heatmap shows that head's
per-phase ablation effects with 95% intervals, its patching effect, and its attention onto the
needle under the null and the design.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phasemech.core.io import write_text_atomic
from phasemech.viz.audit import NULL_COLOR, inline_page, phase_heatmap
from phasemech.viz.phase import per_phase_accuracy
from phasemech.viz.style import EFFECT_SCALE, apply_template, need_columns

NEED: dict[str, tuple[str, ...]] = {
    "prompts": ("phase", "design_correct", "null_correct"),
    "selection_recall": ("layer", "phase", "recall", "rank"),
    "oracle": ("scope", "form", "rows", "phase", "accuracy", "ci_low", "ci_high", "unforced"),
    "ablation": ("mode", "metric", "layer", "unit", "phase", "effect", "ci_low", "ci_high"),
    "patching": ("site", "layer", "head", "effect", "ci_low", "ci_high"),
    "head_attention": ("setting", "layer", "head", "phase", "mass"),
    "reader_recall": ("readers", "phase", "recall"),
    "group_ablation": ("group", "mode", "metric", "phase", "effect", "ci_low", "ci_high"),
    "decomposition_phases": (
        "heads",
        "phase",
        "needle_term",
        "rest_term",
        "needle_score",
        "competitor_score",
        "sink_wins",
    ),
}
#: the oracle's forms drawn on the accuracy figure (scope, form, rows)
ORACLE_SHOWN = (("all", "add", "answer"), ("all", "replace", "answer"),
                ("all", "replace", "after"), ("top heads", "replace", "after"))  # fmt: skip


def _checked(tables: dict[str, pd.DataFrame | None]) -> dict[str, pd.DataFrame]:
    where = "explain_figures"
    if tables.get("prompts") is None:
        raise ValueError(f"{where}: tables lack 'prompts' (the design and null answers)")
    out = {}
    for name, cols in NEED.items():
        if tables.get(name) is not None and len(tables[name]):
            need_columns(where, name, tables[name], cols)
            out[name] = tables[name]
    return out


def _stride(t: dict[str, pd.DataFrame]) -> int:
    return int(t["prompts"].phase.max()) + 1


def _selection_figure(rec: pd.DataFrame, d: int) -> go.Figure:
    z = rec.pivot(index="layer", columns="phase", values="recall").reindex(columns=range(d))
    rank = rec.pivot(index="layer", columns="phase", values="rank").reindex_like(z)
    hover = "layer %{y} phase %{x}<br>recall %{z:.2f}<br>median rank %{customdata}<extra></extra>"
    fig = go.Figure(phase_heatmap(z.to_numpy(float), z.index.tolist(), rank.to_numpy(float), 1.0,
                                  "recall", hover))  # fmt: skip
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)))
    fig.update_yaxes(title_text="layer", autorange="reversed", dtick=1)
    title = "Selection recall: needle's block kept at the answer row"
    return apply_template(fig, 560, max(320, 120 + 14 * len(z)), title)


def _oracle_figure(orc: pd.DataFrame, prompts: pd.DataFrame, d: int) -> go.Figure:
    by = prompts.groupby("phase")

    def curve(col: str) -> pd.DataFrame:
        return pd.DataFrame(dict(phase=range(d), accuracy=by[col].mean().reindex(range(d)).values))

    series = {"null": curve("null_correct"), "design (unforced)": curve("design_correct")}
    for scope, form, rows in ORACLE_SHOWN:
        g = orc[(orc.scope == scope) & (orc.form == form) & (orc.rows == rows)]
        if len(g):
            series[f"forced: {form} @ {rows} rows, {scope}"] = g.sort_values("phase")
    fig = per_phase_accuracy(series, d, title="Oracle: accuracy with the needle's block forced",
                             width=620, height=380)  # fmt: skip
    for tr in fig.data:
        if tr.legendgroup == "null" and tr.fill != "toself":
            tr.line.color = tr.marker.color = NULL_COLOR
    return fig


def _oracle_layers_figure(orc: pd.DataFrame, d: int) -> go.Figure | None:
    per = orc[orc.scope.str.startswith("layer ")]
    if per.empty:
        return None
    per = per.assign(layer=per.scope.str.split().str[1].astype(int))
    forms = list(dict.fromkeys(per.form))
    fig = make_subplots(rows=1, cols=len(forms), shared_yaxes=True, subplot_titles=forms)
    for c, form in enumerate(forms, start=1):
        z = per[per.form == form].pivot(index="layer", columns="phase", values="accuracy")
        z = z.reindex(columns=range(d))
        hover = (
            f"{form} in layer %{{y}} alone<br>phase %{{x}}<br>accuracy %{{z:.2f}}<extra></extra>"
        )
        fig.add_trace(phase_heatmap(z.to_numpy(float), z.index.tolist(), None, 1.0, "accuracy",
                                    hover, showscale=c == len(forms)), row=1, col=c)  # fmt: skip
        fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), row=1, col=c)
    fig.update_yaxes(title_text="layer", autorange="reversed", dtick=1, row=1, col=1)
    title = "Oracle in one layer at a time (every row after the needle)"
    return apply_template(fig, 620, max(320, 120 + 14 * per.layer.nunique()), title)


def _head_index(t: dict[str, pd.DataFrame]) -> pd.MultiIndex:
    if "ablation" in t:
        a = t["ablation"]
        keys = a[["layer", "unit"]].drop_duplicates().astype(int).to_numpy()
    else:
        p = t["patching"]
        keys = p.loc[p.site == "head", ["layer", "head"]].drop_duplicates().astype(int).to_numpy()
    return pd.MultiIndex.from_tuples(sorted(map(tuple, keys)), names=["layer", "head"])


def _ablation_wide(t, heads, d: int, mode: str, col: str) -> np.ndarray:
    a = t["ablation"]
    a = a[(a["mode"] == mode) & (a.metric == "logit_diff")].rename(columns={"unit": "head"})
    w = a.pivot_table(index=["layer", "head"], columns="phase", values=col, dropna=False)
    return w.reindex(index=heads, columns=range(d)).to_numpy(float)


def _labels(heads: pd.MultiIndex) -> list[str]:
    return [f"L{a}H{b}" for a, b in heads]


def _ablation_figure(t, heads, d: int) -> go.Figure:
    z = _ablation_wide(t, heads, d, "zero", "effect")
    top = float(np.nanmax(np.abs(z), initial=0.0)) or 1.0
    hover = "%{y} phase %{x}<br>zero ablation: margin %{z:+.3f}<extra></extra>"
    fig = go.Figure(go.Heatmap(z=z, x=list(range(d)), y=_labels(heads), zmid=0, zmin=-top,
                               zmax=top, colorscale=EFFECT_SCALE, hovertemplate=hover,
                               colorbar=dict(title="Δ margin", thickness=12)))  # fmt: skip
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), fixedrange=True)
    fig.update_yaxes(title_text="layer.head", type="category", autorange="reversed")
    title = "Zero ablation of each head: change of the answer's margin"
    return apply_template(fig, 520, max(360, min(1600, 120 + 6 * len(heads))), title)


def _patching_figure(p: pd.DataFrame) -> go.Figure:
    sites = [s for s in ("head", "atp") if s in set(p.site)]
    names = {"head": "exact", "atp": "attribution (AtP)"}
    fig = make_subplots(rows=1, cols=len(sites), shared_yaxes=True,
                        subplot_titles=[names[s] for s in sites])  # fmt: skip
    top = float(p[p.site.isin(sites)].effect.abs().max()) or 1.0
    for c, site in enumerate(sites, start=1):
        z = p[p.site == site].pivot(index="layer", columns="head", values="effect")
        hover = f"{names[site]}<br>L%{{y}}H%{{x}}<br>effect %{{z:+.3f}}<extra></extra>"
        fig.add_trace(
            go.Heatmap(
                z=z.to_numpy(float),
                x=z.columns.tolist(),
                y=z.index.tolist(),
                zmid=0,
                zmin=-top,
                zmax=top,
                colorscale=EFFECT_SCALE,
                hovertemplate=hover,
                showscale=c == len(sites),
                colorbar=dict(title="effect", thickness=12),
            ),
            row=1,
            col=c,
        )
        fig.update_xaxes(title_text="head", dtick=1, row=1, col=c)
    fig.update_yaxes(title_text="layer", autorange="reversed", dtick=1, row=1, col=1)
    title = "Patching each head from the strong phase into the weak (1 = restored)"
    return apply_template(fig, 620, max(360, 120 + 14 * p.layer.nunique()), title)


def _patching_layers_figure(p: pd.DataFrame) -> go.Figure | None:
    fig = go.Figure()
    for site, name in (("resid", "residual stream"), ("selection", "selection")):
        g = p[(p.site == site) & (p.layer >= 0)].sort_values("layer")
        if g.empty:
            continue
        err = dict(type="data", symmetric=False, array=g.ci_high - g.effect,
                   arrayminus=g.effect - g.ci_low)  # fmt: skip
        fig.add_trace(go.Scatter(x=g.layer, y=g.effect, name=name, mode="lines+markers",
                                 error_y=err))  # fmt: skip
    if not fig.data:
        return None
    fig.update_xaxes(title_text="layer", dtick=1 if len(fig.data[0].x) <= 12 else 2)
    fig.update_yaxes(title_text="normalised effect (1 = restored)")
    return apply_template(fig, 620, 340, "Patching a layer's residual stream or its selection")


def _reader_recall_figure(rec: pd.DataFrame, d: int) -> go.Figure:
    fig = go.Figure()
    for name, g in rec.groupby("readers", sort=False):
        g = g.set_index("phase").reindex(range(d))
        which = g.heads.dropna().iloc[0] if "heads" in g and g.heads.notna().any() else ""
        hover = f"{name} {which}<br>phase %{{x}}<br>recall %{{y:.2f}}<extra></extra>"
        fig.add_trace(go.Scatter(x=list(range(d)), y=g.recall.tolist(), name=name,
                                 mode="lines+markers", hovertemplate=hover))  # fmt: skip
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)))
    fig.update_yaxes(title_text="recall of the needle's block", range=[0, 1.02])
    title = "Selection at the heads that read the needle (null's attention), vs every head"
    return apply_template(fig, 620, 340, title)


def _groups_figure(ga: pd.DataFrame, d: int) -> go.Figure:
    g = ga[ga.metric == "logit_diff"]
    modes = [m for m in ("zero", "mean", "resample") if m in set(g["mode"])]
    order = list(dict.fromkeys(g.group))  # top k first, then the layers
    fig = make_subplots(rows=1, cols=len(modes), shared_yaxes=True, subplot_titles=modes)
    top = float(g.effect.abs().max()) or 1.0
    for c, mode in enumerate(modes, start=1):
        m = g[g["mode"] == mode]
        z = m.pivot_table(index="group", columns="phase", values="effect", dropna=False)
        z = z.reindex(index=order, columns=range(d))
        lo = m.pivot_table(index="group", columns="phase", values="ci_low").reindex_like(z)
        hi = m.pivot_table(index="group", columns="phase", values="ci_high").reindex_like(z)
        ci = np.dstack([lo.to_numpy(float), hi.to_numpy(float)])
        hover = (f"%{{y}} ({mode})<br>phase %{{x}}<br>Δ margin %{{z:+.3f}} "
                 "[%{customdata[0]:.3f}, %{customdata[1]:.3f}]<extra></extra>")  # fmt: skip
        fig.add_trace(go.Heatmap(z=z.to_numpy(float), x=list(range(d)), y=order, zmid=0,
                                 zmin=-top, zmax=top, colorscale=EFFECT_SCALE, customdata=ci,
                                 hovertemplate=hover, showscale=c == len(modes),
                                 colorbar=dict(title="Δ margin", thickness=12)),
                      row=1, col=c)  # fmt: skip
        fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), row=1, col=c)
    fig.update_yaxes(type="category", autorange="reversed", row=1, col=1)
    title = "Groups of heads ablated together: change of the answer's margin"
    return apply_template(fig, 720, max(360, 120 + 14 * len(order)), title)


def _decomposition_figure(phases: pd.DataFrame, d: int) -> go.Figure:
    """Per phase: the needle block's score (its needle token's term and the rest of the
    block), the competitor's, and how often the block that beats the needle is the sink's;
    over the needle-reading heads where the table has them, else every head."""
    which = "needle-reading heads" if "needle-reading heads" in set(phases.heads) else "every head"
    m = phases[phases.heads == which].set_index("phase").reindex(range(d))
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.65, 0.35],
        subplot_titles=("scores at the answer row", "misses lost to the sink"),
    )
    for col, name in (
        ("needle_term", "needle token's term"),
        ("rest_term", "rest of its block"),
        ("needle_score", "needle block"),
        ("competitor_score", "competitor"),
    ):
        fig.add_trace(go.Bar(x=list(range(d)), y=m[col], name=name), 1, 1)
    fig.add_trace(go.Bar(x=list(range(d)), y=m.sink_wins, name="competitor = sink",
                         marker_color=NULL_COLOR), 1, 2)  # fmt: skip
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)))
    return apply_template(fig, 820, 360, f"The selection decomposed ({which})")


def explain_figures(tables: dict[str, pd.DataFrame | None]) -> dict[str, go.Figure]:
    """The explanation's figures (module doc), for the tables present."""
    t = _checked(tables)
    d = _stride(t)
    figs: dict[str, go.Figure | None] = {}
    if "selection_recall" in t:
        figs["selection"] = _selection_figure(t["selection_recall"], d)
    if "oracle" in t:
        figs["oracle"] = _oracle_figure(t["oracle"], t["prompts"], d)
        figs["oracle_layers"] = _oracle_layers_figure(t["oracle"], d)
    if "ablation" in t:
        figs["ablation"] = _ablation_figure(t, _head_index(t), d)
    if "decomposition_phases" in t:
        figs["decomposition"] = _decomposition_figure(t["decomposition_phases"], d)
    if "patching" in t:
        figs["patching"] = _patching_figure(t["patching"])
        figs["patching_layers"] = _patching_layers_figure(t["patching"])
    if "reader_recall" in t:
        figs["reader_recall"] = _reader_recall_figure(t["reader_recall"], d)
    if "group_ablation" in t:
        figs["groups"] = _groups_figure(t["group_ablation"], d)
    return {k: f for k, f in figs.items() if f is not None}


# --------------------------------------------------------------------------- the page


def _attention(t, heads, d: int, who: str) -> np.ndarray | None:
    if "head_attention" not in t:
        return None
    a = t["head_attention"]
    w = a[a.setting == who].pivot_table(index=["layer", "head"], columns="phase", values="mass")
    return w.reindex(index=heads, columns=range(d)).to_numpy(float)


def _patch_of(t, heads, site: str) -> dict[str, list] | None:
    if "patching" not in t or site not in set(t["patching"].site):
        return None
    p = t["patching"][t["patching"].site == site].set_index(["layer", "head"])
    p = p.reindex(heads)
    return {k: p[k].to_numpy(float).tolist() for k in ("effect", "ci_low", "ci_high")}


def _heads_data(t: dict[str, pd.DataFrame], d: int) -> dict[str, Any] | None:
    """Per head (rows ``L{layer}H{head}``): ablation effects per phase with intervals, the
    patching effect, attention onto the needle per phase (null, design)."""
    if "ablation" not in t and "patching" not in t:
        return None
    heads = _head_index(t)
    out: dict[str, Any] = dict(labels=_labels(heads), layer=[a for a, _ in heads],
                               head=[b for _, b in heads])  # fmt: skip
    if "ablation" in t:
        for mode in sorted(set(t["ablation"]["mode"])):
            out[mode] = {c: _ablation_wide(t, heads, d, mode, c).tolist()
                         for c in ("effect", "ci_low", "ci_high")}  # fmt: skip
    for who in ("null", "design"):
        att = _attention(t, heads, d, who)
        out[f"attention_{who}"] = None if att is None else att.tolist()
    out["patch"], out["atp"] = _patch_of(t, heads, "head"), _patch_of(t, heads, "atp")
    # open on the head whose exact patch restores most, else the most harmful ablation
    if out["patch"] is not None:
        first = int(np.nanargmax(np.nan_to_num(out["patch"]["effect"], nan=-np.inf)))
    else:
        first = int(np.nanargmin(np.nanmin(np.array(out["zero"]["effect"]), axis=1)))
    out["initial"] = out["labels"][first]
    return out


def render_explain(tables: dict[str, pd.DataFrame | None], summary: dict[str, Any]) -> str:
    """One self-contained HTML page (plotly.js, data, script and style inlined).

    Page ids: ``#meta``, ``#summary`` (with ``#sum-phase-test``: the per-head phase test's
    units and smallest attainable Holm p, ``summary["findings"]["phase_test"]``), one
    ``#{name}-plot`` per figure of :func:`explain_figures`; the side panel ``#head-panel``
    with ``#head-title`` (``"L12H3"``), ``#head-numbers`` (one row per phase: zero and mean
    ablation effect with its interval, attention null and design) and ``#head-plot``. The
    data is the JSON of ``<script id="phasemech-data">``."""
    t = _checked(tables)
    d = _stride(t)
    cfg = summary.get("config", {})
    title = f"Explaining {cfg.get('setting', 'the design')} on {summary.get('model', 'a model')}"
    figs = {k: json.loads(f.to_json()) for k, f in explain_figures(tables).items()}
    data = dict(
        title=title,
        stride=d,
        meta={k: cfg.get(k) for k in ("regime", "context", "contents", "task", "seed")},
        accuracy=summary.get("accuracy_by_phase"),
        null=summary.get("null_by_phase"),
        contrast=summary.get("contrast_phases"),
        n_pairs=summary.get("n_pairs"),
        n_prompts=summary.get("n_prompts", len(t["prompts"])),
        atp_check=summary.get("atp_check"),
        # the per-head phase test's units and smallest attainable Holm p (summary's findings)
        phase_test=summary.get("findings", {}).get("phase_test"),
        figures=figs,
        heads=_heads_data(t, d),
    )
    return inline_page(title, data, Path(__file__).with_name("explain_assets"), "explain")


def write_explain_html(
    path: str | Path, tables: dict[str, pd.DataFrame | None], summary: dict[str, Any]
) -> Path:
    """:func:`render_explain` written atomically to ``path``; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, render_explain(tables, summary))
    return path


__all__ = ["explain_figures", "render_explain", "write_explain_html"]
