"""Bad input and faults around training and the command line: a derived held-out size, foreign
folders left alone, one-line errors instead of tracebacks (flags, corrupt configs, full and
read-only disks), and stale temporary checkpoints removed. Tiny models only (2-core CPU)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from phasemech import CompressionConfig
from phasemech.cli import app
from phasemech.data.tasks import MQARTask
from phasemech.training.checkpoints import checkpoint_dirs, remove_stale_temporaries
from phasemech.training.config import ModelSpec, TrainConfig
from phasemech.training.trainer import train

runner = CliRunner()
SMALL = ["--d-model", "16", "--heads", "2", "--batch-size", "4"]  # the default task
TINY = [*SMALL, "--seq-len", "32", "--pairs", "4"]


def tiny_config(**kw) -> TrainConfig:
    base = dict(
        task=MQARTask(vocab_size=32, seq_len=32, n_pairs=4, stride=4),
        model=ModelSpec(n_layers=2, d_model=16, n_heads=2),
        compression=CompressionConfig("mean", stride=4, window=8, layers=(1,)),
        steps=4,
        batch_size=4,
        eval_every=2,
        eval_sequences=8,
        seed=0,
    )
    return TrainConfig(**{**base, **kw})


def _flat(text: str) -> str:
    """Output without whitespace and box borders: rich wraps long lines (and usage errors, in a
    panel) at the terminal width."""
    return "".join(c for c in text if not c.isspace() and c not in "│╭╮╰╯─")


def _one_line_error(result, *needles: str) -> None:
    """Exit status 1, no traceback, and every needle in the message."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit | None), result.exception
    assert "Traceback" not in result.output
    for needle in needles:
        assert _flat(needle) in _flat(result.output), (needle, result.output)


# ------------------------------------------------------------------- held-out size (case 3)
def test_default_held_out_size_follows_the_task_stride():
    assert TrainConfig().eval_sequences == 512
    cfg = TrainConfig(task=MQARTask(stride=24), compression=CompressionConfig("mean", stride=3))
    assert cfg.eval_sequences == 528  # the smallest multiple of 24 that is >= 512
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="eval_sequences=500.*multiple of the task stride 24"):
        TrainConfig(task=MQARTask(stride=24), eval_sequences=500)


def test_cli_train_stride_3_and_eval_sequences_flag(tmp_path):
    args = ["train", "--stride", "3", "--design", "mean", "--steps", "1", "--eval-every", "1"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "a"), *SMALL])
    assert result.exit_code == 0, result.output
    saved = TrainConfig.load(tmp_path / "a" / "train_config.json")
    # the task's prefix follows the model's stride (docs/training.md): 512 rounds up to 513
    assert (saved.task.stride, saved.compression.stride, saved.eval_sequences) == (3, 3, 513)
    assert saved.prefix_warmup == 0
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "w"), *SMALL, "--prefix-warmup", "5"])
    assert result.exit_code == 0, result.output
    assert TrainConfig.load(tmp_path / "w" / "train_config.json").prefix_warmup == 5
    result = runner.invoke(
        app, [*args, "-o", str(tmp_path / "b"), *SMALL, "--eval-sequences", "48"]
    )
    assert result.exit_code == 0, result.output
    assert TrainConfig.load(tmp_path / "b" / "train_config.json").eval_sequences == 48
    result = runner.invoke(
        app, [*args, "-o", str(tmp_path / "c"), *SMALL, "--eval-sequences", "50"]
    )
    assert result.exit_code == 2 and "eval_sequences=50" in _flat(result.output)
    assert not (tmp_path / "c").exists()


def test_eval_sequences_from_a_config_file(tmp_path):
    """A run's own config keeps the default held-out size, which follows a new stride; a size
    the user chose stays theirs, so a stride that breaks it is an error naming a valid one."""
    train(tiny_config(task=MQARTask(), eval_sequences=None), tmp_path / "old", progress=False)
    assert TrainConfig.load(tmp_path / "old" / "train_config.json").eval_sequences == 512
    args = ["train", "--config", str(tmp_path / "old" / "train_config.json"), "--stride", "3"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert TrainConfig.load(tmp_path / "a" / "train_config.json").eval_sequences == 513
    (tmp_path / "c.json").write_text(json.dumps({"eval_sequences": 256}))
    args = ["train", "-o", str(tmp_path / "r"), "--config", str(tmp_path / "c.json")]
    result = runner.invoke(app, [*args, "--stride", "3", "--steps", "1", *SMALL])
    assert result.exit_code == 2, result.output
    assert "eval_sequences=256" in _flat(result.output) and "e.g.258" in _flat(result.output)


# ------------------------------------------------------------------- flags (case 5)
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--stride", "0"),
        ("--heads", "0"),
        ("--steps", "-1"),
        ("--window", "-2"),
        ("--seq-len", "0"),
        ("--prefix-warmup", "-1"),
    ],
)
def test_cli_train_out_of_range_flag_is_a_usage_error(tmp_path, flag, value):
    result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), flag, value])
    assert result.exit_code == 2, result.output
    assert flag in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r").exists()


def test_cli_ablate_bad_metric_is_refused_before_any_forward(tmp_path, monkeypatch):
    import phasemech.interventions.ablation

    def boom(*a, **k):
        raise AssertionError("the ablation ran before --metric was checked")

    train(tiny_config(), tmp_path / "r", progress=False)
    monkeypatch.setattr(phasemech.interventions.ablation, "ablate", boom)
    result = runner.invoke(app, ["ablate", str(tmp_path / "r"), "--metric", "bogus"])
    assert result.exit_code == 2, result.output
    assert "'bogus' is not one of" in result.output and "accuracy" in result.output


# ------------------------------------------------------------------- foreign folders (case 4)
def test_foreign_folder_is_refused_and_left_untouched(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("mine\n")
    (foreign / "todo.txt").write_text("mine too\n")
    for resume in (False, True):
        with pytest.raises(FileExistsError, match=r"not empty \(metrics.jsonl, todo.txt\)"):
            train(tiny_config(), foreign, resume=resume, progress=False)
    result = runner.invoke(app, ["train", "-o", str(foreign), "--steps", "1", *TINY])
    _one_line_error(result, "not a phasemech run")
    assert sorted(p.name for p in foreign.iterdir()) == ["metrics.jsonl", "todo.txt"]
    assert (foreign / "metrics.jsonl").read_text() == "mine\n"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        train(tiny_config(), tmp_path / "file", progress=False)


def test_empty_folder_is_a_fine_run_folder(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".DS_Store").write_bytes(b"")  # hidden OS litter is no one's work
    assert train(tiny_config(), tmp_path / "r", progress=False).step == 4


# ------------------------------------------------------------------- corrupt config (case 5)
def test_resume_with_a_corrupt_train_config_names_the_file(tmp_path):
    train(tiny_config(), tmp_path / "r", progress=False)
    cfg_file = tmp_path / "r" / "train_config.json"
    for text, what in [("{bad", "is not valid JSON"), ('{"steps": 0}', "invalid train config")]:
        cfg_file.write_text(text)
        with pytest.raises(ValueError, match=what) as info:
            train(tiny_config(), tmp_path / "r", resume=True, progress=False)
        assert str(cfg_file) in str(info.value)
        result = runner.invoke(app, ["train", "-o", str(tmp_path / "r"), "--resume"])
        assert result.exit_code == 2 and _flat(str(cfg_file)) in _flat(result.output)
        assert "Traceback" not in result.output


# ------------------------------------------------------------------- phase-attention (case 5)
def test_cli_phase_attention_takes_a_run_folder(tmp_path):
    train(tiny_config(), tmp_path / "r", progress=False)
    result = runner.invoke(app, ["phase-attention", str(tmp_path / "r"), "--sequences", "2"])
    assert result.exit_code == 0, result.output
    assert "phase 3" in result.output and "L1H1" in result.output
    _one_line_error(runner.invoke(app, ["phase-attention", str(tmp_path / "nope")]), "nope")
    (tmp_path / "other").mkdir()
    _one_line_error(runner.invoke(app, ["phase-attention", str(tmp_path / "other")]), "config.json")


# ------------------------------------------------------------------- data --out (case 5)
def test_cli_data_out_refuses_a_foreign_file_or_folder(tmp_path):
    args = ["data", "mqar", "--sequences", "8", "--out"]
    (tmp_path / "notes.txt").write_text("keep")
    result = runner.invoke(app, [*args, str(tmp_path / "notes.txt")])
    assert result.exit_code == 2 and "existingfile" in _flat(result.output)
    assert (tmp_path / "notes.txt").read_text() == "keep"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("keep")
    result = runner.invoke(app, [*args, str(tmp_path / "mine")])
    assert result.exit_code == 2 and "nosaveddataset" in _flat(result.output)
    # a dataset folder or a .parquet file of ours is replaced
    for out in (tmp_path / "ds", tmp_path / "ds.parquet"):
        for _ in range(2):
            assert runner.invoke(app, [*args, str(out)]).exit_code == 0


# ------------------------------------------------------------------- full / read-only disk
def _fail_writes_under(monkeypatch, folder: Path, code: int) -> None:
    """Writes of files under ``folder`` fail as a full (ENOSPC) or read-only (EROFS) disk
    would: at ``write_bytes``/``write_text`` and at ``mkstemp`` (atomic writes)."""
    real_bytes, real_text, real_mkstemp = Path.write_bytes, Path.write_text, tempfile.mkstemp

    def refuse(path) -> None:
        if str(path).startswith(str(folder)):  # OSError(EACCES, ...) is a PermissionError
            raise OSError(code, os.strerror(code), str(path))

    def write_bytes(self, data):
        refuse(self)
        return real_bytes(self, data)

    def write_text(self, data, *a, **k):
        refuse(self)
        return real_text(self, data, *a, **k)

    def mkstemp(*a, dir=None, **k):  # noqa: A002
        refuse(Path(dir or ".") / "x")
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_disk_error_during_checkpointing_is_one_line(tmp_path, monkeypatch, code):
    run = tmp_path / "r"
    _fail_writes_under(monkeypatch, run / "checkpoints", code)
    with pytest.raises(OSError) as info:
        train(tiny_config(), run, progress=False)
    msg = str(info.value)
    assert (
        msg
        == f"{run / 'checkpoints'}: could not write checkpoint step_000002 ({os.strerror(code)})"
    )
    assert not list((run / "checkpoints").iterdir())  # the temporary folder is gone
    _fail_writes_under(monkeypatch, tmp_path / "d" / "checkpoints", code)
    result = runner.invoke(
        app, ["train", "-o", str(tmp_path / "d"), "--steps", "2", "--eval-every", "2", *TINY]
    )
    _one_line_error(result, str(tmp_path / "d" / "checkpoints"), os.strerror(code))


@pytest.mark.parametrize(
    ("code", "kind"), [(errno.EROFS, OSError), (errno.EACCES, PermissionError)]
)
def test_disk_error_on_the_run_folder_names_it(tmp_path, monkeypatch, code, kind):
    run = tmp_path / "r"
    _fail_writes_under(monkeypatch, run, code)
    with pytest.raises(kind, match=f"^{run}: {os.strerror(code)}"):
        train(tiny_config(), run, progress=False)


# ------------------------------------------------------------------- litter (case 6)
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_checkpoints_are_removed_on_resume(tmp_path):
    cfg = tiny_config(steps=6)

    class Killed(Exception):
        pass

    def stop(step, loss):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, tmp_path / "r", progress=False, on_step=stop)
    root = tmp_path / "r" / "checkpoints"
    dead = root / f".tmp-step_000004-{_dead_pid()}"
    mine = root / f".tmp-step_000004-{os.getpid()}"  # a PID reused after a restart
    live = root / f".tmp-step_000004-{os.getppid()}"  # another live process may be writing it
    for folder in (dead, mine, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half written")
    train(cfg, tmp_path / "r", resume=True, progress=False)
    assert not dead.exists() and not mine.exists() and live.exists()
    assert [p.name for p in checkpoint_dirs(tmp_path / "r")][-1] == "step_000006"
    assert remove_stale_temporaries(tmp_path / "r") == []  # the live one is still kept
