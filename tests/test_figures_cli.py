"""End to end: the figure analysis (tiny profile) and the CLI on a saved model."""

from pathlib import Path

import pandas as pd
import torch
from conftest import make_model
from typer.testing import CliRunner

from phasemech import PhaseTransformer, phase_attention
from phasemech.cli import app
from phasemech.viz import head_phase_heatmap

ROOT = Path(__file__).resolve().parents[1]


def _small_model() -> PhaseTransformer:
    kw = dict(n_ctx=24, d_vocab=20, n_heads=2, d_model=16, seed=3)
    return make_model("mean", stride=4, window=4, layers=(1,), **kw)


def test_heatmap_is_a_figure_with_one_panel_per_layer():
    model = _small_model()
    pa = phase_attention(model, torch.randint(0, 20, (4, 24)))
    fig = head_phase_heatmap(pa)
    assert len(fig.data) == 2
    assert fig.data[1].z.shape == (2, 4)


def test_cli_info_and_phase_attention(tmp_path):
    model = _small_model()
    model.save(tmp_path / "m")
    runner = CliRunner()
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0 and "gated" in result.output
    out = tmp_path / "pa.csv"
    result = runner.invoke(
        app, ["phase-attention", str(tmp_path / "m"), "--sequences", "4", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "L1H1" in result.output
    assert len(pd.read_csv(out)) == 2 * 2 * 4
    bad = runner.invoke(app, ["phase-attention", str(tmp_path / "m"), "--length", "99"])
    assert bad.exit_code != 0
