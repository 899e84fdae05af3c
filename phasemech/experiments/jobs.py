"""Jobs: one unit of an experiment, declared as a small frozen config and keyed by its hash.

A job is data (what to compute) plus ``run(workdir)`` (how): the launcher ships it to a Ray
worker, runs it there and caches the JSON-able result it returns under the job's ``key``, a hash
of the job's kind and config. Two jobs with equal configs are the same job: the cache makes a
rerun of an experiment compute only what is missing.

A field marked :func:`payload` travels with the job but is not part of its config or key: the
data a job works on when that data is itself named by the config (a statistics job carries the
scored targets of the training jobs whose keys its config lists). Results travel back through
Ray, so an experiment's numbers never depend on a shared filesystem.

Axes (of the frames jobs return): ``target`` rows, ``phase`` on the model's reference grid.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from phasemech.training.config import TrainConfig


def payload(**kwargs: Any) -> Any:
    """A dataclass field that travels with the job but is left out of its config and key."""
    return field(compare=False, repr=False, metadata={"payload": True}, **kwargs)


def _canonical(value: Any) -> Any:
    """JSON-able, order-independent form of a config (dataclasses, tuples, nested dicts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_dict"):
            return _canonical(value.to_dict())
        fields = [f for f in dataclasses.fields(value) if not f.metadata.get("payload")]
        return {f.name: _canonical(getattr(value, f.name)) for f in fields}
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


#: set by the launcher inside a worker: ``report(done, total)`` feeds the job's progress row
_REPORTER: Callable[[float, float], None] | None = None


#: set by the launcher inside a worker: the device the launch asked for (``auto``, ``cpu``, ...)
_DEVICE: str = "cpu"


def job_device():
    """The torch device a job runs its models on (``auto`` in a worker: CUDA where Ray gave
    the job a GPU, else the CPU)."""
    from phasemech.core.device import resolve_device

    return resolve_device(_DEVICE)


def report_progress(done: float, total: float) -> None:
    """Tell the launcher how far the running job is (its row shows progress and an ETA);
    a no-op outside the launcher."""
    if _REPORTER is not None:
        _REPORTER(done, total)


class Job:
    """Base of every job: a frozen dataclass with a ``kind`` and a ``run`` method."""

    kind: ClassVar[str] = "job"

    @property
    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, **_canonical(self)}

    @property
    def key(self) -> str:
        """Stable hash of the job's kind and config (the cache key; 16 hex digits)."""
        text = json.dumps(self.config, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        """A short human name for progress lines and failure reports."""
        return f"{self.kind}:{self.key[:8]}"

    def run(self, workdir: Path) -> dict[str, Any]:
        """Compute the job inside ``workdir`` (a folder of the job's own); return JSON-able."""
        raise NotImplementedError


# ------------------------------------------------------------------------------ train + score


def pack_bits(correct: np.ndarray) -> str:
    """0/1 per target as base64 of packed bits: a 4096-sequence test set in ~5 KB of JSON."""
    return base64.b64encode(np.packbits(np.asarray(correct, dtype=bool)).tobytes()).decode()


def unpack_bits(text: str, n: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))
    return bits[:n].astype(bool)


@dataclass(frozen=True)
class TrainJob(Job):
    """Train ``train`` into ``workdir/<name>`` (resumable: a killed job continues from its last
    checkpoint), then score its final checkpoint (every checkpoint with ``score_all``) on the
    task's phase-balanced test set. The result holds each scored checkpoint's ``correct`` per
    target (:func:`pack_bits`), the held-out curve along training, and per-phase accuracy of
    the final checkpoint; :func:`scored_targets` turns it back into a targets frame."""

    kind: ClassVar[str] = "train"
    train: TrainConfig
    name: str = ""
    test_sequences: int = 512
    test_seed: int = 777
    score_all: bool = False
    #: the task of the test set when it differs from the training task (e.g. training data
    #: with jittered pair spacing, scored on the plain task)
    test_task: Any = None

    @property
    def label(self) -> str:
        return self.name or super().label

    def run_dir(self, workdir: Path) -> Path:
        """The run folder inside the job's own folder, named after the model (``run``
        without a name): ``phasemech dashboard`` and ``find_runs`` list runs by it."""
        return workdir / (self.name or "run")

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.training.checkpoints import checkpoint_dirs, read_metrics
        from phasemech.training.trainer import train

        t0 = time.perf_counter()
        steps = self.train.steps
        run_dir = self.run_dir(workdir)
        result = train(
            self.train,
            run_dir,
            resume=True,
            progress=False,
            on_step=lambda step, loss: report_progress(step + 1, steps),
            device=job_device(),
        )
        seconds = time.perf_counter() - t0
        ckpts = checkpoint_dirs(run_dir) if self.score_all else [result.checkpoint]
        scores = {int(c.name.removeprefix("step_")): self._score(c) for c in ckpts}
        final = scores[result.step]
        curve = [
            {k: m[k] for k in ("step", "accuracy", "accuracy_by_phase")}
            for m in read_metrics(run_dir)
        ]
        return {
            "step": result.step,
            "stopped_early": result.stopped_early,
            "heldout_accuracy": result.accuracy,
            "test_accuracy": final["accuracy"],
            "test_accuracy_by_phase": final["by_phase"],
            "scores": {str(s): v["bits"] for s, v in scores.items()},
            "curve": curve,
            "train_seconds": seconds,
            "seconds": time.perf_counter() - t0,
        }

    def _score(self, ckpt: Path) -> dict[str, Any]:
        from phasemech.core.device import move
        from phasemech.core.grid import phase_of, reference_grid
        from phasemech.measure.evaluate import predict
        from phasemech.model.transformer import PhaseTransformer

        df = predict(move(PhaseTransformer.load(ckpt), job_device()), self.test_set())
        correct = df["correct"].to_numpy()
        stride, offset = reference_grid(self.train.compression)
        phase = phase_of(df["source_pos"].to_numpy(), stride, offset)
        by_phase = [float(correct[phase == p].mean()) for p in range(stride)]
        return {"bits": pack_bits(correct), "accuracy": float(correct.mean()), "by_phase": by_phase}

    @property
    def scored_task(self):
        return self.train.task if self.test_task is None else self.test_task

    def test_set(self):
        return _test_set(self.scored_task, self.test_sequences, self.test_seed)


def trained_run(workdir: Path, train: TrainJob) -> Path:
    """For a job that reads a trained model: the train job's run folder beside ``workdir``
    (``work/<train key>/<name>``), trained there first if it is missing (a worker on another
    machine without a shared filesystem; training is deterministic, so the model is the same)."""
    from phasemech.training.trainer import train as train_model

    run = train.run_dir(workdir.parent / train.key)
    train_model(train.train, run, resume=True, progress=False, device=job_device())
    return run


@functools.lru_cache(maxsize=8)
def _test_set(task, sequences: int, seed: int):
    from phasemech.data.tasks import balanced_test_set

    return balanced_test_set(task, sequences, seed)


@functools.lru_cache(maxsize=8)
def _targets(task, sequences: int, seed: int) -> pd.DataFrame:
    from phasemech.data.tasks import targets_frame

    return targets_frame(_test_set(task, sequences, seed))


def scored_targets(job: TrainJob, result: dict[str, Any]) -> pd.DataFrame:
    """One row per (scored checkpoint, test target): the test set's target columns
    (``targets_frame``: ``group_id, target, source_pos, depth, distance, ...``), ``correct``
    and ``step``, rebuilt from a :class:`TrainJob` result (the test set is a pure function of
    the task and its seed, so only ``correct`` travels)."""
    base = _targets(job.scored_task, job.test_sequences, job.test_seed)
    frames = []
    for step, bits in sorted(result["scores"].items(), key=lambda kv: int(kv[0])):
        frames.append(base.assign(correct=unpack_bits(bits, len(base)), step=int(step)))
    return pd.concat(frames, ignore_index=True)


__all__ = [
    "Job",
    "TrainJob",
    "job_device",
    "pack_bits",
    "payload",
    "report_progress",
    "scored_targets",
    "trained_run",
]
