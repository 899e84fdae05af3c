"""The pretrained sweep's job: a :class:`PasskeyJob` scores a
chunk of one setting's passkey prompts (every content at every phase, paired across
settings); the worker loads the model once.

Axes: ``layer, head, phase``; prompts are rows of tidy frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.jobs import Job, job_device, report_progress
from phasemech.experiments.pretrained.profiles import profile_settings
from phasemech.measure.pretrained import Scorer, Setting, SweepConfig, check_settings

#: one scorer per worker process: the model is loaded once for all the chunks it runs
_SCORER: list[Scorer] = []


@dataclass(frozen=True)
class PasskeyJob(Job):
    """Prompts ``start`` to ``stop`` of the profile's prompt set, scored under one setting
    (the first chunk of a setting also measures answer-step attention by phase)."""

    kind: ClassVar[str] = "passkey"
    setting: Setting
    sweep: SweepConfig
    start: int
    stop: int
    attention: bool

    @property
    def label(self) -> str:
        return f"{self.setting.name} [{self.start}:{self.stop}]"

    def run(self, workdir: Path) -> dict[str, Any]:
        dev = job_device()
        if not _SCORER or (_SCORER[0].model_name, _SCORER[0].device) != (self.sweep.model, dev):
            _SCORER[:] = [Scorer(model_name=self.sweep.model, device=dev)]
        ids = range(self.start, self.stop)
        scored, pa = _SCORER[0].score(self.setting, self.sweep, ids, self.attention)
        report_progress(1, 1)
        return {
            "targets": scored.to_dict(orient="list"),
            "attention": None if pa is None else pa.to_dict(orient="list"),
        }


def passkey_jobs(p: Profile, done: Done | None = None) -> list[PasskeyJob]:
    """Every setting's prompts in chunks of at least a batch (a few chunks per CPU balance the
    load; the model loads once per worker process)."""
    cfg, settings = p.get("sweep"), profile_settings(p.get("settings"))
    check_settings(settings, cfg.task)
    n = cfg.contents * cfg.task.stride
    chunk = max(cfg.batch_size, -(-n // 8))
    return [
        PasskeyJob(s, cfg, i, min(i + chunk, n), i == 0)
        for s in settings
        for i in range(0, n, chunk)
    ]


__all__ = ["PasskeyJob", "passkey_jobs"]
