"""The explanation's jobs: an :class:`ExplainJob` runs one step (``observe``, ``attend``,
``decompose``, ``intervene``, ``heads``, ``groups``) on a few prompts or pairs, on the models
and prompts of the real-model worker (:mod:`phasemech.experiments.probe.worker`, shared with
the audit's jobs in the same process). The worker-side steps are public for the benchmarks
that time them (``bench/explain_cost.py``).

Axes: ``prompt``, ``pair``, ``layer``, ``head``, ``phase``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from phasemech.experiments.explain.config import ExplainConfig
from phasemech.experiments.jobs import Job, job_device, payload, report_progress


# ------------------------------------------------------------------------------ worker side
def explain_models(cfg: ExplainConfig):
    """``(null model, the design's model, prompts)`` of the worker (shared with the audit's
    jobs: loaded once per process)."""
    from phasemech.experiments.probe.worker import WORKER

    base, batch = WORKER.probe(cfg.probe, cfg.context, job_device())
    return base, WORKER.setting(cfg.probe.compression(cfg.design)), batch


def run_prompt(base, model, batch, i: int, regime: str):
    """Prompt ``i`` bound for the design's interventions (the decode regime's prefill kept
    for the rows ``model`` needs)."""
    from phasemech.interventions.prompts import prompt_run
    from phasemech.model.decode import needed_queries

    return prompt_run(base, batch, i, regime, keep_queries=needed_queries(model))


def oracle_forces(cfg: ExplainConfig, model, units: tuple = (), label: str = "") -> list:
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


def answer_attention(run, base, model) -> list[dict[str, Any]]:
    """Per (setting, layer, head): attention from the answer row onto the needle."""
    import torch

    from phasemech.experiments.probe.worker import attention_hooks
    from phasemech.interventions.prompts import bound

    rows = []
    for who, m in (("null", base), ("design", model)):
        store: dict = {}
        with torch.inference_mode(), bound(m, run):
            with m.hooks(fwd_hooks=attention_hooks(m, run.row, run.needle, store)):
                m(run.tokens, stop_at_layer=m.cfg.n_layers)
        rows += [dict(setting=who, layer=layer, head=h, mass=float(x))
                 for layer, mass in sorted(store.items()) for h, x in enumerate(mass)]  # fmt: skip
    return rows


def decompose_prompt(cfg: ExplainConfig, i: int, base, model, batch) -> dict[str, Any]:
    """The ``decompose`` step on prompt ``i``: the selection at the answer row split into its
    tokens' terms (:func:`~phasemech.interventions.decompose.decompose`)."""
    from phasemech.interventions.decompose import decompose

    run = run_prompt(base, model, batch, i, cfg.probe.regime)
    return {"prompt": run.meta, "decomposition": decompose(model, run).to_dict("records")}


def observe_prompt(cfg: ExplainConfig, i: int, base, model, batch) -> dict[str, Any]:
    from phasemech.interventions.oracle import force_needle, needle_selection
    from phasemech.interventions.prompt_patching import z_sums
    from phasemech.interventions.prompts import score

    run = run_prompt(base, model, batch, i, cfg.probe.regime)
    out: dict[str, Any] = {
        "prompt": run.meta,
        "null": score(base, run),
        "design": score(model, run),
    }
    if "selection" in cfg.analyses:
        out["selection"] = needle_selection(model, run).to_dict("records")
    if "oracle" in cfg.analyses:
        out["oracle"] = force_needle(model, run, oracle_forces(cfg, model)).to_dict("records")
    if "ablation" in cfg.analyses:
        sums, rows = z_sums(model, run)
        out["z_sums"], out["z_rows"] = sums.tolist(), rows
    return out


def group_prompt(run, model, groups, means, source) -> dict[str, Any]:
    """The ``groups`` step on one prompt: every group of heads ablated together
    (:func:`~phasemech.interventions.group_ablation.group_ablate`; ``groups``: ``(label,
    heads)`` pairs, ``source``: the resample's other prompt or None)."""
    import torch

    from phasemech.interventions.group_ablation import group_ablate

    means = None if means is None else torch.tensor(means)
    got = group_ablate(model, run, [tuple(h) for _, h in groups], means, source)
    units = [[label, [list(map(int, u)) for u in heads]] for label, heads in groups]
    return {"prompt": run.meta, "units": units,
            "source": None if source is None else source.meta["prompt_id"],
            "groups": got}  # fmt: skip


@dataclass(frozen=True)
class ExplainJob(Job):
    """One step for some prompts (``observe``, ``attend``, ``heads``, ``groups``) or prompts
    and pairs (``intervene``). Payloads (the mean ablation's means, the oracle's heads, the
    groups of heads and each prompt's resample source) follow from the earlier steps of the
    same config, so they are not part of the key."""

    kind: ClassVar[str] = "explain"
    cfg: ExplainConfig
    step: str
    prompts: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...] = ()
    means: Any = payload(default=None)
    units: Any = payload(default=())
    groups: Any = payload(default=())
    sources: Any = payload(default=None)

    @property
    def label(self) -> str:
        return f"{self.step} {self.cfg.setting} [{len(self.prompts) + len(self.pairs)}]"

    def run(self, workdir: Path) -> dict[str, Any]:
        base, model, batch = explain_models(self.cfg)
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
            return observe_prompt(self.cfg, i, base, model, batch)
        if self.step == "decompose":
            return decompose_prompt(self.cfg, i, base, model, batch)
        run = run_prompt(base, model, batch, i, self.cfg.probe.regime)
        if self.step == "attend":
            return {"prompt": run.meta, "attention": answer_attention(run, base, model)}
        if self.step == "heads":
            units = tuple(tuple(u) for u in self.units)
            forces = oracle_forces(self.cfg, model, units, "top heads")
            return {
                "prompt": run.meta,
                "oracle": force_needle(model, run, forces).to_dict("records"),
            }
        if self.step == "groups":
            j = None if not self.sources else dict(self.sources).get(i)
            src = None if j is None else run_prompt(base, model, batch, j, self.cfg.probe.regime)
            return group_prompt(run, model, self.groups, self.means, src)
        import torch

        means = None if self.means is None else torch.tensor(self.means)
        return {
            "prompt": run.meta,
            "ablation": ablate_prompt(model, run, self.cfg.probe.stride, means),
        }

    def _pair(self, c: int, x: int, base, model, batch) -> dict[str, Any]:
        from phasemech.interventions.prompt_patching import patch_pair

        clean, corrupt = (run_prompt(base, model, batch, i, self.cfg.probe.regime) for i in (c, x))
        out = patch_pair(model, clean, corrupt, self.cfg.probe.stride)
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
    cfg = dataclasses.replace(cfg, n_boot=0, n_perm=0, auto_perm=True)  # the tables test
    jobs = [ExplainJob(cfg, step, p, **kw) for p in _chunks(prompts)]
    pairs = [tuple(p) for p in pairs]
    return jobs + [ExplainJob(cfg, step, (), pairs=p, **kw) for p in _chunks(pairs)]


def check_explain(cfg: ExplainConfig):
    """Every bad input, in one line, before any forward (the probe's checks: model, context,
    tokenizer, layers); returns the model's source."""
    from phasemech.experiments.probe.worker import check_probe

    return check_probe(cfg.probe)


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
    "ExplainJob",
    "answer_attention",
    "check_explain",
    "contrast_phases",
    "decompose_prompt",
    "explain_jobs",
    "explain_models",
    "group_prompt",
    "observe_prompt",
    "oracle_forces",
    "run_prompt",
]
