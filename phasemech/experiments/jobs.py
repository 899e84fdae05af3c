"""Jobs: one unit of an experiment, declared as a small frozen config and keyed by its hash.

A job is data (what to compute) plus ``run(workdir)`` (how): the launcher ships it to a Ray
worker, runs it there and caches the JSON-able result it returns under the job's ``key``, a hash
of the job's kind and config. Two jobs with equal configs are the same job: the cache makes a
rerun of an experiment compute only what is missing.

Axes (of the frames jobs write): ``target`` rows, ``phase`` on the model's reference grid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from phasemech.training.config import TrainConfig


def _canonical(value: Any) -> Any:
    """JSON-able, order-independent form of a config (dataclasses, tuples, nested dicts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_dict"):
            return _canonical(value.to_dict())
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


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


@dataclass(frozen=True)
class TrainJob(Job):
    """Train ``train`` into ``workdir/run`` (resumable: a killed job continues from its last
    checkpoint), then score its final checkpoint on the task's phase-balanced test set."""

    kind: ClassVar[str] = "train"
    train: TrainConfig
    name: str = ""
    test_sequences: int = 512
    test_seed: int = 777

    @property
    def label(self) -> str:
        return self.name or super().label

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.core.grid import phase_of, reference_grid
        from phasemech.data.tasks import balanced_test_set
        from phasemech.measure.evaluate import predict
        from phasemech.model.transformer import PhaseTransformer
        from phasemech.training.trainer import train

        t0 = time.perf_counter()
        result = train(self.train, workdir / "run", resume=True, progress=False)
        model = PhaseTransformer.load(result.checkpoint)
        test = balanced_test_set(self.train.task, self.test_sequences, self.test_seed)
        correct = predict(model, test)[["source_pos", "correct"]].to_numpy()
        stride, offset = reference_grid(self.train.compression)
        phase = phase_of(correct[:, 0].astype(int), stride, offset)
        return {
            "step": result.step,
            "heldout_accuracy": result.accuracy,
            "test_accuracy": float(correct[:, 1].mean()),
            "test_accuracy_by_phase": [float(correct[phase == p, 1].mean()) for p in range(stride)],
            "seconds": time.perf_counter() - t0,
        }


__all__ = ["Job", "TrainJob"]
