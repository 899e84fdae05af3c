"""The audit's jobs: its prompts in chunks as :class:`AuditJob` on the experiment launcher,
scored by the real-model worker (:mod:`phasemech.experiments.probe.worker`: the model loaded
once per worker process, its tensors shared with every design), cached by config under
``OUT/jobs``.

Axes: ``setting``, ``phase``, ``depth``, ``layer``, ``head``; prompts are rows of tidy frames.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.jobs import Job, job_device, report_progress
from phasemech.experiments.probe.config import random_shift


@dataclass(frozen=True)
class AuditJob(Job):
    """Prompts ``start`` to ``stop`` of one context's prompt set, scored by the null and
    every design of ``audit`` (the prompts of the first ``attention_groups`` contents also
    give per-head attention from the answer onto the needle)."""

    kind: ClassVar[str] = "audit"
    audit: AuditConfig
    context: int
    start: int
    stop: int

    @property
    def label(self) -> str:
        return f"T={self.context} [{self.start}:{self.stop}]"

    def run(self, workdir: Path) -> dict[str, Any]:
        from phasemech.experiments.probe.worker import WORKER, score_prompt

        a, p = self.audit, self.audit.probe
        base, batch = WORKER.probe(p, self.context, job_device())
        models = [(n, WORKER.setting(c)) for n, c in a.settings()]
        rows, heads = [], []
        t0 = time.perf_counter()
        for i in range(self.start, self.stop):
            attend = int(batch.frame.group_id.iloc[i]) < a.attention_groups
            shift = random_shift(p.seed, self.context, int(batch.frame.prompt_id.iloc[i]), p.stride)
            r, h = score_prompt(base, models, batch, i, p.regime, attend, shift)
            rows += [dict(x, context=self.context) for x in r]
            heads += [dict(x, context=self.context) for x in h]
            report_progress(i + 1 - self.start, self.stop - self.start)
        seconds = time.perf_counter() - t0
        return {"targets": rows, "heads": heads, "seconds": seconds}


def audit_jobs(a: AuditConfig, chunks_per_context: int = 8) -> list[AuditJob]:
    """Every context's prompts in chunks (a few chunks per CPU balance the load; the model
    loads once per worker process). The statistics' sizes are not part of a job's key."""
    a = dataclasses.replace(a, n_boot=0, n_perm=0)
    jobs = []
    for context in a.probe.contexts:
        n = a.probe.contents * a.probe.stride
        chunk = max(1, -(-n // chunks_per_context))
        jobs += [AuditJob(a, context, i, min(i + chunk, n)) for i in range(0, n, chunk)]
    return jobs


__all__ = ["AuditJob", "audit_jobs"]
