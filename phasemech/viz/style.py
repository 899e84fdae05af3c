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

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.colors as pcolors
import plotly.graph_objects as go

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


def series_style(label: str, i: int) -> tuple[str, str, str]:
    """(colour, dash, marker symbol) of the ``i``-th series, by design when the label names one."""
    d = design_of(label)
    if d is not None:
        return DESIGN_COLORS[d], DESIGN_DASH[d], DESIGN_SYMBOL[d]
    return (
        OTHER_COLORS[i % len(OTHER_COLORS)],
        _OTHER_DASH[i % len(_OTHER_DASH)],
        _OTHER_SYMBOL[i % len(_OTHER_SYMBOL)],
    )


def rgba(color: str, alpha: float) -> str:
    """``color`` (hex or ``rgb(...)``) as an ``rgba(...)`` string of opacity ``alpha``."""
    r, g, b = pcolors.hex_to_rgb(color) if color.startswith("#") else pcolors.unlabel_rgb(color)
    return f"rgba({int(r)},{int(g)},{int(b)},{alpha})"


def band_style(label: str, color: str) -> dict[str, Any]:
    """Trace settings of a shaded 95% band (no line, no hover, grouped with its curve)."""
    return dict(
        fill="toself",
        fillcolor=rgba(color, 0.18),
        mode="lines",
        line=dict(width=0),
        hoverinfo="skip",
        showlegend=False,
        legendgroup=label,
        name=f"{label} 95% CI",
    )


def check_stride(where: str, stride: Any, low: int = 2) -> int:
    """``stride`` as an int >= ``low``, else a ValueError naming ``where``."""
    if isinstance(stride, bool) or not isinstance(stride, int | np.integer) or stride < low:
        raise ValueError(f"{where}: stride={stride!r} is invalid: expected an int >= {low}")
    return int(stride)


def need_columns(where: str, name: str, frame: Any, columns: Sequence[str]) -> None:
    """Refuse ``frame`` unless it is a DataFrame with ``columns`` (``name`` names it)."""
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"{where}: {name} is a {type(frame).__name__}: expected a DataFrame")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{where}: {name} lacks column(s) {missing}; got {list(map(str, frame.columns))}"
        )


def plain_scalar(v: Any) -> Any:
    """A numpy scalar as its Python value (for error messages)."""
    return v.item() if isinstance(v, np.generic) else v


def pick_column(where: str, name: str, frame: pd.DataFrame, options: Sequence[str]) -> str:
    """The first of ``options`` that ``frame`` has as a column, else a ValueError."""
    for c in options:
        if c in frame.columns:
            return c
    raise ValueError(
        f"{where}: {name} lacks column(s) {list(options)[0]!r} (or {list(options)[1:]}); "
        f"got {list(map(str, frame.columns))}"
    )
