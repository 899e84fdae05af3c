"""The head-attention experiment (copy-task model, attention by source phase) at its tiny
profile on the launcher, and its training resumed after an interruption."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from phasemech.experiments import jobs
from phasemech.experiments.experiment import run_experiment
from phasemech.experiments.head_attention.jobs import CopyTaskJob, train_copy_model
from phasemech.experiments.head_attention.profiles import LOSS_FILE, STATE_FILE
from phasemech.experiments.head_attention.study import HEAD_ATTENTION


def test_tiny_profile_end_to_end_then_fully_cached(tmp_path):
    run = run_experiment(HEAD_ATTENTION, "tiny", tmp_path, num_cpus=2, progress=False)
    assert not run.failures and run.ran == 1
    out = tmp_path / "head_attention_tiny"
    for name in ("head_phase_attention.html", "head_phase_needle.html"):
        html = (out / name).read_text()
        assert "plotly" in html.lower() and "source phase" in html
    mean = pd.read_parquet(out / "phase_attention_mean.parquet")
    needle = pd.read_parquet(out / "phase_attention_needle.parquet")
    for frame in (mean, needle):
        assert set(frame.columns) >= {"layer", "head", "phase", "mass", "n", "exact", "seed"}
        assert len(frame) == 2 * 4 * 4  # layers x heads x phases
        assert frame["mass"].between(0, 1).all()
    # the query mean spreads each head's attention over the phases: every row sums to one
    sums = mean.groupby(["layer", "head"])["mass"].sum()
    assert ((sums - 1).abs() < 1e-4).all()
    # answer -> needle: every (sequence, answer) pair counted once, under its needle's phase
    assert (needle.groupby(["layer", "head"])["n"].sum() == 32 * 15).all()  # P - 1 answers
    acc = pd.read_parquet(out / "copy_accuracy.parquet")
    assert list(acc["phase"]) == [0, 1, 2, 3] and acc["accuracy"].between(0, 1).all()
    assert len(pd.read_parquet(out / "train_loss.parquet")) == 20
    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"]["steps"] == 20 and summary["eval_sequences"] == 32
    assert set(summary["copy_accuracy_by_needle_phase"]) == {"0", "1", "2", "3"}
    assert "Attention from answer to needle" in (out / "summary.md").read_text()
    # the trained model sits in the job's own folder, beside its cached result
    assert len(list((out / "jobs" / "work").glob("*/model/model.safetensors"))) == 1

    again = run_experiment(HEAD_ATTENTION, "tiny", tmp_path, num_cpus=2, progress=False)
    assert again.ran == 0 and again.cached == 1
    assert json.loads((out / "summary.json").read_text()) == summary


class Stop(Exception):
    pass


def test_interrupted_training_resumes_to_the_same_model(tmp_path, monkeypatch):
    job = CopyTaskJob(steps=12, batch=4, half=8, eval_sequences=4, checkpoint_every=5)
    _, straight = train_copy_model(job, tmp_path / "straight")

    def stop_at_8(done: float, total: float) -> None:
        if done == 8:
            raise Stop

    monkeypatch.setattr(jobs, "_REPORTER", stop_at_8)
    with pytest.raises(Stop):
        train_copy_model(job, tmp_path / "resumed")
    assert (tmp_path / "resumed" / STATE_FILE).is_file()  # the step-5 checkpoint
    monkeypatch.setattr(jobs, "_REPORTER", None)
    resumed_model, resumed = train_copy_model(job, tmp_path / "resumed")
    assert resumed == straight  # same batches, same optimizer state: the same run
    assert not (tmp_path / "resumed" / STATE_FILE).exists()
    assert json.loads((tmp_path / "resumed" / LOSS_FILE).read_text()) == straight
    # a finished folder is read back, not trained again; another config is another job
    model, losses = train_copy_model(job, tmp_path / "straight")
    assert losses == straight
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert (a == b).all()
    # how often a run is checkpointed changes nothing it computes: not part of the key
    assert replace(job, checkpoint_every=None).key == job.key
