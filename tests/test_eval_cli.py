"""answer_logits, predict / evaluate on a model's grid, checkpoint resolution, and the
``data`` / ``train`` / ``eval`` commands end to end on tiny models."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_model, randomize_compressors
from datasets import load_from_disk
from typer.testing import CliRunner

from phasemech.cli import app
from phasemech.core.grid import reference_grid
from phasemech.data.tasks import (
    MQARTask,
    NeedleTask,
    generate,
    load_dataset,
    targets_frame,
    task_of,
    to_tensors,
)
from phasemech.measure.evaluate import evaluate, predict
from phasemech.measure.readout import answer_logits
from phasemech.training.checkpoints import read_metrics, resolve_checkpoint
from phasemech.training.config import ModelSpec, TrainConfig

VOCAB, CTX = 64, 32
TASK = MQARTask(vocab_size=VOCAB, seq_len=CTX, n_pairs=4, stride=8)
MODEL_KW = dict(d_vocab=VOCAB, n_ctx=CTX, d_model=32, n_heads=4, d_head=8)


def _model(design: str = "gated", **kw):
    model = make_model(design, **{**MODEL_KW, **kw})
    if design != "none":
        randomize_compressors(model, seed=1)
    return model


@pytest.fixture(scope="module")
def ds():
    return generate(TASK, 32, seed=0, balanced=True)


def _full_logits_at(model, tokens, query_pos):
    with torch.no_grad():
        logits = model(tokens)
    return logits.gather(1, query_pos[..., None].expand(-1, -1, logits.shape[-1]))


# ------------------------------------------------------------------------------ answer_logits


@pytest.mark.parametrize(
    ("design", "kw"),
    [
        ("gated", dict(stride=4, layers=(1,))),
        ("gated", dict(stride=4, offsets="per_head")),
        ("mean", dict(stride=4, layers=(0,), normalization_type=None)),
        ("none", dict()),
        ("none", dict(normalization_type=None)),
        ("gated", dict(stride=4, normalization_type="LNPre")),
    ],
    ids=["gated", "gated_per_head", "mean_no_norm", "dense", "dense_no_norm", "gated_lnpre"],
)
def test_answer_logits_match_full_forward(ds, design, kw):
    model = _model(design, **kw)
    tokens, qp, _ = to_tensors(ds)
    with torch.no_grad():
        got = answer_logits(model, tokens, qp)
    assert got.shape == (len(ds), TASK.queries, VOCAB)
    torch.testing.assert_close(got, _full_logits_at(model, tokens, qp), atol=1e-5, rtol=1e-5)


def test_answer_logits_carry_gradients():
    model = _model("gated", stride=4, layers=(1,))
    model.train()
    tokens, qp, ans = to_tensors(generate(TASK, 4, seed=1))
    logits = answer_logits(model, tokens, qp)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ans.flatten()).backward()
    assert model.blocks[1].attn.phase_bias.grad.abs().sum() > 0
    assert model.embed.W_E.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ predict


def test_predict_matches_full_forward(ds):
    model = _model("gated", stride=4, layers=(1,))
    tokens, qp, ans = to_tensors(ds)
    full = _full_logits_at(model, tokens, qp)
    guess = full.argmax(-1)
    # make half the sequences answerable by this random model: their answer is its argmax
    forced = set(range(0, len(ds), 2))

    def relabel(row):
        if row["seq_id"] in forced:
            row["answer"] = guess[row["seq_id"]].tolist()
        return row

    relabelled = ds.map(relabel)
    df = predict(model, relabelled, batch_size=5)  # batches that do not divide the set
    assert len(df) == len(ds) * TASK.queries == len(targets_frame(ds))
    answer = torch.tensor(relabelled["answer"])
    want = (guess == answer).flatten().numpy()
    np.testing.assert_array_equal(df["correct"].to_numpy(), want)
    assert df.loc[df["seq_id"].isin(forced), "correct"].all()
    assert 0 < df["correct"].mean() < 1
    np.testing.assert_array_equal(df["margin"].to_numpy() > 0, df["correct"].to_numpy())
    assert (df["logprob"] <= 0).all()
    lp = full.log_softmax(-1).gather(-1, answer[..., None])[..., 0].flatten().numpy()
    np.testing.assert_allclose(df["logprob"].to_numpy(), lp, atol=1e-5)
    right = full.gather(-1, answer[..., None])[..., 0]
    other = full.scatter(-1, answer[..., None], -torch.inf).amax(-1)
    np.testing.assert_allclose(df["margin"].to_numpy(), (right - other).flatten(), atol=1e-5)
    pd.testing.assert_frame_equal(
        df[list(targets_frame(ds).columns)].drop(columns="answer"),
        targets_frame(ds).drop(columns="answer"),
    )
    assert not model.training


def test_predict_keeps_training_mode_and_rejects_long_sequences(ds):
    model = _model("gated", stride=4, layers=(1,))
    model.train()
    predict(model, ds.select(range(4)))
    assert model.training
    too_long = generate(MQARTask(vocab_size=VOCAB, seq_len=CTX + 8, n_pairs=4), 2, seed=0)
    with pytest.raises(ValueError, match="n_ctx"):
        predict(model, too_long)
    with pytest.raises(ValueError, match="empty"):
        predict(model, ds.select([]))


# ----------------------------------------------------------------------------------- evaluate


def test_evaluate_on_the_model_grid(ds, tmp_path):
    model = _model("gated", stride=4, layers=(1,))
    ev = evaluate(model, ds, n_boot=50, n_perm=50)
    assert ev.stride == ev.report.stride == 4 and ev.grid_offset == 0
    assert "own grid" in ev.grid_note
    # dataset logged on stride 8; phases are recomputed on the model's stride-4 grid
    assert (targets_frame(ds)["phase"].max()) == 7
    np.testing.assert_array_equal(ev.targets["phase"], ev.targets["source_pos"] % 4)
    assert ev.report.per_phase["phase"].tolist() == [0, 1, 2, 3]
    assert ev.report.per_phase["n"].tolist() == [len(ds) * TASK.queries // 4] * 4
    assert ev.report.n == len(ev.targets) == len(ds) * TASK.queries
    assert ev.report.accuracy == pytest.approx(ev.targets["correct"].mean())
    # saved, and readable back
    out = ev.save(tmp_path / "eval")
    back = pd.read_parquet(out / "targets.parquet")
    pd.testing.assert_frame_equal(back, ev.targets)
    report = json.loads((out / "report.json").read_text())
    assert report["stride"] == 4 and report["n"] == len(ev.targets)
    assert len(report["per_phase"]) == 4
    assert json.loads((out / "grid.json").read_text())["stride"] == 4
    assert (out / "per_phase.parquet").is_file()


def test_evaluate_is_deterministic(ds):
    model = _model("gated", stride=4, layers=(1,))
    a = evaluate(model, ds, n_boot=30, n_perm=30, seed=3).report.to_dict()
    b = evaluate(model, ds, n_boot=30, n_perm=30, seed=3).report.to_dict()
    assert a == b


def test_evaluate_dense_model_and_stated_grid(ds):
    dense = _model("none", stride=8)
    ev = evaluate(dense, ds, n_boot=50, n_perm=50)
    assert ev.stride == ev.report.stride == 8 and "dense" in ev.grid_note
    np.testing.assert_array_equal(ev.targets["phase"], ev.targets["source_pos"] % 8)
    ev4 = evaluate(dense, ds, stride=4, n_boot=50, n_perm=50)
    assert ev4.stride == ev4.report.stride == 4 and ev4.grid_offset == 0
    assert "stated grid stride 4" in ev4.grid_note
    np.testing.assert_array_equal(ev4.targets["phase"], ev4.targets["source_pos"] % 4)
    # the grid does not change predictions, only how they are grouped
    np.testing.assert_array_equal(ev4.targets["correct"], ev.targets["correct"])
    ev_off = evaluate(dense, ds, stride=4, grid_offset=3, n_boot=10, n_perm=10)
    assert ev_off.grid_offset == 3
    np.testing.assert_array_equal(ev_off.targets["phase"], (ev_off.targets["source_pos"] - 3) % 4)
    for bad in (0, 1):  # 0 must not fall back to the model's stride
        with pytest.raises(ValueError, match=f"stride={bad}"):
            evaluate(dense, ds, stride=bad, n_boot=10, n_perm=10)
    # a grid that does not divide the data's stride: phases unbalanced and tied to depth
    with pytest.raises(ValueError, match="stride=3 does not divide the dataset's stride=8"):
        evaluate(dense, ds, stride=3, n_boot=10, n_perm=10)


def test_evaluate_explicit_offset_model_reports_on_its_offset(ds):
    model = _model("gated", stride=4, offsets=2, layers=(1,))
    assert reference_grid(model.cfg.compression) == (4, 2)
    ev = evaluate(model, ds, n_boot=50, n_perm=50)
    assert ev.stride == 4 and ev.grid_offset == 2 and "offset 2" in ev.grid_note
    np.testing.assert_array_equal(ev.targets["phase"], (ev.targets["source_pos"] - 2) % 4)


@pytest.mark.parametrize(
    ("kw", "note", "offset"),
    [
        (dict(offsets="per_head"), "reference grid", 0),
        (dict(offsets="per_layer"), "reference grid", 0),
        (dict(offsets="random", eval_offset=1), "random offsets", 1),
    ],
    ids=["per_head", "per_layer", "random"],
)
def test_evaluate_staggered_offsets_use_the_reference_grid(ds, kw, note, offset):
    model = _model("gated", stride=4, **kw)
    ev = evaluate(model, ds, n_boot=10, n_perm=10)
    assert note in ev.grid_note and ev.stride == 4 and ev.grid_offset == offset
    np.testing.assert_array_equal(ev.targets["phase"], (ev.targets["source_pos"] - offset) % 4)


# --------------------------------------------------------------------- a run, through the CLI

runner = CliRunner()
TRAIN_ARGS = [
    "--design",
    "gated",
    "--stride",
    "4",
    "--layers",
    "1",
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--heads",
    "2",
    "--d-model",
    "32",
    "--seq-len",
    "32",
    "--pairs",
    "4",
    "--batch-size",
    "8",
]


def _flat(text: str) -> str:
    """CLI output without whitespace: rich wraps long lines (paths) at the terminal width."""
    return "".join(text.split())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli") / "run"
    result = runner.invoke(app, ["train", "-o", str(run), *TRAIN_ARGS])
    assert result.exit_code == 0, result.output
    assert "step 6" in result.output
    return run


def test_cli_train_writes_a_run(run_dir):
    cfg = TrainConfig.from_dict(json.loads((run_dir / "train_config.json").read_text()))
    assert cfg.steps == 6 and cfg.eval_every == 3 and cfg.batch_size == 8
    comp = cfg.compression
    assert (comp.design, comp.stride, comp.window, comp.layers) == ("gated", 4, 8, (1,))
    assert cfg.model == ModelSpec(n_heads=2, d_model=32)
    assert (cfg.task.seq_len, cfg.task.n_pairs) == (32, 4)
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [ln for ln in lines if ln.get("event") != "done"]
    assert [ln["step"] for ln in evals] == [3, 6]
    assert evals == read_metrics(run_dir)
    assert all(len(ln["accuracy_by_phase"]) == 4 for ln in evals)
    assert lines[-1]["event"] == "done" and lines[-1]["step"] == 6
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000003", "step_000006"]
    last = run_dir / "checkpoints" / "step_000006"
    assert (last / "config.json").is_file() and (last / "model.safetensors").is_file()


def test_cli_train_refuses_an_existing_run(run_dir):
    before = (run_dir / "metrics.jsonl").read_text()
    result = runner.invoke(app, ["train", "-o", str(run_dir), *TRAIN_ARGS])
    assert result.exit_code != 0
    assert "--resume" in result.output
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_cli_train_new_stride_keeps_the_task_balanced(tmp_path):
    # the default task is balanced for stride 8: stride 16 raises the task stride to 16
    args = [a if a != "4" or i != 3 else "16" for i, a in enumerate(TRAIN_ARGS)]
    args[args.index("--steps") + 1] = "1"
    args[args.index("--seq-len") + 1] = "48"
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), *args, "--eval-every", "1"])
    assert result.exit_code == 0, result.output
    cfg = TrainConfig.from_dict(json.loads((tmp_path / "r" / "train_config.json").read_text()))
    assert cfg.compression.stride == 16 and cfg.task.stride == 16
    assert cfg.compression.window == 32  # default 2 * stride for the new stride


def test_cli_train_bad_flag_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), "--design", "bogus"])
    assert result.exit_code != 0 and "design" in result.output
    assert not (tmp_path / "r").exists()


def test_resolve_checkpoint(run_dir, tmp_path):
    path, cfg = resolve_checkpoint(run_dir)
    assert path == run_dir / "checkpoints" / "step_000006"
    assert isinstance(cfg, TrainConfig) and cfg.steps == 6
    ckpt = run_dir / "checkpoints" / "step_000003"
    path, cfg2 = resolve_checkpoint(ckpt)
    assert path == ckpt and cfg2 == cfg
    plain = _model("mean", stride=4).save(tmp_path / "plain")
    assert resolve_checkpoint(plain) == (plain, None)
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp_path / "missing")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "train_config.json").write_text((run_dir / "train_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="without checkpoints"):
        resolve_checkpoint(empty)
    (empty / "train_config.json").write_text("{not json")
    (empty / "checkpoints" / "step_000001").mkdir(parents=True)
    with pytest.raises(ValueError, match="train_config.json is not valid JSON"):
        resolve_checkpoint(empty)


def test_cli_eval_run(run_dir):
    args = ["eval", str(run_dir), "--sequences", "32", "--n-boot", "20", "--n-perm", "20"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    phase_lines = [ln for ln in result.output.splitlines() if re.match(r"\s+[0-3]\s+\d\.\d{3}", ln)]
    assert len(phase_lines) == 4, result.output
    assert "stride 4:" in result.output and "mqar" in result.output
    dest = run_dir / "checkpoints" / "step_000006" / "eval"
    report = json.loads((dest / "report.json").read_text())
    assert report["stride"] == 4 and report["n"] == 32 * 4
    targets = pd.read_parquet(dest / "targets.parquet")
    np.testing.assert_array_equal(targets["phase"], targets["source_pos"] % 4)


def test_cli_eval_plain_model_needs_data(tmp_path):
    plain = _model("gated", stride=4, layers=(1,)).save(tmp_path / "plain")
    result = runner.invoke(app, ["eval", str(plain), "--n-boot", "5", "--n-perm", "5"])
    assert result.exit_code != 0
    assert "pass--data" in _flat(result.output)
    missing = runner.invoke(app, ["eval", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and "doesnotexist" in _flat(missing.output)


# ----------------------------------------------------------------------------------- data CLI


def test_cli_data_mqar_folder_and_parquet(tmp_path):
    out = tmp_path / "mqar"
    result = runner.invoke(
        app, ["data", "mqar", "--out", str(out), "--sequences", "16", "--balanced"]
    )
    assert result.exit_code == 0, result.output
    ds = load_from_disk(str(out))
    assert len(ds) == 16 and task_of(ds) == MQARTask()
    counts = targets_frame(ds)["phase"].value_counts()
    assert sorted(counts.index) == list(range(8)) and counts.nunique() == 1
    assert "targetsperphase" in _flat(result.output)
    # parquet output, then scored by a plain model folder through --data
    pq = tmp_path / "sub" / "mqar.parquet"
    args = ["data", "mqar", "-o", str(pq), "--sequences", "24", "--seq-len", "32"]
    result = runner.invoke(app, [*args, "--pairs", "4", "--stride", "4", "--jitter", "1"])
    assert result.exit_code == 0, result.output
    back = load_dataset(pq)
    want = generate(MQARTask(seq_len=32, n_pairs=4, stride=4, jitter=1), 24, seed=0)
    assert back.with_format(None).to_list() == want.with_format(None).to_list()
    plain = _model("gated", stride=4, layers=(1,)).save(tmp_path / "plain")
    result = runner.invoke(
        app,
        ["eval", str(plain), "--data", str(pq), "--n-boot", "10", "--n-perm", "10"]
        + ["--out", str(tmp_path / "ev")],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "ev" / "report.json").read_text())["n"] == 24 * 4


def test_cli_data_mqar_bad_input_names_the_field(tmp_path):
    result = runner.invoke(app, ["data", "mqar", "--out", str(tmp_path / "x"), "--seq-len", "10"])
    assert result.exit_code != 0
    assert "seq_len" in result.output
    assert not (tmp_path / "x").exists()
    result = runner.invoke(
        app, ["data", "mqar", "--out", str(tmp_path / "y"), "--sequences", "12", "--balanced"]
    )
    assert result.exit_code != 0 and "stride" in result.output


def test_cli_data_needle(tmp_path):
    out = tmp_path / "needle"
    args = ["data", "needle", "--out", str(out), "--sequences", "40", "--seq-len", "32"]
    result = runner.invoke(app, [*args, "--distractors", "3", "--needles", "2", "--depths", "0,1"])
    assert result.exit_code == 0, result.output
    ds = load_from_disk(str(out))
    task = task_of(ds)
    assert task == NeedleTask(seq_len=32, n_needles=2, n_distractors=3, depths=(0.0, 1.0))
    df = targets_frame(ds)
    assert len(df) == 80 and df.groupby("phase").size().nunique() == 1
    bad = runner.invoke(app, ["data", "needle", "--out", str(tmp_path / "b"), "--depths", "0,2"])
    assert bad.exit_code != 0 and "depths" in bad.output


@pytest.mark.parametrize("warmup", [None, "2"])
def test_cli_train_a_system_takes_its_own_defaults(tmp_path, warmup):
    """--design gives a system its own defaults (dsa's indexer training); dsa without a dense
    warm-up gets a hint, with one it does not."""
    args = [a for a in TRAIN_ARGS]
    args[args.index("--design") + 1] = "dsa"
    args[args.index("--steps") + 1] = "2"
    extra = [] if warmup is None else ["--selection-warmup", warmup]
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), *args, *extra])
    assert result.exit_code == 0, result.output
    assert ("selection-warmup" in _flat(result.output)) == (warmup is None)
    cfg = TrainConfig.from_dict(json.loads((tmp_path / "r" / "train_config.json").read_text()))
    assert (cfg.compression.design, cfg.compression.indexer_train) == ("dsa", "kl")
    assert cfg.selection_warmup == (0 if warmup is None else 2)
