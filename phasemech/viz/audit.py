"""The per-phase retrieval audit of a compressed pretrained model (``phasemech audit``): three
figures and ONE self-contained HTML page.

Axes: ``setting`` (``"null"`` is the uncompressed model, every other value a compressed
variant), ``phase`` (the needle's offset inside its fixed-stride compression chunk,
``0..stride-1``), ``depth`` (the needle's relative position in the context, in [0, 1]),
``layer``, ``head``.

Inputs are tables computed elsewhere; nothing here runs a model:

* ``per_phase``: ``setting, phase, n, accuracy, boot_lo, boot_hi`` (95% cluster-bootstrap CI);
* ``depth_phase``: ``setting, depth, phase, n, accuracy``;
* ``head_phase``: ``setting, layer, head, phase, mass`` (mean attention from the position that
  predicts the first answer token onto the needle's first token);
* ``summary``: ``title, model, task, regime ("trained" | "decode"), context, stride, contents,
  settings``; ``settings`` holds one dict per compressed setting (:data:`SETTING_KEYS`).

:func:`audit_figures` draws one setting against the null: ``"accuracy"`` (accuracy by phase
with 95% bands), ``"depth"`` (depth x phase accuracy, setting | null), ``"heads"`` (head x phase
attention mass). :func:`render_audit` puts the figures of every compressed setting, a summary
strip and a setting picker into one page (plotly.js and the data inlined); clicking a cell of
the head heatmap shows that head's mass by phase, null against setting, in a side panel.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phasemech.core.designs import REGIMES
from phasemech.core.io import json_safe, write_text_atomic
from phasemech.viz.dashboard import html_escape
from phasemech.viz.phase import per_phase_accuracy
from phasemech.viz.style import (
    DESIGN_COLORS,
    PHASE_SCALE,
    apply_template,
    check_stride,
    need_columns,
    plain_scalar,
    rgba,
    series_style,
)

NULL = "null"
#: the dense reference keeps its colour of every other figure (black)
NULL_COLOR = DESIGN_COLORS["none"]
FRAME_COLUMNS: dict[str, tuple[str, ...]] = {
    "per_phase": ("setting", "phase", "n", "accuracy", "boot_lo", "boot_hi"),
    "depth_phase": ("setting", "depth", "phase", "n", "accuracy"),
    "head_phase": ("setting", "layer", "head", "phase", "mass"),
}
#: the columns that name one row of a frame (the others are its values)
_KEYS = ("setting", "depth", "layer", "head", "phase")
SUMMARY_KEYS = ("title", "model", "task", "regime", "context", "stride", "contents", "settings")
SETTING_KEYS = tuple(
    "setting description accuracy acc_by_phase debiased_gap gap_lo gap_hi p_perm p_cochran "
    "average_claim".split()
)
_ASSETS = Path(__file__).with_name("audit_assets")


# --------------------------------------------------------------------------- validation


def _check_col(
    where: str, name: str, frame: pd.DataFrame, col: str, top: float, integer: bool = False
) -> None:
    """Every value of ``col`` in ``[0, top]`` (an int when ``integer``; NaN only for ``mass``),
    else a ValueError naming the first bad one."""
    v = pd.to_numeric(frame[col], errors="coerce").to_numpy(float)
    ok = (v >= -1e-9) & (v <= top + 1e-9) & ((v == np.round(v)) | (not integer))
    bad = ~(ok | (np.isnan(v) & (col == "mass")))
    if bad.any():
        want = f"an int in 0..{int(top)}" if integer else f"a number in [0, {top:g}]"
        first = plain_scalar(frame[col].to_numpy()[bad][0])
        raise ValueError(f"{where}: {name} has {col} {first!r}: expected {want}")


def _check_frame(where: str, name: str, frame: Any, d: int) -> pd.DataFrame:
    """``frame`` checked, with ``setting`` as str and ``phase`` as int."""
    need_columns(where, name, frame, FRAME_COLUMNS[name])
    _check_col(where, name, frame, "phase", d - 1, integer=True)
    frame = frame.assign(setting=frame["setting"].astype(str), phase=frame["phase"].astype(int))
    keys = [c for c in FRAME_COLUMNS[name] if c in _KEYS]
    dup = frame.duplicated(keys)
    if dup.any():
        row = frame.loc[dup, keys].iloc[0]
        raise ValueError(f"{where}: {name} has two rows for {json_safe(row.to_dict())}")
    if NULL not in set(frame["setting"]):
        raise ValueError(
            f"{where}: {name} has no setting 'null' (the uncompressed model); got "
            f"{sorted(set(frame['setting']))}"
        )
    return frame


def _frames(
    where: str, per_phase: Any, depth_phase: Any, head_phase: Any, d: int
) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """The checked frames by name and the compressed settings (in ``per_phase`` order)."""
    raw = dict(zip(FRAME_COLUMNS, (per_phase, depth_phase, head_phase), strict=True))
    frames = {name: _check_frame(where, name, f, d) for name, f in raw.items()}
    settings = [s for s in pd.unique(frames["per_phase"]["setting"]) if s != NULL]
    if not settings:
        raise ValueError(f"{where}: per_phase has only the 'null' setting: nothing compressed")
    for name in ("depth_phase", "head_phase"):
        missing = [s for s in settings if s not in set(frames[name]["setting"])]
        if missing:
            raise ValueError(f"{where}: {name} lacks setting(s) {missing} of per_phase")
    _check_col(where, "depth_phase", frames["depth_phase"], "depth", 1.0)
    _check_col(where, "head_phase", frames["head_phase"], "mass", 1.0)
    return frames, settings


def _check_setting(where: str, setting: Any, settings: list[str]) -> str:
    if setting == NULL:
        raise ValueError(
            f"{where}: setting='null' is the uncompressed model: pick one of {settings}"
        )
    if setting not in settings:
        raise ValueError(f"{where}: setting={setting!r} is not one of {settings}")
    return str(setting)


def _check_summary(where: str, summary: Any, settings: list[str], d: int) -> dict[str, dict]:
    """The summary entry of every compressed setting, by setting."""
    entries: dict[str, dict] = {}
    if not isinstance(summary["settings"], list | tuple):
        raise ValueError(f"{where}: summary['settings'] is a {type(summary['settings']).__name__}")
    for i, e in enumerate(summary["settings"]):
        if not isinstance(e, Mapping):
            raise ValueError(f"{where}: summary['settings'][{i}] is a {type(e).__name__}")
        missing = [k for k in SETTING_KEYS if k not in e]
        if missing:
            raise ValueError(f"{where}: summary['settings'][{i}] lacks key(s) {missing}")
        entries[str(e["setting"])] = dict(
            e, acc_by_phase=[plain_scalar(a) for a in e["acc_by_phase"]]
        )
    for s in settings:
        if s not in entries:
            raise ValueError(f"{where}: summary['settings'] has no entry for setting {s!r}")
        if len(entries[s]["acc_by_phase"]) != d:
            raise ValueError(
                f"{where}: summary entry {s!r} has {len(entries[s]['acc_by_phase'])} "
                f"acc_by_phase values: expected stride={d}"
            )
    return entries


def _summary_stride(where: str, summary: Any) -> int:
    if not isinstance(summary, Mapping):
        raise ValueError(f"{where}: summary is a {type(summary).__name__}: expected a dict")
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise ValueError(f"{where}: summary lacks key(s) {missing}")
    if summary["regime"] not in REGIMES:
        raise ValueError(
            f"{where}: summary regime={summary['regime']!r}: expected one of {REGIMES}"
        )
    return check_stride(where, summary["stride"])


# --------------------------------------------------------------------------- figures


def _text(s: str) -> str:
    """A name as plotly text: plotly.js reads "<" as markup and decodes entities back."""
    return html_escape(str(s))


def _accuracy_figure(per_phase: pd.DataFrame, d: int, setting: str) -> go.Figure:
    """Traces: setting band, line, mean; then the same for the null (black)."""
    label = _text(setting)
    series = {
        label: per_phase[per_phase.setting == setting],
        NULL: per_phase[per_phase.setting == NULL],
    }
    title = f"Accuracy by needle phase: {label} vs null (stride {d}); dotted: mean"
    fig = per_phase_accuracy(series, d, title=title, width=620, height=360)
    for trace in fig.data:
        if trace.legendgroup == NULL:  # the dense reference in its colour of every figure
            if trace.fill == "toself":
                trace.fillcolor = rgba(NULL_COLOR, 0.12)
            else:  # solid with circles: the reference, as "none" in every figure
                trace.line.color = trace.marker.color = NULL_COLOR
                if trace.mode == "lines+markers":
                    trace.line.dash, trace.marker.symbol = "solid", "circle"
    return fig


def phase_heatmap(z: Any, y: list[str], custom: Any, zmax: float, bar: str, hover: str, **kw: Any):
    """A phase-column heatmap in the phase colour scale, ``0..zmax``."""
    kw.update(zmin=0.0, zmax=zmax, xgap=1, colorscale=PHASE_SCALE, hovertemplate=hover)
    bar_ = dict(title=bar, thickness=12)
    return go.Heatmap(
        z=z, x=list(range(np.shape(z)[1])), y=y, customdata=custom, colorbar=bar_, **kw
    )


def _depth_figure(depth_phase: pd.DataFrame, d: int, setting: str) -> go.Figure:
    """Two heatmaps (setting | null), rows depth (shared), columns phase, colour accuracy."""
    rows = depth_phase[depth_phase.setting.isin([setting, NULL])]
    depths = np.sort(rows["depth"].astype(float).unique())
    y = [f"{x:.3g}" for x in depths]
    names = [_text(setting), "null (uncompressed)"]
    fig = make_subplots(
        rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.05, subplot_titles=names
    )
    for col, (s, name) in enumerate(zip((setting, NULL), names, strict=True), start=1):
        df = rows[rows.setting == s].assign(depth=lambda f: f["depth"].astype(float))
        acc = df.pivot(index="depth", columns="phase", values="accuracy")
        n = df.pivot(index="depth", columns="phase", values="n")
        acc, n = (t.reindex(index=depths, columns=range(d)) for t in (acc, n))
        hover = (
            f"{name}<br>depth %{{y}}<br>phase %{{x}}<br>accuracy %{{z:.3f}}<br>n %{{customdata}}"
        )
        z, custom = acc.to_numpy(float), n.to_numpy(float)
        trace = phase_heatmap(
            z, y, custom, 1.0, "accuracy", hover + "<extra></extra>", showscale=col == 2
        )
        fig.add_trace(trace, row=1, col=col)
        fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), row=1, col=col)
    fig.update_yaxes(title_text="needle depth", type="category", autorange="reversed", row=1, col=1)
    height = max(300, min(900, 140 + 26 * len(depths)))
    return apply_template(fig, 760, height, f"Accuracy by needle depth and phase (stride {d})")


def _head_grid(head_phase: pd.DataFrame, d: int, setting: str) -> dict[str, Any]:
    """The setting's heads (sorted by layer, head): ``labels``, ``layer``, ``head``, ``mass``
    and the null's ``null_mass`` on the same rows (``[head, phase]``, NaN where missing)."""
    df = head_phase.assign(
        layer=head_phase["layer"].astype(int), head=head_phase["head"].astype(int)
    )
    wide = df[df.setting == setting].pivot(index=["layer", "head"], columns="phase", values="mass")
    wide = wide.sort_index().reindex(columns=range(d))
    null = df[df.setting == NULL].pivot(index=["layer", "head"], columns="phase", values="mass")
    null = null.reindex(index=wide.index, columns=range(d))
    layers, heads = (wide.index.get_level_values(k).to_numpy(int) for k in ("layer", "head"))
    return dict(
        labels=[f"L{a}H{b}" for a, b in zip(layers, heads, strict=True)],
        layer=layers.tolist(),
        head=heads.tolist(),
        mass=wide.to_numpy(float),
        null_mass=null.to_numpy(float),
    )


def _heads_figure(head_phase: pd.DataFrame, d: int, setting: str) -> go.Figure:
    """One heatmap: rows ``L{layer}H{head}``, columns phase, colour the setting's mass (one
    colour range for every setting of ``head_phase``); hover adds the null's mass."""
    g = _head_grid(head_phase, d, setting)
    top = float(np.nanmax(head_phase["mass"].to_numpy(float), initial=0.0))
    hover = "%{y} phase %{x}<br>mass on needle %{z:.3f}<br>null %{customdata:.3f}<extra></extra>"
    ygap = 1 if len(g["labels"]) <= 60 else 0
    fig = go.Figure(
        phase_heatmap(g["mass"], g["labels"], g["null_mass"], top or 1.0, "mass", hover, ygap=ygap)
    )
    fig.update_xaxes(title_text="needle phase", tickvals=list(range(d)), fixedrange=True)
    fig.update_yaxes(title_text="layer.head", type="category", autorange="reversed")
    height = max(300, min(1400, 120 + 22 * len(g["labels"])))
    title = f"Attention from the answer onto its needle: {_text(setting)}"
    return apply_template(fig, 560, height, title)


def _figures(frames: dict[str, pd.DataFrame], d: int, setting: str) -> dict[str, go.Figure]:
    return {
        "accuracy": _accuracy_figure(frames["per_phase"], d, setting),
        "depth": _depth_figure(frames["depth_phase"], d, setting),
        "heads": _heads_figure(frames["head_phase"], d, setting),
    }


def audit_figures(
    per_phase: pd.DataFrame,
    depth_phase: pd.DataFrame,
    head_phase: pd.DataFrame,
    stride: int,
    setting: str,
) -> dict[str, go.Figure]:
    """The three audit figures of ``setting`` against the null (frames as in the module doc).

    ``"accuracy"``: :func:`~phasemech.viz.phase.per_phase_accuracy` of the setting then the null
    (black), 6 traces: band, line, mean each. ``"depth"``: two heatmaps, the setting's then the
    null's, ``z[depth, phase]`` (depths: the union of both, ascending, as ``y`` labels).
    ``"heads"``: one heatmap ``z[head, phase]`` of the setting's mass, rows ``L{layer}H{head}``
    sorted by layer then head, ``customdata`` the null's mass on the same cells.
    """
    where = "audit_figures"
    d = check_stride(where, stride)
    frames, settings = _frames(where, per_phase, depth_phase, head_phase, d)
    return _figures(frames, d, _check_setting(where, setting, settings))


# --------------------------------------------------------------------------- the page


def _overall(per_phase: pd.DataFrame, setting: str) -> float | None:
    """The n-weighted accuracy of ``setting`` over its phases."""
    df = per_phase[per_phase.setting == setting]
    acc, n = df["accuracy"].to_numpy(float), df["n"].to_numpy(float)
    ok = np.isfinite(acc) & np.isfinite(n) & (n > 0)
    return float(np.sum(acc[ok] * n[ok]) / np.sum(n[ok])) if ok.any() else None


def _setting_data(
    frames: dict[str, pd.DataFrame], d: int, setting: str, entry: dict[str, Any]
) -> dict[str, Any]:
    """What the page shows of one compressed setting."""
    g = _head_grid(frames["head_phase"], d, setting)
    mass = pd.DataFrame(g["mass"])
    spread = (mass.max(axis=1) - mass.min(axis=1)).fillna(-1.0).to_numpy()
    figures = {k: json.loads(f.to_json()) for k, f in _figures(frames, d, setting).items()}
    return dict(
        name=setting,
        summary=entry,
        colors=dict(setting=series_style(_text(setting), 0)[0], null=NULL_COLOR),
        figures=figures,
        heads=dict(
            labels=g["labels"],
            layer=g["layer"],
            head=g["head"],
            mass=g["mass"].tolist(),
            null_mass=g["null_mass"].tolist(),
            # open on the head whose mass varies most with phase
            initial=g["labels"][int(np.argmax(spread))],
        ),
    )


def render_audit(
    per_phase: pd.DataFrame,
    depth_phase: pd.DataFrame,
    head_phase: pd.DataFrame,
    summary: dict[str, Any],
    setting: str | None = None,
) -> str:
    """One self-contained HTML page (plotly.js, data, script and style inlined; no external
    source), opening on the compressed ``setting`` (default: the first of ``per_phase``).

    Page ids: ``#setting`` (picker; its label ``#setting-picker`` hidden with one setting),
    ``#summary``, ``#claim``, ``#accuracy-plot``, ``#depth-plot``, ``#heads-plot``; the side
    panel ``#head-panel`` with ``#head-title`` (``"L12H3"``), ``#head-numbers`` and
    ``#head-plot``. The data is the JSON of ``<script id="phasemech-data">``.
    """
    where = "render_audit"
    d = _summary_stride(where, summary)
    frames, settings = _frames(where, per_phase, depth_phase, head_phase, d)
    entries = _check_summary(where, summary, settings, d)
    initial = 0 if setting is None else settings.index(_check_setting(where, setting, settings))
    data = {
        "title": str(summary["title"]),
        "meta": {k: summary[k] for k in ("model", "task", "regime", "context", "contents")},
        "stride": d,
        "initial": initial,
        "null_accuracy": _overall(frames["per_phase"], NULL),
        "settings": [_setting_data(frames, d, s, entries[s]) for s in settings],
    }
    return inline_page(str(summary["title"]), data)


def inline_page(
    title: str, data: dict[str, Any], assets: Path = _ASSETS, name: str = "audit"
) -> str:
    """``{name}.html`` of ``assets`` with the title, style (this module's ``audit.css``, then
    ``{name}.css`` where the page has one), plotly.js, ``data`` and ``{name}.js`` inlined."""
    text = json.dumps(json_safe(data), allow_nan=False)
    # "<" as \u003c: no "</script>" or "<!--" inside a string can end or confuse the script
    # element (JSON reads \u003c back as "<")
    text = text.replace("<", "\\u003c")
    from plotly.offline import get_plotlyjs

    style, extra = (_ASSETS / "audit.css").read_text(), assets / f"{name}.css"
    if extra != _ASSETS / "audit.css" and extra.exists():
        style += extra.read_text()
    parts = {
        "TITLE": html_escape(title),
        "STYLE": style,
        "PLOTLYJS": get_plotlyjs(),
        "DATA": text,
        "SCRIPT": (assets / f"{name}.js").read_text(),
    }
    # one pass: a placeholder inside an inserted part (a title, plotly.js) is left alone
    return re.sub(
        r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], (assets / f"{name}.html").read_text()
    )


def write_audit_html(
    path: str | Path,
    per_phase: pd.DataFrame,
    depth_phase: pd.DataFrame,
    head_phase: pd.DataFrame,
    summary: dict[str, Any],
    setting: str | None = None,
) -> Path:
    """:func:`render_audit` written atomically to ``path`` (folders created); returns ``path``."""
    page = render_audit(per_phase, depth_phase, head_phase, summary, setting)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, page)
    return path


__all__ = [
    "FRAME_COLUMNS",
    "NULL",
    "SETTING_KEYS",
    "SUMMARY_KEYS",
    "audit_figures",
    "inline_page",
    "phase_heatmap",
    "render_audit",
    "write_audit_html",
]
