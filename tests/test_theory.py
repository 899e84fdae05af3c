"""The idealized gradient-flow model (docs/theory.md): exact gradient, stability, the predictions
that hold at small sizes."""

import json
import math

import numpy as np
import pytest

from phasemech.theory.dynamics import (
    TheoryConfig,
    critical_beta_over_d,
    flow,
    g_second,
    head_ablation,
    loss,
    predictions,
    simulate,
    uniform_eigenvalue,
)
from phasemech.viz.theory import theory_plateau


@pytest.mark.parametrize("offsets", ["aligned", "staggered", "random", (0, 3, 1)])
def test_flow_is_minus_the_loss_gradient(offsets):
    cfg = TheoryConfig(
        d=4,
        heads=3,
        n_windows=32,
        beta=6.0,
        offsets=offsets,
        gain=(0.5, 0.7, 0.9, 1.0),
        pi=(0.1, 0.2, 0.3, 0.4),
    )
    theta = np.random.default_rng(1).normal(0, 1, (3, 4))
    num = np.zeros_like(theta)
    for i, j in np.ndindex(theta.shape):
        e = np.zeros_like(theta)
        e[i, j] = 1e-6
        num[i, j] = -(loss(theta + e, cfg) - loss(theta - e, cfg)) / 2e-6
    assert np.abs(num - flow(theta, cfg)).max() < 1e-7


def test_uniform_pooling_is_unstable_below_the_critical_gain():
    n = 64
    crit = critical_beta_over_d(n, d=8)
    assert g_second(1 / 8, 0.99 * crit * 8, 1.0, n) > 0 > g_second(1 / 8, 1.01 * crit * 8, 1.0, n)
    # the critical beta/d grows with log(N - 1), as the model predicts (roughly equal to it)
    crits = [critical_beta_over_d(n) for n in (16, 64, 256, 1024)]
    assert np.all(np.diff(crits) > 0)
    slope = np.polyfit([math.log(n - 1) for n in (16, 64, 256, 1024)], crits, 1)[0]
    assert 0.7 < slope < 1.3
    assert uniform_eigenvalue(TheoryConfig(beta=8.0, n_windows=1024)) > 0
    assert uniform_eigenvalue(TheoryConfig(beta=80.0, n_windows=16)) < 0


def test_heads_partition_the_phases_up_to_capacity():
    for heads in (2, 4):
        tr = simulate(TheoryConfig(d=8, heads=heads, beta=8.0), steps=3000)
        assert tr.covered() == heads  # H < d heads cover H phases, the rest stay at chance
        # each covered phase is served by one head's dominant slot
        top = tr.weights[-1].argmax(-1)
        assert len(set(top.tolist())) == heads


def test_staggered_offsets_close_the_gap_that_a_slot_handicap_opens():
    gain = tuple(0.8 ** (8 - 1 - slot) for slot in range(8))
    aligned = simulate(TheoryConfig(beta=16.0, gain=gain), steps=3000)
    staggered = simulate(TheoryConfig(beta=16.0, gain=gain, offsets="staggered"), steps=3000)
    assert aligned.gap > 0.5 and staggered.gap < 0.05
    assert staggered.accuracy[-1].mean() > aligned.accuracy[-1].mean()


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="offsets='diagonal' is invalid"):
        TheoryConfig(offsets="diagonal")
    with pytest.raises(ValueError, match="pi=.* must sum to 1"):
        TheoryConfig(d=2, pi=(0.5, 0.6))


def test_head_ablation_hurts_the_phase_a_head_weighs():
    cfg = TheoryConfig(d=4, heads=4, n_windows=16)
    theta = np.full((4, 4), -10.0)
    theta[np.arange(4), [2, 0, 3, 1]] = 10.0  # one-to-one: head h on one slot
    drop = head_ablation(theta, cfg)
    assert drop.argmax(1).tolist() == [2, 0, 3, 1]
    assert (drop.max(1) > 0.5).all()
    off = drop.copy()
    off[np.arange(4), [2, 0, 3, 1]] = 0
    assert np.abs(off).max() < 1e-6  # no other phase depends on that head


def test_predictions_are_json_ready_and_draw_a_figure():
    pred = predictions(scale=0.02)
    assert json.loads(json.dumps(pred, allow_nan=False)) == pred  # no inf / NaN
    assert [r["n_windows"] for r in pred["plateau"]] == [16, 64, 256, 1024]
    assert {r["offsets"] for r in pred["handicap"]} == {"aligned", "staggered", "random"}
    # the stability eigenvalue's sign is the analytic one, whatever the horizon
    assert pred["stability"][0]["eigenvalue"] > 0 > pred["stability"][-1]["eigenvalue"]
    fig = theory_plateau(pred)
    assert fig["name"] == "theory_plateau" and "N=16" in fig["caption"]
    assert [t.name for t in fig["figure"].data] == ["N = 16", "N = 64", "N = 256", "N = 1024"]


def test_cli_theory_prints_and_writes_the_predictions(tmp_path):
    from typer.testing import CliRunner

    from phasemech.cli import app

    out = tmp_path / "theory.json"
    res = CliRunner().invoke(app, ["theory", "--scale", "0.02", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "critical beta/d" in res.output and "reference 2725" in res.output
    assert json.loads(out.read_text())["steps"] == 120
    bad = CliRunner().invoke(app, ["theory", "--scale", "2"])
    assert bad.exit_code != 0 and "scale" in bad.output
