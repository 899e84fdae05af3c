"""The audit's jobs and its run: prompts in chunks as
:class:`AuditJob` on the experiment launcher (the worker loads the model once and shares its
tensors with every design), cached by config under ``OUT/jobs``; :func:`run_audit` checks the
inputs, runs the jobs and writes the report (:mod:`phasemech.experiments.audit.summary`).

Axes: ``setting``, ``phase``, ``depth``, ``layer``, ``head``; prompts are rows of tidy frames.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.core.config import CompressionConfig
from phasemech.data.retrieval import RetrievalTask
from phasemech.experiments.audit.config import HOSTS, AuditConfig
from phasemech.experiments.audit.fixes import random_shift
from phasemech.experiments.jobs import Job, job_device, report_progress


# ------------------------------------------------------------------------------ worker side
class _Worker:
    """One per worker process: the model (loaded once), its compressed copies, the prompts."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.base = None
        self.compressed: dict[str, Any] = {}
        self.prompts: dict[tuple, Any] = {}
        self.bos = False  # the model's prompts start with BOS (ModelSource.prepend_bos)

    def model(self, spec: str, n_ctx: int, device):
        from phasemech.model.fast import linear_layout, use_eval_sdpa
        from phasemech.model.sources import describe, load

        if self.key != (spec, str(device)) or self.base.cfg.n_ctx < n_ctx:
            self.prompts = {}
            source = describe(spec)
            self.bos = source.prepend_bos
            self.base = load(source, min(source.max_context, max(n_ctx, 2048)), device)
            use_eval_sdpa(self.base)  # dense attention through SDPA where nothing reads scores
            linear_layout(self.base)  # no per-forward weight copies (shared by the designs)
            self.key, self.compressed = (spec, str(device)), {}
        return self.base

    def setting(self, comp: CompressionConfig | None):
        from phasemech.model.fast import use_eval_sdpa
        from phasemech.model.transformer import PhaseTransformer

        if comp is None:
            return self.base
        name = json.dumps(comp.to_dict(), sort_keys=True)  # the whole config, not a label
        if name not in self.compressed:
            model = PhaseTransformer.from_hooked(self.base, comp).eval()
            # post hoc designs add no parameters: share the base's tensors instead of a copy
            # per design (a worker holds the model once, however many designs it scores)
            model.load_state_dict(self.base.state_dict(), strict=False, assign=True)
            use_eval_sdpa(model)  # its uncompressed layers
            self.compressed[name] = model
        return self.compressed[name]

    def batch(self, task: RetrievalTask, contents: int, seed: int):
        from phasemech.data.retrieval import build_retrieval_prompts

        key = (self.key, task, contents, seed)  # prompts are the model's tokenizer's
        if key not in self.prompts:
            tok, bos = self.base.tokenizer, self.bos
            self.prompts = {key: build_retrieval_prompts(tok, task, contents, seed, bos=bos)}
        return self.prompts[key]


_WORKER = _Worker()


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
        from phasemech.experiments.audit.score import score_prompt

        a = self.audit
        base = _WORKER.model(a.model, self.context + 64, job_device())
        batch = _WORKER.batch(a.retrieval_task(self.context), a.contents, a.seed)
        models = [(n, _WORKER.setting(c)) for n, c in a.settings()]
        rows, heads = [], []
        t0 = time.perf_counter()
        for i in range(self.start, self.stop):
            attend = int(batch.frame.group_id.iloc[i]) < a.attention_groups
            shift = random_shift(a.seed, self.context, int(batch.frame.prompt_id.iloc[i]), a.stride)
            r, h = score_prompt(base, models, batch, i, a.regime, attend, shift)
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
    for context in a.contexts:
        n = a.contents * a.stride
        chunk = max(1, -(-n // chunks_per_context))
        jobs += [AuditJob(a, context, i, min(i + chunk, n)) for i in range(0, n, chunk)]
    return jobs


def check_audit(a: AuditConfig):
    """Every bad input fails here, in one line, before any forward: the model spec, contexts
    longer than the model was trained for, a tokenizer that cannot place the needle on every
    phase, a design the model's attention cannot host, layers the model lacks. Returns the
    model's resolved source (``phasemech.model.sources.ModelSource``)."""
    from phasemech.data.retrieval import check_task
    from phasemech.model.sources import describe, tokenizer

    source = describe(a.model)
    too_long = [c for c in a.contexts if c > source.max_context]
    if too_long:
        raise ValueError(
            f"contexts {too_long} are invalid: {a.model!r} was trained to {source.max_context} "
            f"tokens; allowed 64..{source.max_context}"
        )
    tok = tokenizer(source)
    for c in a.contexts:
        check_task(tok, a.retrieval_task(c), source.max_context, bos=source.prepend_bos)
    _check_host(a, source)
    return source


def _check_host(a: AuditConfig, source) -> None:
    if a.layers is not None and max(a.layers) >= source.n_layers:
        raise ValueError(
            f"layers={list(a.layers)} is invalid: {a.model!r} has {source.n_layers} layers; "
            f"allowed 0..{source.n_layers - 1}"
        )
    if source.positional not in HOSTS:
        raise ValueError(
            f"model {a.model!r} uses {source.positional} position encoding, which compressed "
            f"attention cannot host (an additive bias over [pos, key_pos]); allowed {HOSTS}"
        )


def run_audit(
    a: AuditConfig,
    out: str | Path,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Run (or finish from the cache) the audit ``a`` into ``out``: tables, ``summary.md``,
    ``summary.json`` and ``audit.html``. Returns the summary."""
    from phasemech.experiments.audit.summary import write_report
    from phasemech.experiments.experiment import launch_results, ray_session

    source = check_audit(a)
    out = Path(out)
    t0 = time.perf_counter()
    with ray_session(address, num_cpus) as ensure:
        results = launch_results(ensure, audit_jobs(a), out, "audit", progress, device)
    targets = pd.DataFrame([r for res in results for r in res["targets"]])
    heads = pd.DataFrame([h for res in results for h in res["heads"]])
    worker_s = sum(res["seconds"] for res in results)
    # partition's KV budget is a head's share
    wall_s = time.perf_counter() - t0
    return write_report(a, targets, heads, out, wall_s, worker_s, source.n_heads)


__all__ = ["AuditJob", "audit_jobs", "check_audit", "run_audit"]
