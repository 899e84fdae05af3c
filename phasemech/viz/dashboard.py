"""The interactive head-attribution dashboard: ONE self-contained HTML page, rendered from
panels (:mod:`phasemech.experiments.showcase.panels` computes them from trained runs; nothing
here runs a model).

Axes: ``layer, head, phase`` (phase = the needle's offset in its compression chunk on the model's
reference grid), ``pos`` / ``key_pos`` for the example pattern.

:func:`render_dashboard` writes the panels as JSON into one HTML page with plotly.js inlined
(works offline, can be sent by email): pick design / stride / model, a head x phase heatmap
(ablation effect or attention mass); clicking a head cell fills the side panels with that head's
per-phase attention mass, its ablation effect by phase with CIs and its example pattern; a phase
slider highlights one phase in every view; a summary strip gives accuracy, per-phase accuracy
and the debiased gap with its CI.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phasemech.viz.style import EFFECT_SCALE, PHASE_SCALE


def example_target(panel: dict[str, Any], phase: int | None) -> tuple[int, int, int]:
    """``(example, needle, query)``: the farthest target whose needle has ``phase`` (on the
    panel's grid), first example first; else the first example's farthest target."""
    ex = panel["example"]
    d, off = ex["stride"], ex["grid_offset"]
    if phase is not None:
        for i, e in enumerate(ex["examples"]):
            for needle, query in e["targets"]:
                if (needle - off) % d == phase:
                    return i, needle, query
    needle, query = ex["examples"][0]["targets"][0]
    return 0, needle, query


def head_rank_key(head: dict[str, Any], alpha: float = 0.05) -> tuple[bool, float]:
    """How phase-specialised a panel head is: significant (Holm p < ``alpha``) first, then the
    range of its per-phase ablation effect (a head that barely matters has a small range even
    when its specialisation index is high)."""
    p = head.get("p_holm")
    return (p is not None and p < alpha, float(head.get("effect_range") or 0.0))


_ASSETS = Path(__file__).with_name("dashboard_assets")


def render_dashboard(
    panels: Sequence[dict[str, Any]],
    title: str = "phasemech dashboard",
    initial: str | None = None,
) -> str:
    """One self-contained HTML page (plotly.js, data, script and style inlined), opening on the
    model named ``initial`` (default: the first)."""
    from plotly.offline import get_plotlyjs

    if not panels:
        raise ValueError("render_dashboard: no panels: nothing to show")
    names = [p["name"] for p in panels]
    if initial is not None and initial not in names:
        raise ValueError(f"render_dashboard: initial={initial!r} is not one of {names}")
    data = json.dumps(
        {
            "title": title,
            "models": list(panels),
            "initial": None if initial is None else names.index(initial),
            # the template's scales, so the page's colours match the static figures
            "phase_scale": _rgb_scale(PHASE_SCALE),
            "effect_scale": _rgb_scale(EFFECT_SCALE),
        },
        allow_nan=False,
    )
    # "<" as \u003c: no "</script>" or "<!--" inside a string can end or confuse the script
    # element (JSON reads \u003c back as "<")
    data = data.replace("<", "\\u003c")
    page = (_ASSETS / "dashboard.html").read_text()
    parts = {
        "TITLE": html_escape(title),
        "STYLE": (_ASSETS / "dashboard.css").read_text(),
        "PLOTLYJS": get_plotlyjs(),
        "DATA": data,
        "SCRIPT": (_ASSETS / "dashboard.js").read_text(),
    }
    # one pass: a placeholder inside an inserted part (a title, plotly.js) is left alone
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], page)


def _rgb_scale(name: str) -> list[list[Any]]:
    """A named plotly colour scale as ``[[t, "rgb(r,g,b)"], ...]`` (what plotly.js draws)."""
    import plotly.colors as pcolors

    scale = pcolors.get_colorscale(name)
    colors = pcolors.convert_colors_to_same_type([c for _, c in scale], colortype="rgb")[0]
    return [[float(t), c] for (t, _), c in zip(scale, colors, strict=True)]


def html_escape(s: str) -> str:
    """``s`` with ``&``, ``<`` and ``>`` escaped, to put in HTML text."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


__all__ = ["example_target", "head_rank_key", "html_escape", "render_dashboard"]
