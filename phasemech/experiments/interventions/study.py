"""The interventions experiment as an
:class:`~phasemech.experiments.experiment.Experiment`: its stages (the sweep's train jobs, then
an :class:`InterventionJob` per model) and its finish, which clusters the heads and writes
``overview.parquet``, ``head_clusters.parquet``, ``summary.json`` and ``summary.md`` under
``RUNS/<folder>/interventions/``.

Axes: ``layer, unit, phase``; rows are models or heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.interventions import summary as s
from phasemech.experiments.interventions.jobs import InterventionJob, intervention_jobs
from phasemech.experiments.interventions.profiles import DEFAULT_MODELS, OUT_DIR, PROFILES
from phasemech.experiments.sweep.jobs import search_jobs, seed_jobs


def detailed(names: list[str]) -> set[str]:
    """The models with a detailed section: all of them when fewer than 10, else those of
    ``DEFAULT_MODELS`` (a summary of 60 sections is unreadable)."""
    return set(names) if len(names) < 10 else set(DEFAULT_MODELS) & set(names)


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """``overview.parquet``, ``head_clusters.parquet``, ``summary.json`` and ``summary.md``
    under ``out/interventions/``, from the jobs' results alone."""
    out = out / OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    results = [r for _, r in done.of(InterventionJob)]
    overview = pd.DataFrame([s.overview_row(r["info"], r["tables"]) for r in results])
    atomic_write(out / "overview.parquet", lambda tmp: overview.to_parquet(tmp))
    clusters = s.head_clusters(results)
    labels = s.cluster_labels(clusters)
    atomic_write(out / "head_clusters.parquet", lambda tmp: labels.to_parquet(tmp))
    detail = detailed([r["info"]["model"] for r in results])
    text = s.summary_markdown(out.parent.name, results, overview, clusters, detail)
    write_text_atomic(out / "summary.md", text)
    summary = {
        "profile": {
            "models": [r["info"]["model"] for r in results],
            "steps": p.steps,
            "d_model": p.d_model,
            **{k: v for k, v in p.extra},
            "n_boot": p.n_boot,
            "n_perm": p.n_perm,
        },
        "analysis_seconds": sum(s.analysis_seconds(r["info"]) for r in results),
        "models": [
            {**r["info"], **row}
            for r, row in zip(results, overview.to_dict("records"), strict=True)
        ],
        "clusters": s.cluster_summary(clusters),
    }
    summary = json_safe(summary)
    write_json_atomic(out / "summary.json", summary)
    return summary


INTERVENTIONS = Experiment(
    name="interventions",
    profiles=PROFILES,
    stages=(search_jobs, seed_jobs, intervention_jobs),
    finish=finish,
    about="ablation, patching, attribution, probes and head clusters on phase-sweep models",
    folders={
        "default": "phase_sweep_default",
        "converged": "phase_sweep_converged",
        "converged_d8": "phase_sweep_converged_d8",
        "converged_d8_wide": "phase_sweep_converged_d8_wide",
        "systems": "phase_sweep_systems",
        "systems_T128": "phase_sweep_systems_T128",
        "systems_rotary": "phase_sweep_systems_rotary",
        "systems_rotary_post": "phase_sweep_systems_rotary_post",
        "systems_nsa_mlp_gate": "phase_sweep_systems_nsa_mlp_gate",
    },
)


__all__ = ["INTERVENTIONS", "detailed", "finish"]
