"""Figures of ``phasemech.viz`` on small synthetic tables (and one real ablation): trace counts,
the data the traces carry, the template, and the errors on bad input."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.colors as pcolors
import plotly.graph_objects as go
import pytest
import torch
from conftest import make_model

from phasemech import viz
from phasemech.data.tasks import MQARTask, generate
from phasemech.interventions.ablation import ablate
from phasemech.interventions.specialization import specialization
from phasemech.measure.stats import per_phase

torch.set_num_threads(1)

D = 4


def _acc_frame(acc, lo_off=0.05, cols=("acc", "ci_low", "ci_high"), n=None) -> pd.DataFrame:
    acc = np.asarray(acc, float)
    df = pd.DataFrame({"phase": np.arange(len(acc)), cols[0]: acc})
    df[cols[1]], df[cols[2]] = acc - lo_off, acc + lo_off
    if n is not None:
        df["n"] = n
    return df


def _targets(seed: int = 0, n: int = 400) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    phase = rng.integers(0, D, n)
    return pd.DataFrame(
        {
            "correct": rng.random(n) < np.where(phase == 0, 0.4, 0.8),
            "phase": phase,
            "depth": rng.random(n),
            "seq_id": np.arange(n) // 4,
        }
    )


def _effects(n_layers=2, n_units=3, seed=0, **const) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [
        dict(layer=layer, unit=u, phase=p, **const)
        for layer in range(n_layers)
        for u in range(n_units)
        for p in range(D)
    ]
    df = pd.DataFrame(rows)
    df["effect"] = rng.normal(0, 0.1, len(df))
    df["ci_low"], df["ci_high"] = df.effect - 0.02, df.effect + 0.03
    df["n"] = 10 + df.phase
    return df


def _serialises(fig: go.Figure) -> dict:
    assert isinstance(fig, go.Figure)
    out = json.loads(fig.to_json())
    assert out["layout"]["template"]["layout"]  # simple_white travels with the figure
    return out


def _templated(fig: go.Figure) -> None:
    assert fig.layout.font.family == viz.FONT["family"]
    assert fig.layout.width == viz.COLUMN_WIDTH
    assert fig.layout.margin.l == viz.MARGIN["l"]


# ------------------------------------------------------------------------------- template, style


def test_apply_template_and_design_styles():
    fig = viz.apply_template(go.Figure(), width=300, height=200, title="t")
    assert (fig.layout.width, fig.layout.height, fig.layout.title.text) == (300, 200, "t")
    assert fig.layout.font.size == viz.FONT["size"]
    assert fig.layout.template.layout.plot_bgcolor == "white"  # simple_white
    designs = {"none", "mean", "gated", "mlp", "route"}
    assert set(viz.DESIGN_COLORS) == set(viz.DESIGN_DASH) == set(viz.DESIGN_SYMBOL) == designs
    # distinct colours, dashes and markers; none of the dashes is the mean-line dash
    for table in (viz.DESIGN_COLORS, viz.DESIGN_DASH, viz.DESIGN_SYMBOL):
        assert len(set(table.values())) == len(designs)
    assert viz.MEAN_DASH not in viz.DESIGN_DASH.values()
    # greyscale: the luminances of the colours differ pairwise
    lum = sorted(
        0.299 * r + 0.587 * g + 0.114 * b
        for r, g, b in (pcolors.hex_to_rgb(c) for c in viz.DESIGN_COLORS.values())
    )
    assert min(np.diff(lum)) > 10
    assert viz.PHASE_SCALE == "Cividis"
    assert viz.design_of("mean d=4") == "mean" and viz.design_of("MLP") == "mlp"
    assert viz.design_of("baseline") is None


def test_no_show_in_viz():
    """No call to ``.show(...)`` in the module (its docstring may mention it)."""
    tree = ast.parse(Path(viz.__file__).read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "show"
    ]
    assert not calls


# ------------------------------------------------------------------------------- per phase


def test_per_phase_accuracy_traces_band_and_mean():
    a = _acc_frame([0.5, 0.9, 0.9, 0.9])
    b = _acc_frame([0.8, 0.8, 0.6, 0.8])
    fig = viz.per_phase_accuracy({"mean d=4": a, "my run": b}, stride=D)
    out = _serialises(fig)
    _templated(fig)
    assert len(fig.data) == 6 and len(out["data"]) == 6
    band, line, mean = fig.data[:3]
    assert band.fill == "toself" and band.showlegend is False
    np.testing.assert_allclose(band.y, np.r_[a.ci_high, a.ci_low[::-1]])
    np.testing.assert_allclose(band.x, np.r_[a.phase, a.phase[::-1]])
    assert line.mode == "lines+markers" and line.name == "mean d=4"
    np.testing.assert_allclose(line.y, a.acc)
    np.testing.assert_allclose(mean.y, [a.acc.mean()] * 2)
    assert mean.line.dash == viz.MEAN_DASH and mean.name == "mean d=4 mean"
    assert list(mean.x) == [-0.5, D - 0.5]
    # design colour for a design label; another colour (and the legend name) otherwise
    assert line.line.color == viz.DESIGN_COLORS["mean"]
    assert line.line.dash == viz.DESIGN_DASH["mean"]
    assert fig.data[4].name == "my run"
    assert fig.data[4].line.color not in viz.DESIGN_COLORS.values()
    assert "CI" in line.hovertemplate


def test_per_phase_accuracy_reads_stats_per_phase():
    pp = per_phase(_targets(), D, n_boot=50, seed=0)
    fig = viz.per_phase_accuracy({"gated": pp}, stride=D)
    _serialises(fig)
    band, line, mean = fig.data
    np.testing.assert_allclose(line.y, pp.accuracy)
    np.testing.assert_allclose(band.y, np.r_[pp.boot_hi, pp.boot_lo[::-1]])  # bootstrap first
    # n-weighted mean = overall accuracy of the targets
    assert mean.y[0] == pytest.approx(pp.k.sum() / pp.n.sum())
    # without a bootstrap, the Wilson interval is shaded
    wil = per_phase(_targets(), D, n_boot=0)
    band = viz.per_phase_accuracy({"x": wil}, stride=D).data[0]
    np.testing.assert_allclose(band.y, np.r_[wil.wilson_hi, wil.wilson_lo[::-1]])


def test_per_phase_accuracy_without_ci_has_no_band():
    df = pd.DataFrame({"phase": range(D), "accuracy": [0.1, 0.2, 0.3, 0.4]})
    fig = viz.per_phase_accuracy({"none": df}, stride=D)
    assert [t.name for t in fig.data] == ["none", "none mean"]
    assert fig.data[1].y[0] == pytest.approx(0.25)


@pytest.mark.parametrize("fn", [viz.per_phase_accuracy, viz.per_phase_polar])
def test_per_phase_bad_input(fn):
    good = _acc_frame([0.5] * D)
    with pytest.raises(ValueError, match="stride"):
        fn({"a": good}, stride=1)
    with pytest.raises(ValueError, match="stride"):
        fn({"a": good}, stride=True)
    with pytest.raises(ValueError, match="acc"):
        fn({"a": good.drop(columns="acc")}, stride=D)
    with pytest.raises(ValueError, match="phase"):
        fn({"a": good.drop(columns="phase")}, stride=D)
    with pytest.raises(ValueError, match="phase 5"):
        fn({"a": good.assign(phase=[0, 1, 2, 5])}, stride=D)
    with pytest.raises(ValueError, match="series"):
        fn({}, stride=D)


def test_per_phase_polar_closed_loops_and_mean_circle():
    a = _acc_frame([0.5, 0.9, 0.7, 0.9], n=[10, 10, 10, 30])
    fig = viz.per_phase_polar({"route": a, "mlp": a}, stride=D)
    _serialises(fig)
    _templated(fig)
    assert len(fig.data) == 6 and all(t.type == "scatterpolar" for t in fig.data)
    band, loop, circle = fig.data[:3]
    assert band.fill == "toself"
    assert loop.r[0] == loop.r[-1] and loop.theta[0] == loop.theta[-1]  # closed
    np.testing.assert_allclose(loop.theta[:-1], np.arange(D) * 360 / D)
    np.testing.assert_allclose(loop.r[:-1], a.acc)
    expected = np.average(a.acc, weights=a.n)
    np.testing.assert_allclose(circle.r, expected)
    assert circle.theta[0] == 0 and circle.theta[-1] == 360
    assert loop.line.color == viz.DESIGN_COLORS["route"]
    assert fig.layout.polar.angularaxis.direction == "clockwise"


# ------------------------------------------------------------------------------- effect heatmap


def test_effect_heatmap_ablation_frame():
    df = _effects(component="head", mode="zero", metric="accuracy")
    fig = viz.effect_heatmap(df)
    _serialises(fig)
    _templated(fig)
    (hm,) = fig.data
    assert hm.type == "heatmap"
    wide = df.pivot(index=["layer", "unit"], columns="phase", values="effect")
    np.testing.assert_allclose(np.asarray(hm.z), wide.to_numpy())
    assert list(hm.y) == [f"L{la}H{u}" for la, u in wide.index]
    assert list(hm.x) == [str(p) for p in range(D)]
    assert hm.zmid == 0 and hm.zmin == -hm.zmax
    assert hm.zmax == pytest.approx(df.effect.abs().max())
    # negative effects are red: the low end of the scale
    r, g, b = pcolors.unlabel_rgb(hm.colorscale[0][1])
    assert r > b
    cd = np.asarray(hm.customdata, float)
    ci_low = df.pivot(index=["layer", "unit"], columns="phase", values="ci_low").to_numpy()
    n = df.pivot(index=["layer", "unit"], columns="phase", values="n").to_numpy()
    np.testing.assert_allclose(cd[..., 0], ci_low)
    np.testing.assert_allclose(cd[..., 2], n)
    assert "95% CI [%{customdata[0]" in hm.hovertemplate and "n %{customdata[2]" in hm.hovertemplate
    assert "accuracy" in fig.layout.title.text and "zero" in fig.layout.title.text
    # explicit zmax
    hm = viz.effect_heatmap(df, zmax=1.0).data[0]
    assert (hm.zmin, hm.zmax) == (-1.0, 1.0)


def test_effect_heatmap_patching_frame_and_missing_columns():
    df = (
        _effects(n_layers=1)
        .drop(columns=["ci_low", "ci_high", "n"])
        .rename(columns={"unit": "head"})
    )
    df["normalized"] = df.effect * 2
    fig = viz.effect_heatmap(df, value="normalized", title="patch")
    hm = fig.data[0]
    np.testing.assert_allclose(
        np.asarray(hm.z), df.pivot(index="head", columns="phase", values="normalized").to_numpy()
    )
    assert "CI" not in hm.hovertemplate and "n %" not in hm.hovertemplate
    assert fig.layout.title.text == "patch"
    _serialises(fig)


def test_effect_heatmap_bad_input_names_the_column():
    a = _effects(component="head", mode="zero", metric="accuracy")
    both = pd.concat([a, a.assign(metric="logprob"), a.assign(mode="mean", metric="logprob")])
    with pytest.raises(ValueError, match=r"\['mode', 'metric'\]"):
        viz.effect_heatmap(both)
    with pytest.raises(ValueError, match="'pos'"):
        viz.effect_heatmap(pd.concat([a.assign(pos=0), a.assign(pos=1)]))
    with pytest.raises(ValueError, match="'effect'"):
        viz.effect_heatmap(a.drop(columns="effect"))
    with pytest.raises(ValueError, match="'unit'"):
        viz.effect_heatmap(a.drop(columns="unit"))
    with pytest.raises(ValueError, match="'normalized'"):
        viz.effect_heatmap(a, value="normalized")
    with pytest.raises(ValueError, match="duplicate"):
        viz.effect_heatmap(pd.concat([a, a]))
    with pytest.raises(ValueError, match="zmax"):
        viz.effect_heatmap(a, zmax=-1.0)


# ------------------------------------------------------------------------------- specialization


def _spec() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "component": "head",
            "mode": "zero",
            "layer": [0, 0, 1, 1],
            "unit": [0, 1, 0, 1],
            "overall": [-0.3, 0.0, -0.1, 0.05],
            "si": [0.8, 0.1, 0.5, 0.2],
            "served_phase": pd.array([2, pd.NA, 0, 1], dtype="Int64"),
            "p_holm": [0.001, 0.9, 0.03, 0.5],
        }
    )


def test_specialization_scatter_plain_and_clustered():
    spec = _spec()
    fig = viz.specialization_scatter(spec)
    _serialises(fig)
    _templated(fig)
    (tr,) = fig.data
    np.testing.assert_allclose(tr.x, spec.overall)
    np.testing.assert_allclose(tr.y, spec.si)
    assert list(tr.marker.symbol) == ["circle", "circle-open", "circle", "circle-open"]
    for key in ("served phase", "p_holm", "L%{customdata[0]}H%{customdata[1]}"):
        assert key in tr.hovertemplate
    assert [str(v) for v in tr.customdata[:, 2]] == ["2", "-", "0", "1"]

    labels = pd.DataFrame(  # HeadClusters.labels style: "head", one unit unlabelled
        {
            "layer": [0, 0, 1],
            "head": [0, 1, 0],
            "cluster": [0, 1, 0],
            "name": ["phase 2", "flat", "phase 2"],
        }
    )
    fig = viz.specialization_scatter(spec, clusters=labels)
    _serialises(fig)
    names = [t.name for t in fig.data]
    assert names == ["phase 2", "flat", "unclustered"]
    assert [len(t.x) for t in fig.data] == [2, 1, 1]
    np.testing.assert_allclose(fig.data[0].y, [0.8, 0.5])
    assert len({t.marker.color for t in fig.data}) == 3


def test_specialization_scatter_bad_input():
    with pytest.raises(ValueError, match="'si'"):
        viz.specialization_scatter(_spec().drop(columns="si"))
    with pytest.raises(ValueError, match="'name'"):
        viz.specialization_scatter(_spec(), clusters=pd.DataFrame({"layer": [0], "unit": [0]}))
    with pytest.raises(ValueError, match="'unit'"):
        viz.specialization_scatter(_spec(), clusters=pd.DataFrame({"layer": [0], "name": ["a"]}))


def test_real_ablation_feeds_heatmap_and_scatter():
    task = MQARTask(vocab_size=36, seq_len=24, n_pairs=3, stride=D)
    ds = generate(task, 8, seed=0, balanced=True)
    model = make_model("mean", stride=D, n_layers=1, n_heads=2)
    res = ablate(model, ds, modes=("zero",), n_boot=20)
    eff = res.effects
    with pytest.raises(ValueError, match="metric"):
        viz.effect_heatmap(eff)
    one = eff[(eff.metric == "logprob") & (eff.component == "head")]
    hm = viz.effect_heatmap(one).data[0]
    assert np.asarray(hm.z).shape == (2, D)
    np.testing.assert_allclose(np.asarray(hm.z), res.tensor("logprob")[0], equal_nan=True)
    spec = specialization(res, metric="logprob", n_perm=20)
    fig = viz.specialization_scatter(spec)
    np.testing.assert_allclose(fig.data[0].x, spec.overall)
    _serialises(fig)


# ------------------------------------------------------------------------------- training


def _metrics(steps=(100, 200, 300)):
    rows = [
        {
            "step": s,
            "train_loss": 1.0,
            "accuracy": s / 400,
            "accuracy_by_phase": [s / 400 + 0.01 * p for p in range(D)],
        }
        for s in steps
    ]
    return rows + [{"event": "done", "step": steps[-1], "accuracy": 0.75}]


def test_training_dynamics_lines():
    rows = _metrics()
    fig = viz.training_dynamics(rows[::-1], stride=D)  # unsorted, with the done line
    _serialises(fig)
    _templated(fig)
    assert len(fig.data) == D + 1
    assert [t.name for t in fig.data] == [f"phase {p}" for p in range(D)] + ["overall"]
    for p in range(D):
        np.testing.assert_allclose(fig.data[p].x, [100, 200, 300])
        np.testing.assert_allclose(fig.data[p].y, [s / 400 + 0.01 * p for s in (100, 200, 300)])
    overall = fig.data[-1]
    np.testing.assert_allclose(overall.y, [0.25, 0.5, 0.75])
    assert overall.line.width > max(t.line.width for t in fig.data[:-1])
    # Cividis: phase 0 darkest, last phase lightest; all phase colours distinct
    cols = [pcolors.unlabel_rgb(t.line.color) for t in fig.data[:-1]]
    assert len(set(cols)) == D and sum(cols[0]) < sum(cols[-1])
    # a DataFrame of the same rows gives the same figure data
    fig2 = viz.training_dynamics(pd.DataFrame(rows[:-1]), stride=D)
    np.testing.assert_allclose(fig2.data[2].y, fig.data[2].y)


def test_training_dynamics_bad_input():
    rows = _metrics()
    with pytest.raises(ValueError, match="stride=5"):
        viz.training_dynamics(rows, stride=5)
    with pytest.raises(ValueError, match="stride"):
        viz.training_dynamics(rows, stride=0)
    with pytest.raises(ValueError, match="accuracy_by_phase"):
        viz.training_dynamics([{"step": 1, "accuracy": 0.5}], stride=D)
    with pytest.raises(ValueError, match="step"):
        viz.training_dynamics([{"accuracy": 0.5, "accuracy_by_phase": [0] * D}], stride=D)


# ------------------------------------------------------------------------------- token pattern


def test_attention_pattern_phases_grid_needle_query():
    rng = np.random.default_rng(0)
    pattern = rng.random((6, 13))  # non-square
    fig = viz.attention_pattern_phases(pattern, stride=D, grid_offset=1, needle=5, query=4)
    _serialises(fig)
    _templated(fig)
    strip, hm = fig.data
    assert strip.type == hm.type == "heatmap"
    np.testing.assert_array_equal(np.asarray(strip.z)[0], (np.arange(13) - 1) % D)
    np.testing.assert_allclose(np.asarray(hm.z), pattern)
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    # chunk starts where (j - 1) % 4 == 0, j >= 1: j = 1, 5, 9
    assert sorted(s.x0 for s in lines) == [0.5, 4.5, 8.5]
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(rects) == 2
    needle_box = next(r for r in rects if r.x1 - r.x0 == 1)
    query_box = next(r for r in rects if r.y1 - r.y0 == 1)
    assert (needle_box.x0, needle_box.x1) == (4.5, 5.5)
    assert (query_box.y0, query_box.y1) == (3.5, 4.5)
    texts = [a.text for a in fig.layout.annotations]
    assert "query" in texts and any(t.startswith("needle (phase 0)") for t in texts)


def test_attention_pattern_phases_key_positions_and_bad_input():
    pattern = np.full((3, 4), 0.25)
    fig = viz.attention_pattern_phases(pattern, stride=D, key_positions=[6, 7, 8, 9], needle=9)
    np.testing.assert_array_equal(np.asarray(fig.data[0].z)[0], [2, 3, 0, 1])
    assert [s.x0 for s in fig.layout.shapes if s.type == "line"] == [1.5]
    assert list(fig.data[1].x) == ["6", "7", "8", "9"]
    fig = viz.attention_pattern_phases(pattern, stride=D)  # no needle / query: no boxes
    assert not [s for s in fig.layout.shapes if s.type == "rect"]
    with pytest.raises(ValueError, match="pattern"):
        viz.attention_pattern_phases(np.zeros(4), stride=D)
    with pytest.raises(ValueError, match="stride"):
        viz.attention_pattern_phases(pattern, stride=1)
    with pytest.raises(ValueError, match="needle=4"):
        viz.attention_pattern_phases(pattern, stride=D, needle=4)
    with pytest.raises(ValueError, match="query=3"):
        viz.attention_pattern_phases(pattern, stride=D, query=3)
    with pytest.raises(ValueError, match="key_positions"):
        viz.attention_pattern_phases(pattern, stride=D, key_positions=[0, 1])
    with pytest.raises(ValueError, match="grid_offset"):
        viz.attention_pattern_phases(pattern, stride=D, grid_offset=0.5)


# ------------------------------------------------------------------------------- theory


def test_theory_curves():
    df = pd.DataFrame(
        {
            "d": [8, 2, 4] * 2,
            "bound": [0.1, 0.5, 0.3, 0.2, 0.6, 0.4],
            "design": ["mean"] * 3 + ["theory"] * 3,
        }
    )
    df["lo"], df["hi"] = df.bound - 0.1, df.bound + 0.1
    fig = viz.theory_curves(df, x="d", y="bound", series="design")
    _serialises(fig)
    _templated(fig)
    assert [t.name for t in fig.data] == ["mean", "theory"]
    np.testing.assert_allclose(fig.data[0].x, [2, 4, 8])  # sorted by x
    np.testing.assert_allclose(fig.data[0].y, [0.5, 0.3, 0.1])
    assert fig.data[0].line.color == viz.DESIGN_COLORS["mean"]
    fig = viz.theory_curves(df, x="d", y="bound", series="design", band=("lo", "hi"))
    assert len(fig.data) == 4 and fig.data[0].fill == "toself"
    with pytest.raises(ValueError, match="'nope'"):
        viz.theory_curves(df, x="nope", y="bound", series="design")
