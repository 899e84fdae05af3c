"""plotly figures. Every function returns a ``go.Figure`` and never calls ``.show()``.

Axes: ``layer, head, phase``. Figures read results computed elsewhere (``PhaseAttention``,
tidy frames); they never run a model.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phasemech.phase import PhaseAttention

#: one template for every phasemech figure: paper-column width, readable in greyscale
FONT = dict(family="Helvetica, Arial, sans-serif", size=12)
PHASE_SCALE = "Cividis"  # perceptually uniform and monotone in lightness: survives greyscale


def head_phase_heatmap(
    pa: PhaseAttention,
    title: str | None = None,
    layer_names: dict[int, str] | None = None,
) -> go.Figure:
    """Heatmap per layer: rows heads, columns source phase, colour = attention mass.

    For ``kind="query_mean"`` each row sums to 1 and ``1/stride`` is "no phase preference"; for
    ``kind="pair"`` a cell is the mean mass from the answer position onto needles of that phase.
    Hover shows the value and ``n``; approximate (gradient-attributed) layers are marked.
    """
    frame = pa.frame
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
    what = "mean over queries" if pa.kind == "query_mean" else "answer -> needle"
    fig.update_layout(
        title=title or f"Attention mass by source phase ({what}, stride {pa.stride})",
        font=FONT,
        template="simple_white",
        width=max(360, 260 * len(layers) + 120),
        height=120 + 34 * int(frame["head"].nunique()) + 80,
        margin=dict(l=60, r=20, t=70, b=50),
    )
    return fig
