"""``phasemech audit``: does a compression design's retrieval depend on the needle's phase, on a
real model, at long context, in the regime the design serves?

Axes: ``setting`` (``null``: the uncompressed model; then one per design), ``phase``, ``depth``,
``layer``, ``head``; prompts are rows of tidy frames.

An audit is one :class:`AuditConfig`: a model, one or more designs (each a post-hoc
:class:`~phasemech.core.config.CompressionConfig` on the model's own weights), a regime
(``trained``: every query reads the compressed history; ``decode``: a full-attention prefill of
the document, then the question and answer read the compressed cache,
:mod:`phasemech.model.decode`), contexts and a retrieval task whose prompts put every content
at every phase at every depth (:mod:`phasemech.data.retrieval`). The null and every design
score the SAME prompts (paired). Prompts run in chunks as jobs on the experiment launcher
(embedded Ray, or a cluster by ``address``), cached by config under ``OUT/jobs``: a rerun (or
one with other statistics sizes) computes nothing, a killed one resumes; other prompts,
designs or grids are a new audit. In the decode regime one prefill serves the null and every
design. :mod:`phasemech.experiments.audit_report` turns the scored prompts into the
audit's tables, ``summary.md`` and ``audit.html``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.core.config import SINK_DESIGNS, TOP_K_DESIGNS, CompressionConfig
from phasemech.core.validation import is_int
from phasemech.data.retrieval import TASK_KINDS, RetrievalTask
from phasemech.experiments.audit_fixes import apply_variant, check_variants, kv_budget, random_shift
from phasemech.experiments.jobs import Job, job_device, report_progress
from phasemech.model.decode import REGIMES

#: position encodings a compressed layer can host (keys carry their positions)
HOSTS = ("standard", "shortformer", "rotary")
#: grid offsets an audit takes: phases are reported on the aligned reference grid (``random``:
#: one shift per prompt, :func:`~phasemech.experiments.audit_fixes.random_shift`)
AUDIT_OFFSETS = ("aligned", "per_layer", "per_head", "per_layer_head", "random")
#: designs an audit applies post hoc (no trained parameters)
AUDIT_DESIGNS = ("mean", "route", "evict", "quest", "kpool", "partition")


@dataclass(frozen=True)
class AuditConfig:
    """What to audit. ``designs``: one or more of :data:`AUDIT_DESIGNS`, each with the same
    grid (``stride``, ``window``, ``top_k`` for selecting designs, ``layers``, ``offsets``,
    ``block_len``, ``obs_window`` for ``evict``). ``contexts``: prompt lengths in tokens.
    ``contents``: contents per context, each at every phase (``contents x stride`` prompts).
    ``attention_groups``: the first contents (consecutive contents cycle through the depths)
    whose prompts, at every phase, also give per-head attention onto the needle.
    ``variants``: ``aligned`` (the grid above) and the fixes to compare with it, each applied to
    every design that can take it (:mod:`phasemech.experiments.audit_fixes`)."""

    designs: tuple[str, ...] = ("route",)
    model: str = "smollm2-135m"
    stride: int = 4
    window: int | None = 16
    top_k: int | None = 8
    layers: tuple[int, ...] | None = None
    offsets: str = "aligned"
    block_len: int | None = None
    obs_window: int | None = None
    regime: str = "decode"  # one shared prefill: the cheaper regime (docs/audit.md, Cost)
    contexts: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    task: str = "passkey"
    distractors: int | None = None
    contents: int = 50
    seed: int = 0
    attention_groups: int = 5
    n_boot: int = 1000
    n_perm: int = 1000
    variants: tuple[str, ...] = ("aligned",)
    #: the attention sink of the selecting designs (``CompressionConfig.sink_tokens``)
    sink_tokens: int | None = None

    def __post_init__(self) -> None:
        bad = [d for d in self.designs if d not in AUDIT_DESIGNS]
        if not self.designs or bad or len(set(self.designs)) != len(self.designs):
            raise ValueError(
                f"AuditConfig: designs={self.designs!r} is invalid: allowed one or more of "
                f"{AUDIT_DESIGNS}, each once (the others need trained compressors, gates or "
                "indexers)"
            )
        if self.regime not in REGIMES:
            raise ValueError(f"AuditConfig: regime={self.regime!r} is invalid: allowed {REGIMES}")
        if self.task not in TASK_KINDS:
            raise ValueError(f"AuditConfig: task={self.task!r} is invalid: allowed {TASK_KINDS}")
        if self.offsets not in AUDIT_OFFSETS:
            raise ValueError(
                f"AuditConfig: offsets={self.offsets!r} is invalid: allowed {AUDIT_OFFSETS} "
                "(phases are reported on the aligned grid, which these share)"
            )
        check_variants(self.variants)
        self._check_sink()
        for name in ("contents", "attention_groups"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"AuditConfig: {name}={v!r} is invalid: expected an int >= 1")
        if not self.contexts or not all(is_int(c) and c >= 64 for c in self.contexts):
            raise ValueError(
                f"AuditConfig: contexts={self.contexts!r} is invalid: expected ints >= 64"
            )
        if len(self.variants) > 1 and self.offsets != "aligned":
            raise ValueError(
                f"AuditConfig: offsets={self.offsets!r} is invalid with fixes: a fix is compared "
                "with the aligned grid; allowed offsets='aligned' (the offset fixes are --fix "
                "per_head, per_layer, per_layer_head, random)"
            )
        for design in self.designs:  # every compression is checked before any work
            self.compression(design)
        unused = [v for v in self.variants if not any(self._takes(d, v) for d in self.designs)]
        if unused:
            raise ValueError(
                f"AuditConfig: variants {unused} apply to none of designs {list(self.designs)}: "
                f"{'; '.join(self.skipped())}"
            )
        self.retrieval_task(self.contexts[0])

    def _check_sink(self) -> None:
        if self.sink_tokens is None:
            return
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(
                f"AuditConfig: sink_tokens={self.sink_tokens!r} is invalid: expected an int >= 0"
            )
        if self.sink_tokens == 0:
            object.__setattr__(self, "sink_tokens", None)  # no sink: the audit's key of before
        elif not any(d in SINK_DESIGNS for d in self.designs):
            raise ValueError(
                f"AuditConfig: sink_tokens={self.sink_tokens} applies to none of designs "
                f"{list(self.designs)}: allowed with {SINK_DESIGNS}"
            )

    @functools.cached_property
    def _grids(self) -> dict[tuple[str, str], CompressionConfig | str]:
        """Each (design, variant): its compression, or why the design cannot take it."""
        out: dict[tuple[str, str], CompressionConfig | str] = {}
        for design, variant in itertools.product(self.designs, self.variants):
            try:
                out[design, variant] = apply_variant(self._compression(design), variant)
            except ValueError as err:
                out[design, variant] = str(err).splitlines()[0]
        return out

    def compression(self, design: str, variant: str = "aligned") -> CompressionConfig:
        """The design's compression under ``variant`` (a ``ValueError`` if it cannot take it)."""
        grid = self._grids[design, variant]
        if isinstance(grid, str):
            raise ValueError(grid)
        return grid

    def _takes(self, design: str, variant: str) -> bool:
        return not isinstance(self._grids[design, variant], str)

    def skipped(self) -> list[str]:
        """``design/variant: why`` for each pair the design cannot take."""
        return [f"{d}/{v}: {why}" for (d, v), why in self._grids.items() if isinstance(why, str)]

    def _compression(self, design: str) -> CompressionConfig:
        return CompressionConfig(
            design,
            stride=self.stride,
            window=self.window,
            top_k=self.top_k if design in TOP_K_DESIGNS else None,
            layers=self.layers,
            offsets=self.offsets,
            block_len=self.block_len,
            obs_window=self.obs_window if design == "evict" else None,
            sink_tokens=self.sink_tokens if design in SINK_DESIGNS else None,
        )

    def retrieval_task(self, context: int) -> RetrievalTask:
        kw = dict(kind=self.task, context=context, depths=self.depths, stride=self.stride)
        return RetrievalTask(**kw, distractors=self.distractors)

    def settings(self) -> list[tuple[str, CompressionConfig | None]]:
        """``(name, compression)``: the null first, then each design under each variant it
        can take (the aligned baseline first)."""
        return [("null", None)] + [
            (self.setting_name(d, v), self.compression(d, v))
            for d, v in itertools.product(self.designs, self.variants)
            if self._takes(d, v)
        ]

    def setting_name(self, design: str, variant: str = "aligned") -> str:
        c = self.compression(design, variant)
        k = f"_k{c.top_k}" if c.top_k is not None else ""
        sink = f"_s{c.sink_tokens}" if c.sink_tokens else ""
        suffix = "" if variant == "aligned" else f"_{variant}"
        return f"{design}_d{c.stride}_w{c.window}{k}{sink}{suffix}"

    def setting_meta(self, n_heads: int = 0) -> dict[str, dict[str, Any]]:
        """Per setting name: its design, variant and KV budget per context (``n_heads``: the
        model's query heads, for ``partition``'s share)."""
        out = {"null": dict(design="null", variant="aligned",
                            budget={c: kv_budget(None, c) for c in self.contexts})}  # fmt: skip
        for (d, v), comp in self._grids.items():
            if not isinstance(comp, str):
                budget = {c: kv_budget(comp, c, n_heads) for c in self.contexts}
                out[self.setting_name(d, v)] = dict(design=d, variant=v, budget=budget)
        return out

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["sink_tokens"] is None:  # the cache keys of audits written before it existed
            del out["sink_tokens"]
        return out


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
        from phasemech.experiments.audit_score import score_prompt

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
    from phasemech.experiments.audit_report import write_report
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


__all__ = ["AUDIT_DESIGNS", "AuditConfig", "AuditJob", "audit_jobs", "check_audit", "run_audit"]
