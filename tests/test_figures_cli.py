"""End to end: the figure analysis (tiny profile) and the CLI on a saved model."""

import subprocess
import sys
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


def test_head_phase_analysis_tiny_profile_writes_figures(tmp_path):
    out, runs = tmp_path / "figures", tmp_path / "runs"
    cmd = [sys.executable, str(ROOT / "analyses/head_phase_attention.py"), "--tiny"]
    cmd += ["--out", str(out), "--runs", str(runs)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    for name in ("head_phase_attention.html", "head_phase_needle.html"):
        html = (out / name).read_text()
        assert "plotly" in html.lower() and "source phase" in html
    frame = pd.read_parquet(next(runs.glob("*/phase_attention_mean.parquet")))
    assert set(frame.columns) >= {"layer", "head", "phase", "mass", "n", "exact"}
    # each (layer, head) row of the query-mean reduction sums to one over phases
    sums = frame.groupby(["layer", "head"]).mass.sum()
    assert ((sums - 1).abs() < 1e-4).all()
    # second run reuses the checkpoint instead of training again
    again = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "reusing" in again.stdout


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
