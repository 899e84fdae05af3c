"""``phasemech explain``: which components make a real model's weak phase weak? Selection,
layers and heads, by causal intervention on the audit's own prompts.

Axes: ``prompt`` (the audit's paired prompts: every content at every phase), ``pair`` (one
content: clean at its strong phase, corrupted at its weak one), ``layer``, ``head``, ``phase``.

An explanation is one :class:`ExplainConfig`: one design and grid on one model, in one regime,
at one context, on the prompts ``phasemech audit`` scores (the same task, contents and seed
give the same prompts). It runs in three steps through the experiment launcher, each step's
jobs cached under ``OUT/jobs`` (a rerun computes nothing, a killed one resumes):

1. ``observe`` (every prompt): the answer under the null and the design, the needle's
   selection in every selecting layer and head (:func:`~phasemech.interventions.oracle.
   needle_selection`), the oracle forcing the needle's block in every layer (four forms: add
   or replace, at the answer rows or every row after the needle) and in each layer alone (add
   and replace at every row after the needle; :func:`~phasemech.interventions.oracle.
   force_needle`), and each head's mean output;
2. ``intervene``: zero and mean ablation of every head on every prompt, and on each content's
   (strong, weak) pair the exact patching of every head and every layer's residual, and
   attribution patching of every head (:mod:`phasemech.interventions.prompt_patching`). The
   strong and weak phases are the design's best and worst accuracy in step 1 unless
   ``contrast_phases`` names them; only contents whose strong-phase prompt is answered right
   (first token) are paired;
3. ``heads``: the oracle again, in the ``top_heads`` heads that matter most (largest exact
   patching effect).

Beside step 2 runs ``attend`` (every prompt): each head's attention from the row predicting
the first answer token onto the needle's first answer token, under the null and the design
(as the audit reads it: ``hook_pattern``, or ``hook_token_pattern`` on compressed layers).

:mod:`phasemech.experiments.explain_tables` turns the results into the tables and the page.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from phasemech.core.validation import is_int
from phasemech.experiments.audit import AuditConfig
from phasemech.experiments.jobs import Job, job_device, payload, report_progress

ANALYSES = ("selection", "oracle", "ablation", "patching")
#: designs whose selection the selection and oracle analyses read
SELECTING = ("route", "quest", "kpool", "evict")


@dataclass(frozen=True)
class ExplainConfig:
    """What to explain: ``design`` with the audit's grid fields (``offsets`` among them: phases
    stay those of the aligned reference grid, as the audit reports them), ``regime``, ``context``,
    ``contents`` (each at every phase), ``contrast_phases`` (``(clean, corrupted)``; default the
    strongest and weakest phase), ``analyses`` (any of :data:`ANALYSES`), ``per_layer_oracle``
    (the oracle in each layer alone; default in ``decode`` only, where a copy is cheap) and
    ``top_heads`` (heads the step-3 oracle forces)."""

    design: str = "route"
    model: str = "smollm2-135m"
    stride: int = 4
    window: int | None = 16
    top_k: int | None = 1
    layers: tuple[int, ...] | None = None
    offsets: str = "aligned"
    block_len: int | None = None
    obs_window: int | None = None
    regime: str = "decode"
    context: int = 1024
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    task: str = "passkey"
    distractors: int | None = None
    contents: int = 50
    seed: int = 0
    contrast_phases: tuple[int, int] | None = None
    analyses: tuple[str, ...] = ANALYSES
    per_layer_oracle: bool | None = None
    top_heads: int = 10
    n_boot: int = 1000
    n_perm: int = 1000

    def __post_init__(self) -> None:
        bad = [a for a in self.analyses if a not in ANALYSES]
        if not self.analyses or bad:
            raise ValueError(
                f"ExplainConfig: analyses={self.analyses!r} is invalid: allowed any of {ANALYSES}"
            )
        picks = [a for a in self.analyses if a in ("selection", "oracle")]
        if picks and self.design not in SELECTING:
            raise ValueError(
                f"ExplainConfig: analyses {picks} are invalid for design {self.design!r}: it "
                f"selects no blocks; allowed designs {SELECTING} (or analyses ablation, patching)"
            )
        if self.contrast_phases is not None:
            cp = tuple(self.contrast_phases)
            if (
                len(cp) != 2
                or not all(is_int(p) and 0 <= p < self.stride for p in cp)
                or cp[0] == cp[1]
            ):
                raise ValueError(
                    f"ExplainConfig: contrast_phases={self.contrast_phases!r} is invalid: "
                    f"expected two different phases in 0..{self.stride - 1} (clean, corrupted)"
                )
        if not is_int(self.top_heads) or self.top_heads < 1:
            raise ValueError(
                f"ExplainConfig: top_heads={self.top_heads!r} is invalid: expected an int >= 1"
            )
        self.audit()  # the design, grid, task and sizes, checked as the audit checks them

    def audit(self) -> AuditConfig:
        """The audit whose prompts and grid this explains (its null and one design)."""
        return AuditConfig(
            designs=(self.design,),
            model=self.model,
            stride=self.stride,
            window=self.window,
            top_k=self.top_k,
            layers=self.layers,
            offsets=self.offsets,
            block_len=self.block_len,
            obs_window=self.obs_window,
            regime=self.regime,
            contexts=(self.context,),
            depths=self.depths,
            task=self.task,
            distractors=self.distractors,
            contents=self.contents,
            seed=self.seed,
        )

    @property
    def setting(self) -> str:
        name = self.audit().setting_name(self.design)
        return name if self.offsets == "aligned" else f"{name}_{self.offsets}"

    def to_dict(self) -> dict[str, Any]:
        """The cache key's form: the aligned grid leaves ``offsets`` out, so runs recorded
        before the field existed keep their keys."""
        out = dataclasses.asdict(self)
        if out["offsets"] == "aligned":
            del out["offsets"]
        return out

    @property
    def oracle_per_layer(self) -> bool:
        return self.regime == "decode" if self.per_layer_oracle is None else self.per_layer_oracle


# ------------------------------------------------------------------------------ worker side
def _models(cfg: ExplainConfig):
    """The worker's null model, the design's model and the prompts (shared with the audit's
    worker: loaded once per process)."""
    from phasemech.experiments.audit import _WORKER

    a = cfg.audit()
    base = _WORKER.model(a.model, cfg.context + 64, job_device())
    model = _WORKER.setting(a.compression(cfg.design))
    return base, model, _WORKER.batch(a.retrieval_task(cfg.context), a.contents, a.seed)


def _run(base, model, batch, i: int, regime: str):
    from phasemech.interventions.prompts import prompt_run
    from phasemech.model.decode import needed_queries

    return prompt_run(base, batch, i, regime, keep_queries=needed_queries(model))


def _forces(cfg: ExplainConfig, model, units: tuple = (), label: str = "") -> list:
    """The oracle's interventions: the unforced baseline, then each form x rows in every
    selecting layer (or, with ``units``, in those heads), then per layer."""
    from phasemech.interventions.oracle import Force, selecting_layers

    layers = selecting_layers(model)
    n_heads = model.cfg.n_heads
    forms = [(f, r) for f in ("add", "replace") for r in ("answer", "after")]
    if units:
        return [Force(f, r, units, label) for f, r in forms]
    out = [Force("add", "answer", (), "none")]
    every = tuple((i, h) for i in layers for h in range(n_heads))
    out += [Force(f, r, every, "all") for f, r in forms]
    if cfg.oracle_per_layer:  # every row after the needle: what a layer's selection can reach
        for i in layers:
            one = tuple((i, h) for h in range(n_heads))
            out += [Force(f, "after", one, f"layer {i}") for f in ("add", "replace")]
    return out


def _attend(run, base, model) -> list[dict[str, Any]]:
    """Per (setting, layer, head): attention from the answer row onto the needle."""
    import torch

    from phasemech.experiments.audit_score import _attention_hooks
    from phasemech.interventions.prompts import bound

    rows = []
    for who, m in (("null", base), ("design", model)):
        store: dict = {}
        with torch.inference_mode(), bound(m, run):
            with m.hooks(fwd_hooks=_attention_hooks(m, run.row, run.needle, store)):
                m(run.tokens, stop_at_layer=m.cfg.n_layers)
        rows += [dict(setting=who, layer=layer, head=h, mass=float(x))
                 for layer, mass in sorted(store.items()) for h, x in enumerate(mass)]  # fmt: skip
    return rows


def _observe(cfg: ExplainConfig, i: int, base, model, batch) -> dict[str, Any]:
    from phasemech.interventions.oracle import force_needle, needle_selection
    from phasemech.interventions.prompt_patching import z_sums
    from phasemech.interventions.prompts import score

    run = _run(base, model, batch, i, cfg.regime)
    out: dict[str, Any] = {
        "prompt": run.meta,
        "null": score(base, run),
        "design": score(model, run),
    }
    if "selection" in cfg.analyses:
        out["selection"] = needle_selection(model, run).to_dict("records")
    if "oracle" in cfg.analyses:
        out["oracle"] = force_needle(model, run, _forces(cfg, model)).to_dict("records")
    if "ablation" in cfg.analyses:
        sums, rows = z_sums(model, run)
        out["z_sums"], out["z_rows"] = sums.tolist(), rows
    return out


@dataclass(frozen=True)
class ExplainJob(Job):
    """One step for some prompts (``observe``, ``attend``, ``heads``) or prompts and pairs
    (``intervene``). Payloads (the mean ablation's means, the oracle's heads) follow from the
    earlier steps of the same config, so they are not part of the key."""

    kind: ClassVar[str] = "explain"
    cfg: ExplainConfig
    step: str
    prompts: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...] = ()
    means: Any = payload(default=None)
    units: Any = payload(default=())

    @property
    def label(self) -> str:
        return f"{self.step} {self.cfg.setting} [{len(self.prompts) + len(self.pairs)}]"

    def run(self, workdir: Path) -> dict[str, Any]:
        base, model, batch = _models(self.cfg)
        t0, todo = time.perf_counter(), len(self.prompts) + len(self.pairs)
        rows: list[dict[str, Any]] = []
        for n, i in enumerate(self.prompts):
            rows.append(self._prompt(i, base, model, batch))
            report_progress(n + 1, todo)
        pairs = []
        for n, (c, x) in enumerate(self.pairs):
            pairs.append(self._pair(c, x, base, model, batch))
            report_progress(len(self.prompts) + n + 1, todo)
        return {"prompts": rows, "pairs": pairs, "seconds": time.perf_counter() - t0}

    def _prompt(self, i: int, base, model, batch) -> dict[str, Any]:
        from phasemech.interventions.oracle import force_needle
        from phasemech.interventions.prompt_patching import ablate_prompt

        if self.step == "observe":
            return _observe(self.cfg, i, base, model, batch)
        run = _run(base, model, batch, i, self.cfg.regime)
        if self.step == "attend":
            return {"prompt": run.meta, "attention": _attend(run, base, model)}
        if self.step == "heads":
            units = tuple(tuple(u) for u in self.units)
            forces = _forces(self.cfg, model, units, "top heads")
            return {
                "prompt": run.meta,
                "oracle": force_needle(model, run, forces).to_dict("records"),
            }
        import torch

        means = None if self.means is None else torch.tensor(self.means)
        return {"prompt": run.meta, "ablation": ablate_prompt(model, run, self.cfg.stride, means)}

    def _pair(self, c: int, x: int, base, model, batch) -> dict[str, Any]:
        from phasemech.interventions.prompt_patching import patch_pair

        clean, corrupt = (_run(base, model, batch, i, self.cfg.regime) for i in (c, x))
        out = patch_pair(model, clean, corrupt, self.cfg.stride)
        return {"clean_prompt": clean.meta, "corrupted_prompt": corrupt.meta, **out}


# ------------------------------------------------------------------------------ driver side
def _chunks(items: list) -> list[tuple]:
    """At least 8 chunks where there are items enough, of at most 4 (a killed run loses
    little; the workers share a step)."""
    size = max(1, min(4, -(-len(items) // 8)))
    return [tuple(items[i : i + size]) for i in range(0, len(items), size)]


def explain_jobs(
    cfg: ExplainConfig, step: str, prompts: list[int], pairs: list = (), **kw
) -> list[ExplainJob]:
    """``step``'s jobs: a few prompts (or pairs) each, so a worker loads the model once and
    several workers share the step."""
    cfg = dataclasses.replace(cfg, n_boot=0, n_perm=0)
    jobs = [ExplainJob(cfg, step, p, **kw) for p in _chunks(prompts)]
    pairs = [tuple(p) for p in pairs]
    return jobs + [ExplainJob(cfg, step, (), pairs=p, **kw) for p in _chunks(pairs)]


def check_explain(cfg: ExplainConfig):
    """Every bad input, in one line, before any forward (the audit's checks: model, context,
    tokenizer, layers); returns the model's source."""
    from phasemech.experiments.audit import check_audit

    return check_audit(cfg.audit())


def contrast_phases(cfg: ExplainConfig, accuracy: np.ndarray) -> tuple[int, int]:
    """``(strong, weak)``: as configured, else the design's best and worst phase; a setting
    whose phases all score the same has no weak phase to explain (``ValueError``)."""
    if cfg.contrast_phases is not None:
        return tuple(cfg.contrast_phases)
    if np.nanmax(accuracy) - np.nanmin(accuracy) <= 0:
        raise ValueError(
            f"{cfg.setting}: every phase scores {np.nanmax(accuracy):.2f}: no gap to explain by "
            "patching across phases; pass --contrast-phases CLEAN,CORRUPT to patch anyway, or "
            "leave patching out of --analyses (the observed prompts are cached)"
        )
    return int(np.nanargmax(accuracy)), int(np.nanargmin(accuracy))


__all__ = [
    "ANALYSES",
    "ExplainConfig",
    "ExplainJob",
    "check_explain",
    "contrast_phases",
    "explain_jobs",
]
