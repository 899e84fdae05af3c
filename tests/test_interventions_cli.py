"""``phasemech ablate`` / ``phasemech patch`` and ``analyses/interventions.py`` end to end on a
tiny trained run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from phasemech.cli import app
from phasemech.core.config import CompressionConfig
from phasemech.data.tasks import MQARTask
from phasemech.training.config import ModelSpec, TrainConfig
from phasemech.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep-like folder holding one tiny trained gated run."""
    root = tmp_path_factory.mktemp("sweep")
    cfg = TrainConfig(
        task=MQARTask(vocab_size=32, seq_len=32, n_pairs=4, stride=4),
        model=ModelSpec(n_layers=2, d_model=32, n_heads=2),
        compression=CompressionConfig("gated", stride=4, window=8, layers=(1,)),
        steps=8,
        batch_size=8,
        eval_every=4,
        eval_sequences=16,
        warmup_steps=2,
        seed=1,
    )
    train(cfg, root / "gated_tiny", progress=False)
    return root


def test_cli_ablate_writes_tidy_tables(sweep, tmp_path):
    out = tmp_path / "ablate"
    args = ["ablate", str(sweep / "gated_tiny"), "--sequences", "32", "--n-boot", "20"]
    result = runner.invoke(app, [*args, "--n-perm", "20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "most phase-specialised units" in result.output
    effects = pd.read_parquet(out / "effects.parquet")
    # every component that applies to a gated model, with every mode it allows
    combos = set(zip(effects.component.astype(str), effects["mode"].astype(str), strict=True))
    assert combos == {
        ("head", "zero"),
        ("head", "mean"),
        ("head", "resample"),
        ("blocks", "mask"),
        ("blocks", "mean"),
        ("blocks", "resample"),
        ("raw", "mask"),
        ("phase_bias", "zero"),
    }
    assert set(effects.phase) == {0, 1, 2, 3}
    spec = pd.read_parquet(out / "specialization.parquet")
    assert {"si", "p_perm", "served_phase", "rank"} <= set(spec.columns)


def test_cli_patch_by_position_with_attribution(sweep, tmp_path):
    out = tmp_path / "patch"
    args = ["patch", str(sweep / "gated_tiny"), "--contrast", "answer", "--pairs", "16"]
    result = runner.invoke(app, [*args, "--attribution", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "attribution patching vs exact" in result.output
    meta = json.loads((out / "patch.json").read_text())
    assert meta["by_pos"] and meta["contrast"] == "answer"
    values = pd.read_parquet(out / "values.parquet")
    assert len(values) == 2 * 32 * 2 * 16  # layer x pos x head x pair
    by_phase = pd.read_parquet(out / "by_phase.parquet")
    assert set(by_phase.phase) <= {0, 1, 2, 3}
    assert (out / "attribution.parquet").is_file()


def test_cli_patch_compressed_entries(sweep, tmp_path):
    out = tmp_path / "kv"
    args = ["patch", str(sweep / "gated_tiny"), "--site", "kv_block", "--pairs", "8"]
    args += ["--contrast", "answer"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    effects = pd.read_parquet(out / "effects.parquet")
    assert list(effects.layer.unique()) == [1]  # only the compressed layer has entries


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--site", "kv_block", "--contrast", "answer", "--by-pos"], "by_pos=True is invalid"),
        (["--site", "kv_block"], "needs the answer contrast"),
        (["--layers", "x"], "--layers 'x' is invalid"),
    ],
)
def test_cli_patch_bad_input(sweep, extra, message):
    result = runner.invoke(app, ["patch", str(sweep / "gated_tiny"), "--pairs", "4", *extra])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize("flag", ["--contrast", "--site", "--metric"])
def test_cli_patch_bad_choice_is_a_usage_error(sweep, flag):
    result = runner.invoke(app, ["patch", str(sweep / "gated_tiny"), flag, "nope"])
    assert result.exit_code == 2
    assert "'nope' is not one of" in " ".join(result.output.split())


def test_cli_ablate_bad_component(sweep):
    result = runner.invoke(app, ["ablate", str(sweep / "gated_tiny"), "--components", "mlp"])
    assert result.exit_code == 1
    assert "'mlp'" in result.output
