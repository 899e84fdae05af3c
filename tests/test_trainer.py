"""Training loop: resumable to the bit, atomic checkpoints, clear errors, early stop, schedule."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.data.tasks import MQARTask
from phasemech.training.checkpoints import checkpoint_dirs, read_metrics
from phasemech.training.config import ModelSpec, TrainConfig
from phasemech.training.trainer import lr_factor, train


class Interrupt(Exception):
    pass


def tiny_config(**kw) -> TrainConfig:
    base = dict(
        task=MQARTask(vocab_size=32, seq_len=32, n_pairs=4, stride=4),
        model=ModelSpec(n_layers=2, d_model=32, n_heads=2),
        compression=CompressionConfig("gated", stride=4, window=8, layers=(1,)),
        steps=12,
        batch_size=8,
        eval_every=4,
        eval_sequences=16,
        warmup_steps=3,
        seed=3,
    )
    base.update(kw)
    return TrainConfig(**base)


def weights(run_dir) -> dict[str, torch.Tensor]:
    return PhaseTransformer.load(checkpoint_dirs(run_dir)[-1]).state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def interrupt_at(step_to_fail: int):
    def on_step(step: int, loss: float) -> None:
        if step == step_to_fail:
            raise Interrupt

    return on_step


def strip_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


@pytest.mark.parametrize(
    "comp",
    [
        CompressionConfig("gated", stride=4, window=8, layers=(1,)),
        # random offsets draw from torch's RNG every step: the RNG state must be restored
        CompressionConfig("mean", stride=4, window=4, offsets="random"),
    ],
    ids=["gated", "mean-random-offsets"],
)
# on_step runs before that step's evaluation: failing at 6 loses steps 5-6, at 9 only step 9
@pytest.mark.parametrize("fail_at, last_ckpt", [(6, 4), (9, 8)])
def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path, comp, fail_at, last_ckpt):
    cfg = tiny_config(compression=comp)
    straight = train(cfg, tmp_path / "a", progress=False)
    with pytest.raises(Interrupt):
        train(cfg, tmp_path / "b", progress=False, on_step=interrupt_at(fail_at))
    assert checkpoint_dirs(tmp_path / "b")[-1].name == f"step_{last_ckpt:06d}"
    resumed = train(cfg, tmp_path / "b", resume=True, progress=False)
    assert resumed.step == straight.step == cfg.steps
    assert_same_weights(weights(tmp_path / "a"), weights(tmp_path / "b"))
    # the log of the resumed run has no duplicated or lost evaluation lines
    assert strip_time(read_metrics(tmp_path / "a")) == strip_time(read_metrics(tmp_path / "b"))
    assert resumed.accuracy_by_phase == straight.accuracy_by_phase


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    cfg = tiny_config(steps=4)
    train(cfg, tmp_path / "a", progress=False)
    train(cfg, tmp_path / "b", progress=False)
    train(dataclasses.replace(cfg, seed=4), tmp_path / "c", progress=False)
    assert_same_weights(weights(tmp_path / "a"), weights(tmp_path / "b"))
    wa, wc = weights(tmp_path / "a"), weights(tmp_path / "c")
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_resume_of_finished_run_is_a_no_op(tmp_path):
    cfg = tiny_config(steps=4)
    first = train(cfg, tmp_path / "r", progress=False)
    again = train(cfg, tmp_path / "r", resume=True, progress=False)
    assert again.step == first.step and again.accuracy == first.accuracy
    assert len(read_metrics(tmp_path / "r")) == 1
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "done"  # the final summary line survives


def test_checkpoint_contents_and_metrics_log(tmp_path):
    cfg = tiny_config()
    train(cfg, tmp_path / "r", progress=False)
    names = [p.name for p in checkpoint_dirs(tmp_path / "r")]
    assert names == ["step_000004", "step_000008", "step_000012"]
    ckpt = checkpoint_dirs(tmp_path / "r")[-1]
    for f in ("config.json", "model.safetensors", "trainer.pt", "trainer.json"):
        assert (ckpt / f).is_file(), f
    info = json.loads((ckpt / "trainer.json").read_text())
    assert info["step"] == 12 and info["finished"] is True
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [4, 8, 12]
    for r in rows:
        assert len(r["accuracy_by_phase"]) == 4
        assert 0 <= r["accuracy"] <= 1 and math.isfinite(r["train_loss"])
    saved = json.loads((tmp_path / "r" / "train_config.json").read_text())
    assert TrainConfig.from_dict(saved) == cfg
    assert not list((tmp_path / "r" / "checkpoints").glob(".tmp-*"))


def test_leftover_temporary_checkpoint_is_ignored(tmp_path):
    cfg = tiny_config(steps=4)
    train(cfg, tmp_path / "r", progress=False)
    junk = tmp_path / "r" / "checkpoints" / ".tmp-step_000008-123"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"half written")
    assert [p.name for p in checkpoint_dirs(tmp_path / "r")] == ["step_000004"]


def test_existing_run_needs_resume_and_a_matching_config(tmp_path):
    cfg = tiny_config(steps=4)
    train(cfg, tmp_path / "r", progress=False)
    with pytest.raises(FileExistsError, match="resume"):
        train(cfg, tmp_path / "r", progress=False)
    with pytest.raises(ValueError, match=r"lr: 0.003 \(saved\) != 0.002 \(given\)"):
        train(dataclasses.replace(cfg, lr=2e-3), tmp_path / "r", resume=True, progress=False)


@pytest.mark.parametrize(
    "victim, payload, match",
    [
        ("model.safetensors", b"not a safetensors file", "could not be read"),
        ("trainer.pt", b"garbage", "could not be restored"),
        ("config.json", b"{not json", "not valid JSON"),
    ],
)
def test_corrupt_checkpoint_gives_a_clear_error(tmp_path, victim, payload, match):
    cfg = tiny_config()
    with pytest.raises(Interrupt):
        train(cfg, tmp_path / "r", progress=False, on_step=interrupt_at(6))
    (checkpoint_dirs(tmp_path / "r")[-1] / victim).write_bytes(payload)
    with pytest.raises(ValueError, match=match):
        train(cfg, tmp_path / "r", resume=True, progress=False)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    cfg = tiny_config(steps=4)
    train(cfg, tmp_path / "r", progress=False)
    other = tiny_config(steps=4, model=ModelSpec(n_layers=2, d_model=32, n_heads=4))
    ckpt = checkpoint_dirs(tmp_path / "r")[-1]
    other.build_model().save(ckpt)  # same folder, weights of a 4-head model
    with pytest.raises(ValueError, match="does not match"):
        train(cfg, tmp_path / "r", resume=True, progress=False)


def test_early_stop_at_target_accuracy(tmp_path):
    cfg = tiny_config(steps=40, target_accuracy=1e-9)  # any accuracy reaches it
    result = train(cfg, tmp_path / "r", progress=False)
    assert result.stopped_early and result.step == cfg.eval_every
    info = json.loads((result.checkpoint / "trainer.json").read_text())
    assert info["stopped_early"] is True


def test_constant_schedule_after_warmup():
    cfg = tiny_config(steps=100, warmup_steps=10)
    assert cfg.schedule == "constant"
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert [lr_factor(s, cfg) for s in (9, 10, 55, 100)] == [pytest.approx(1.0)] * 4


def test_learning_rate_schedule():
    cfg = tiny_config(steps=100, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.55)  # cosine midpoint
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    factors = [lr_factor(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(factors, factors[1:], strict=False))


def test_training_reduces_the_loss(tmp_path):
    cfg = tiny_config(steps=60, eval_every=30, lr=3e-3, batch_size=16)
    train(cfg, tmp_path / "r", progress=False)
    rows = read_metrics(tmp_path / "r")
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] < math.log(32) + 0.5


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", 0, "steps=0"),
        ("lr", -1.0, "lr=-1.0"),
        ("target_accuracy", 1.5, "target_accuracy=1.5"),
        ("eval_sequences", 10, "multiple of the task stride"),
        ("checkpoint_every", 0, "checkpoint_every=0"),
        ("min_lr_ratio", 2.0, "min_lr_ratio=2.0"),
        ("schedule", "linear", "schedule='linear'"),
        ("prefix_warmup", -1, "prefix_warmup=-1 is invalid: need int >= 0"),
    ],
)
def test_bad_train_config_is_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{field: value})


def test_train_config_dict_round_trip_and_unknown_fields():
    cfg = tiny_config(compression=CompressionConfig("route", stride=4, top_k=3, layers=(0, 1)))
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig.from_dict({**cfg.to_dict(), "learning_rate": 1})
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig.from_dict({**cfg.to_dict(), "model": {"heads": 3}})


def test_task_stride_must_be_a_multiple_of_the_compression_stride():
    with pytest.raises(ValueError, match="does not divide the task's stride=4"):
        tiny_config(compression=CompressionConfig("mean", stride=8, layers=(1,)))
    with pytest.raises(ValueError, match="multiple of eval_every=4"):
        tiny_config(checkpoint_every=6)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_heads=0), "n_heads=0"),
        (dict(n_heads=3), "not divisible by n_heads=3"),
        (dict(normalization_type="BN"), "normalization_type='BN'"),
        (dict(d_head=0), "d_head=0"),
    ],
)
def test_bad_model_spec_is_refused_before_a_folder_is_written(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec(**kw)
    assert not (tmp_path / "r").exists()


def test_fresh_run_into_a_folder_with_foreign_checkpoints_is_refused(tmp_path):
    cfg = tiny_config(steps=4)
    train(cfg, tmp_path / "r", progress=False)
    (tmp_path / "r" / "train_config.json").unlink()
    with pytest.raises(FileExistsError, match="holds no train_config.json"):
        train(cfg, tmp_path / "r", progress=False)


def test_prefix_warmup_widens_the_spread_from_one_position_to_the_stride():
    cfg = tiny_config(task=MQARTask(vocab_size=32, seq_len=32, n_pairs=4, stride=8),
                      compression=CompressionConfig("gated", stride=8, window=16, layers=(1,)),
                      prefix_warmup=70)  # fmt: skip
    spreads = [cfg.prefix_spread(s) for s in range(80)]
    assert spreads[0] == 1 and spreads[69] == 7 and set(spreads[70:]) == {None}
    assert spreads[:70] == sorted(spreads[:70]) and set(spreads[:70]) == set(range(1, 8))
    assert [spreads[10 * k] for k in range(7)] == list(range(1, 8))  # 10 steps a position
    assert tiny_config().prefix_spread(0) is None  # off by default: the full spread throughout


def test_prefix_warmup_stays_out_of_old_configs_and_round_trips():
    # a default of 0 leaves the dict (so cache keys and saved configs of older runs still match)
    assert "prefix_warmup" not in tiny_config().to_dict()
    cfg = tiny_config(prefix_warmup=6)
    assert cfg.to_dict()["prefix_warmup"] == 6
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_prefix_warmup_trains_on_narrowed_batches_and_resumes_exactly(tmp_path, monkeypatch):
    from phasemech.training import trainer

    seen = []
    real = trainer.task_batch

    def spy(task, batch, seed, step, spread=None):
        seen.append((step, spread))
        return real(task, batch, seed, step, spread)

    monkeypatch.setattr(trainer, "task_batch", spy)
    cfg = tiny_config(prefix_warmup=8)
    train(cfg, tmp_path / "a", progress=False)
    assert seen == [(s, cfg.prefix_spread(s)) for s in range(12)]
    assert [sp for _, sp in seen] == [1, 1, 1, 2, 2, 2, 3, 3, None, None, None, None]
    with pytest.raises(Interrupt):
        train(cfg, tmp_path / "b", progress=False, on_step=interrupt_at(6))
    train(cfg, tmp_path / "b", resume=True, progress=False)
    assert_same_weights(weights(tmp_path / "a"), weights(tmp_path / "b"))
    other = tiny_config(prefix_warmup=0)
    train(other, tmp_path / "c", progress=False)
    a, c = weights(tmp_path / "a"), weights(tmp_path / "c")
    assert any(not torch.equal(a[k], c[k]) for k in a)
