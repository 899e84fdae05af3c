"""The audit as an experiment on the launcher (``phasemech audit``, ``phasemech run audit``):
one stage of :class:`~phasemech.experiments.audit.jobs.AuditJob`, then the report
(:mod:`phasemech.experiments.audit.summary`). :func:`run_audit` runs one
:class:`~phasemech.experiments.audit.config.AuditConfig` into a folder of its own; the
profiles (``tiny``: seconds on SmolLM2; ``default``: the audit's defaults) run into
``RUNS/audit_<profile>/``. Either way the jobs are cached under ``jobs/``: a rerun computes
nothing, a killed one resumes, and ``address`` joins a Ray cluster.

Axes: ``setting``, ``phase``, ``depth``, ``layer``, ``head``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.jobs import AuditJob, audit_jobs
from phasemech.experiments.experiment import Done, Experiment, run_study
from phasemech.experiments.probe.config import ProbeConfig


def check_audit(a: AuditConfig):
    """Every bad input, in one line, before any forward (the probe's checks: the model, its
    contexts, tokenizer, layers and position encoding); returns the model's source."""
    from phasemech.experiments.probe.worker import check_probe

    return check_probe(a.probe)


def _stage(a: AuditConfig, done: Done) -> list[AuditJob]:
    return audit_jobs(a)


def _finish(a: AuditConfig, done: Done, out: Path) -> dict[str, Any]:
    from phasemech.experiments.audit.summary import write_report

    results = [r for _, r in done.of(AuditJob)]
    targets = pd.DataFrame([r for res in results for r in res["targets"]])
    heads = pd.DataFrame([h for res in results for h in res["heads"]])
    worker_s = sum(res["seconds"] for res in results)
    wall_s = time.perf_counter() - done.started
    # partition's KV budget is a head's share of the model's query heads
    return write_report(a, targets, heads, out, wall_s, worker_s, done.checked.n_heads)


AUDIT = Experiment(
    name="audit",
    profiles={
        "tiny": AuditConfig(
            ProbeConfig(contexts=(256,), contents=2), attention_groups=1, n_boot=50, n_perm=50
        ),  # fmt: skip
        "default": AuditConfig(),
    },
    stages=(_stage,),
    finish=_finish,
    check=check_audit,
    about="per-phase retrieval of post-hoc designs on a real model, against the dense null",
)


def run_audit(a: AuditConfig, out: str | Path, **kw: Any) -> dict[str, Any]:
    """Run (or finish from the cache) the audit ``a`` into ``out``: tables, ``summary.md``,
    ``summary.json`` and ``audit.html``. Returns the summary; ``kw``: ``address``,
    ``num_cpus``, ``device``, ``progress`` (:func:`~phasemech.experiments.experiment.run_study`)."""
    return run_study(AUDIT, a, out, **kw)


__all__ = ["AUDIT", "check_audit", "run_audit"]
