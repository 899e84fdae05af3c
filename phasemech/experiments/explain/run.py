"""The explanation as an experiment on the launcher (``phasemech explain``, ``phasemech run
explain``) and :func:`run_explain`, which runs one :class:`~phasemech.experiments.explain.
config.ExplainConfig` into a folder of its own.

Three stages, each reading what the earlier ones returned (the launcher caches every job
under ``OUT/jobs``: a rerun computes nothing, a killed one resumes, ``address`` joins a Ray
cluster):

1. ``observe`` every prompt;
2. ``attend`` and ``decompose`` every prompt and ``intervene``: ablate every head on every
   prompt (the mean ablation's means from step 1) and patch each content's (strong, weak) pair
   (:func:`contrast_pairs`);
3. ``heads``: the oracle in the heads with the largest exact patching effect; beside it
   ``groups``: groups of heads ablated together (the heads that read the needle most under
   the null, read from ``attend``, and each layer's heads), zero, mean and resample
   (:mod:`phasemech.experiments.explain.groups`).

The finish writes the tables (:mod:`phasemech.experiments.explain.tables`), ``summary.md``,
``summary.json`` and ``explain.html``.

Axes: ``prompt``, ``pair``, ``layer``, ``head``, ``phase``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.experiments.experiment import Done, Experiment, run_study
from phasemech.experiments.explain.config import ExplainConfig
from phasemech.experiments.explain.jobs import (
    ExplainJob,
    check_explain,
    contrast_phases,
    explain_jobs,
)
from phasemech.experiments.explain.tables import (
    attention_tables,
    decomposition_tables,
    explain_tables,
    long_frame,
    patching_table,
    prompts_frame,
    write_tables,
)
from phasemech.experiments.probe.config import ProbeConfig


def step_results(done: Done, step: str, part: str = "prompts") -> list[dict]:
    """The per-prompt (``part="pairs"``: per-pair) results of every finished job of ``step``,
    in submission order."""
    return [p for j, r in done.of(ExplainJob) if j.step == step for p in r[part]]


def contrast_pairs(
    cfg: ExplainConfig, prompts: pd.DataFrame
) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """``((strong, weak), pairs)``: each content's prompt ids at its strong and weak phase,
    for the contents whose strong-phase prompt is answered right (first token)."""
    d = cfg.probe.stride
    acc = prompts.groupby("phase").design_correct.mean().reindex(range(d)).to_numpy()
    strong, weak = contrast_phases(cfg, acc)
    by = prompts.set_index(["group_id", "phase"])
    pairs = []
    for g in sorted(prompts.group_id.unique()):
        if (g, strong) in by.index and (g, weak) in by.index:
            if bool(by.loc[(g, strong), "design_first_correct"]):
                pairs.append((int(by.loc[(g, strong), "prompt_id"]),
                              int(by.loc[(g, weak), "prompt_id"])))  # fmt: skip
    if not pairs:
        raise ValueError(
            f"{cfg.setting}: no content is answered right at phase {strong} (the clean side): "
            "nothing to patch from; pass --contrast-phases with a phase the design answers, "
            "or leave patching out of --analyses (the observed prompts are cached)"
        )
    return (strong, weak), pairs


def _ids(cfg: ExplainConfig) -> list[int]:
    return list(range(cfg.probe.contents * cfg.probe.stride))


def _observe(cfg: ExplainConfig, done: Done) -> list[ExplainJob]:
    return explain_jobs(cfg, "observe", _ids(cfg))


def head_means(observed: list[dict]) -> list:
    """Each head's mean output ``[layer][head][d_head]`` over every observed prompt's rows (the
    mean ablation's means)."""
    sums = sum(np.array(p["z_sums"]) for p in observed)
    return (sums / sum(p["z_rows"] for p in observed)).tolist()


def _intervene(cfg: ExplainConfig, done: Done) -> list[ExplainJob]:
    """``attend`` and ``intervene`` in one launch (the workers stay busy)."""
    observed = step_results(done, "observe")
    pairs = contrast_pairs(cfg, prompts_frame(observed))[1] if "patching" in cfg.analyses else []
    means, abl_ids = None, []
    if "ablation" in cfg.analyses:
        means = head_means(observed)
        abl_ids = _ids(cfg)
    jobs = explain_jobs(cfg, "attend", _ids(cfg)) + _decompose_jobs(cfg)
    if abl_ids or pairs:
        jobs += explain_jobs(cfg, "intervene", abl_ids, pairs, means=means)
    return jobs


def _decompose_jobs(cfg: ExplainConfig) -> list[ExplainJob]:
    """The ``decompose`` step on every prompt (stage 2, beside ``attend``), when asked for."""
    return explain_jobs(cfg, "decompose", _ids(cfg)) if "decompose" in cfg.analyses else []


def _heads(cfg: ExplainConfig, done: Done) -> list[ExplainJob]:
    """The oracle in the top heads by exact patching (none without the oracle or pairs)."""
    from phasemech.experiments.explain.summary import top_heads

    pairs = step_results(done, "intervene", "pairs")
    if "oracle" not in cfg.analyses or not pairs:
        return []
    # the point estimates rank the heads (no bootstrap); a dense layer's head has no pick
    top = top_heads(patching_table(pairs, 0, cfg.probe.seed), cfg.top_heads, cfg.probe.layers)
    units = [(int(r.layer), int(r.head)) for r in top.itertuples()]
    return explain_jobs(cfg, "heads", _ids(cfg), units=units) if units else []


def _groups(cfg: ExplainConfig, done: Done) -> list[ExplainJob]:
    """The ``groups`` step's jobs: its units from the null's attention onto the needle, the
    means (with ``ablation``, which computes them in ``observe``) and the resample sources."""
    from phasemech.experiments.explain.groups import head_groups, needle_readers, resample_sources

    if "groups" not in cfg.analyses:
        return []
    observed, src = step_results(done, "observe"), done.checked
    attention = long_frame(step_results(done, "attend"), "attention")
    units = head_groups(needle_readers(attention), cfg.group_sizes, src.n_layers, src.n_heads)
    means = head_means(observed) if "ablation" in cfg.analyses else None
    sources = resample_sources(prompts_frame(observed), cfg.probe.seed)
    sources = None if sources is None else tuple(sorted(sources.items()))
    return explain_jobs(cfg, "groups", _ids(cfg), groups=tuple(units), means=means,
                        sources=sources)  # fmt: skip


def _last(cfg: ExplainConfig, done: Done) -> list[ExplainJob]:
    """The last stage: the top heads' oracle and the group ablations, in one launch."""
    return _heads(cfg, done) + _groups(cfg, done)


def _group_step_tables(cfg: ExplainConfig, done: Done, tables: dict) -> dict:
    """The ``groups`` step's tables, the needle readers and the selection at them."""
    from phasemech.experiments.explain.groups import group_tables, needle_readers, reader_recall

    out = {"needle_readers": needle_readers(tables["attention"])}
    if tables.get("selection") is not None:
        out["reader_recall"] = reader_recall(tables["selection"], tables["attention"],
                                             cfg.group_sizes)  # fmt: skip
    if "groups" in cfg.analyses:
        out |= group_tables(step_results(done, "groups"), cfg.probe.stride, cfg.n_boot,
                            cfg.probe.seed, cfg.perm_draws)  # fmt: skip
    return out


def _finish(cfg: ExplainConfig, done: Done, out: Path) -> dict[str, Any]:
    from phasemech.experiments.explain.summary import write_report
    from phasemech.viz.explain import write_explain_html

    source, observed = done.checked, step_results(done, "observe")
    prompts = prompts_frame(observed)
    inter = [r for j, r in done.of(ExplainJob) if j.step == "intervene"]
    pairs = step_results(done, "intervene", "pairs")
    patch = patching_table(pairs, cfg.n_boot, cfg.probe.seed) if pairs else None
    contrast = contrast_pairs(cfg, prompts)[0] if pairs else (None, None)
    tables = explain_tables(cfg, prompts, observed, inter, step_results(done, "heads"), patch,
                            pairs, source)  # fmt: skip
    tables |= attention_tables(step_results(done, "attend"))
    tables |= _group_step_tables(cfg, done, tables)
    tables |= decomposition_tables(step_results(done, "decompose"), tables["attention"])
    write_tables(out, tables)
    meta = dict(
        contrast_phases=contrast,
        n_pairs=len(pairs),
        wall_s=time.perf_counter() - done.started,
        worker_s=sum(r["seconds"] for r in done.results.values()),
        model=source.spec,
        n_layers=source.n_layers,
        n_heads=source.n_heads,
    )
    summary = write_report(cfg, tables, meta, out)
    write_explain_html(out / "explain.html", tables, summary)
    return summary


EXPLAIN = Experiment(
    name="explain",
    profiles={
        # seconds on SmolLM2: two compressed layers, no per-layer oracle, no 270-head ablation
        # (so the group ablation runs zero and resample only: its means come with ablation)
        "tiny": ExplainConfig(
            ProbeConfig(top_k=1, layers=(4, 5), contexts=(256,), contents=2),
            analyses=("selection", "oracle", "patching", "groups", "decompose"),
            per_layer_oracle=False,
            top_heads=2,
            n_boot=50,
        ),  # fmt: skip
        "default": ExplainConfig(),
    },
    stages=(_observe, _intervene, _last),
    finish=_finish,
    check=check_explain,
    about="which selections, layers and heads make a real model's weak phase weak",
)


def run_explain(cfg: ExplainConfig, out: str | Path, **kw: Any) -> dict[str, Any]:
    """Run (or finish from the cache) the explanation ``cfg`` into ``out``: tables, ``summary.md``,
    ``summary.json`` and ``explain.html``. Returns the summary; ``kw``: ``address``,
    ``num_cpus``, ``device``, ``progress`` (:func:`~phasemech.experiments.experiment.run_study`)."""
    return run_study(EXPLAIN, cfg, out, **kw)


__all__ = ["EXPLAIN", "contrast_pairs", "head_means", "run_explain", "step_results"]
