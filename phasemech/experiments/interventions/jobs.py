"""Which heads serve which phases? Ablation, patching, attribution and probes on trained models,
as an experiment.

For trained models of the phase sweep (default: a dense control and the compressed models that
learned MQAR or show a phase gap), on each model's phase-balanced test set:

1. **ablation** (``phasemech.interventions.ablation``): zero / mean / resample of every head,
   and of the compressed layer's parts (block entries: mask / mean / resample; raw window:
   mask; gated phase bias: zero); accuracy effect per target phase with cluster-bootstrap CIs;
   the specialization index and the within-content permutation test per unit;
2. **do ablations open the weak spots?**: for every unit whose effect depends on phase
   (Holm-corrected p < 0.05), the phase it serves (largest drop), the weakest phase of the
   ablated model, and whether the intact model is already weak there;
3. **activation patching** (``phasemech.interventions.patching``): the grid contrast (same
   tokens, grid shifted by d/2: the cleanest phase contrast) and the corrupted-answer contrast
   for head outputs at every position and by position; compressed entries and patterns under
   the answer contrast (the only one where entry i covers the same tokens in both runs);
4. **attribution patching** vs exact patching on the answer contrast (overall, by layer, and
   split by saturated last-layer attention);
5. **linear probes** for the token's phase on a randomly shifted grid (phase decoupled from
   absolute position), with ``pos mod d`` as the control;
6. **clusters** of heads by their ablation profile across phases, pooled over models.

Stages: (1) the phase sweep's :class:`TrainJob` of each model (the same keys as the sweep's:
the ``default`` profile runs in the sweep's folder and reuses its trained models); (2) an
:class:`InterventionJob` per model: 1-5 above, its detailed tables written into its own
``jobs/work/<key>/<model>/``, and the small tables the summary reads returned (they travel back
through Ray). The finish clusters the heads (6) and writes ``overview.parquet`` (one row per
model), ``head_clusters.parquet``, ``summary.json`` and ``summary.md`` under
``RUNS/<folder>/interventions/`` (the ``default`` folder is the phase sweep's: its own tables
stay apart).

Axes: ``layer, unit, phase``; ``target`` rows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import Job, TrainJob, job_device, report_progress, trained_run
from phasemech.experiments.lr_search import analysed_runs
from phasemech.experiments.sweep import PROFILES as SWEEP_PROFILES
from phasemech.experiments.sweep import search_jobs, seed_jobs
from phasemech.interventions.ablation_plan import components_for

OUT_DIR = "interventions"

#: the models of the ``default`` profile, with a detailed section each in the summary
DEFAULT_MODELS = (
    "none_d8_h4_T64_s0",  # dense control
    "route_d8_h4_T64_s0",
    "route_d4_h4_T64_s0",
    "gated_d4_h2_T64_s1",  # converged gated
    "gated_d4_h2_T64_s0",
    "mean_d8_h2_T64_s0",  # partly learned, large phase gap
    "mean_d4_h2_T64_s0",
    "mlp_d4_h2_T64_s0",
)


def _on_converged_sweep(name: str, analyse_seeds) -> Profile:
    """The interventions profile of a converged sweep profile: its models, in its folder."""
    return replace(
        SWEEP_PROFILES[name], n_boot=1000, n_perm=1000,
        extra=SWEEP_PROFILES[name].extra + (("sequences", 1024), ("pairs", 256),
                                            ("analyse_seeds", analyse_seeds)),
    )  # fmt: skip


# Only ``models``, ``n_boot``/``n_perm`` and ``extra`` differ from the sweep's profiles: none of
# them enters a train job's config, so the train jobs keep the sweep's keys (and its cache).
# ``sequences``: balanced test-set size; ``pairs``: patching pairs per contrast.
PROFILES = {
    # both tiny sweep models (dense and gated), a few seconds of analysis each
    "tiny": replace(SWEEP_PROFILES["tiny"], extra=(("sequences", 32), ("pairs", 8))),
    "default": replace(
        SWEEP_PROFILES["default"], models=DEFAULT_MODELS, n_boot=1000, n_perm=1000,
        extra=(("sequences", 1024), ("pairs", 256)),
    ),
    # the converged phase sweep's models (its search and seeds stages: the same cache), only
    # those that reached its pooling threshold, seed 0 of each setting
    "converged": _on_converged_sweep("converged", (0,)),
    # the same at d = 8, where some settings converged only in a later seed: the first seed of
    # each setting that reached the threshold; and at d = 8 with d_model 128
    "converged_d8": _on_converged_sweep("converged_d8", "first"),
    "converged_d8_wide": _on_converged_sweep("converged_d8_wide", "first"),
    # the real systems (phase_sweep --profile systems): which head, branch (nsa), slot bias
    # (csa, hca) or indexer choice (dsa: its kept pools) serves which phase
    "systems": _on_converged_sweep("systems", "first"),
    "systems_T128": _on_converged_sweep("systems_T128", "first"),
    # csa / hca pooled before and after RoPE in rotary models: which head serves which phase
    "systems_rotary": _on_converged_sweep("systems_rotary", "first"),
    "systems_rotary_post": _on_converged_sweep("systems_rotary_post", "first"),
    "systems_nsa_mlp_gate": _on_converged_sweep("systems_nsa_mlp_gate", "first"),
}  # fmt: skip


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str, total: int = 4) -> Iterator[None]:
    """Time one analysis into ``timings[name]``, then report it done (``total`` in all)."""
    t0 = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t0
    report_progress(len(timings), total)


def patch_sites_for(design: str) -> tuple[str, ...]:
    """The compressed-layer sites a design runs: pooled entries (``kv_block``) where it keeps
    them (every design that is not a selecting one, and ``route``'s routing means), and its
    attention pattern where it has one ``hook_pattern`` (not ``nsa``'s three)."""
    from phasemech.core.config import SELECTING_DESIGNS

    entries = design not in SELECTING_DESIGNS or design == "route"
    return ("kv_block",) * entries + ("pattern",) * (design != "nsa")


@dataclass(frozen=True)
class InterventionJob(Job):
    """Every analysis of one trained model (its final checkpoint). Writes the detailed tables
    under ``workdir/<model>/`` (``ablate/``, ``patch_*/``, ``attribution*.parquet``,
    ``probe.parquet``, ``info.json``) and returns ``info`` (the model, its grid and the time of
    each analysis) and ``tables`` (what the summary reads, see
    :func:`phasemech.experiments.interventions_summary.summary_tables`)."""

    kind: ClassVar[str] = "interventions"
    train: TrainJob
    sequences: int = 1024  # balanced test-set size
    pairs: int = 256  # patching pairs per contrast
    n_boot: int = 1000
    n_perm: int = 1000
    seed: int = 0
    test_seed: int = 777
    probe_sequences: int = 256

    @property
    def label(self) -> str:
        return f"interventions {self.train.name}"

    def run(self, workdir: Path) -> dict[str, Any]:
        from threadpoolctl import threadpool_limits

        from phasemech.core.grid import reference_grid
        from phasemech.data.tasks import balanced_test_set
        from phasemech.experiments.interventions_summary import summary_tables
        from phasemech.training.checkpoints import load_trained

        out = workdir / self.train.name
        out.mkdir(parents=True, exist_ok=True)
        timings: dict[str, float] = {}
        # one BLAS thread: the workers already fill the cores
        with threadpool_limits(1):
            model, cfg, model_dir = load_trained(trained_run(workdir, self.train), job_device())
            grid = reference_grid(cfg.compression)
            ds = balanced_test_set(cfg.task, self.sequences, self.test_seed)
            with _timed(timings, "ablation_s"):
                self._ablation(model, ds, out)
            with _timed(timings, "patching_s"):
                answer = self._patching(model, ds, grid, out)
            with _timed(timings, "attribution_s"):
                self._attribution(model, answer, out)
            with _timed(timings, "probe_s"):
                self._probe(model, ds, grid, out)
        info = {
            "model": self.train.name,
            "checkpoint": str(model_dir),
            "design": cfg.compression.design,
            "stride": grid[0],
            "heads": cfg.model.n_heads,
            "compressed_layers": list(model.compressed_layers()),
            **timings,
        }
        write_json_atomic(out / "info.json", json_safe(info))
        return {"info": info, "tables": summary_tables(out)}

    def _ablation(self, model, ds, out: Path) -> None:
        from phasemech.interventions.ablation import ablate

        design = model.cfg.compression.design
        result = ablate(
            model, ds, components=components_for(design), n_boot=self.n_boot, seed=self.seed
        )
        spec = result.specialization(metric="accuracy", n_perm=self.n_perm, seed=self.seed)
        result.save(out / "ablate", specialization=spec)

    def _patching(self, model, ds, grid: tuple[int, int], out: Path):
        """Head patching under both contrasts (the grid one only for compressed models), all
        positions and by position; returns the answer contrast and its by-position result."""
        from phasemech.interventions.contrasts import make_contrast
        from phasemech.interventions.patching import patch_sites
        from phasemech.interventions.patching_fast import patch_heads

        design = model.cfg.compression.design
        shuffled = ds.shuffle(seed=self.seed)  # balanced sets come in blocks of one content
        kinds = (["grid"] if design != "none" else []) + ["answer"]
        answer = None
        for kind in kinds:
            contrast = make_contrast(
                shuffled, kind, stride=grid[0], grid_offset=grid[1], n_pairs=self.pairs,
                seed=self.seed,
            )  # fmt: skip
            for by_pos in (False, True):
                res = patch_heads(model, contrast, by_pos=by_pos)
                folder = out / f"patch_{kind}_z{'_pos' if by_pos else ''}"
                res.save(folder, n_boot=self.n_boot, seed=self.seed)
                if kind == "answer" and by_pos:
                    answer = (contrast, res)
            if kind == "answer" and design != "none":  # entries align only on one grid
                for site in patch_sites_for(design):
                    res = patch_sites(model, contrast, site=site)
                    res.save(out / f"patch_{kind}_{site}", n_boot=self.n_boot, seed=self.seed)
        return answer

    def _attribution(self, model, answer, out: Path) -> None:
        """Attribution patching against the exact by-position patching of the answer
        contrast."""
        from phasemech.interventions.attribution import (
            attribution_by_position,
            attribution_patch,
            compare_attribution,
        )

        contrast, exact = answer
        atp = attribution_patch(model, contrast)
        comparison = compare_attribution(atp, exact)
        atomic_write(out / "attribution.parquet", lambda tmp: comparison.to_parquet(tmp))
        where = attribution_by_position(atp, exact, contrast)
        atomic_write(out / "attribution_where.parquet", lambda tmp: where.to_parquet(tmp))

    def _probe(self, model, ds, grid: tuple[int, int], out: Path) -> None:
        from phasemech.data.tasks import to_tensors
        from phasemech.interventions.probes import phase_probe

        tokens = to_tensors(ds.select(range(min(self.probe_sequences, len(ds)))))[0]
        probe = phase_probe(model, tokens, stride=grid[0], grid_offset=grid[1], seed=self.seed)
        probe.save(out / "probe.parquet")


def intervention_jobs(p: Profile, done: Done) -> list[Job]:
    """Stage 2: every analysis of each trained model (at its setting's chosen learning rate;
    with ``pool_min_accuracy`` only models that reached it, with ``analyse_seeds`` only those
    seeds)."""
    runs = analysed_runs(done, p.get("pool_min_accuracy", 0.0), p.get("analyse_seeds"))
    return [
        InterventionJob(
            job, sequences=p.get("sequences"), pairs=p.get("pairs"), n_boot=p.n_boot,
            n_perm=p.n_perm,
        )
        for job, _ in runs
    ]  # fmt: skip


def detailed(names: list[str]) -> set[str]:
    """The models with a detailed section: all of them when fewer than 10, else those of
    ``DEFAULT_MODELS`` (a summary of 60 sections is unreadable)."""
    return set(names) if len(names) < 10 else set(DEFAULT_MODELS) & set(names)


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """``overview.parquet``, ``head_clusters.parquet``, ``summary.json`` and ``summary.md``
    under ``out/interventions/``, from the jobs' results alone."""
    from phasemech.experiments import interventions_summary as s

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

__all__ = [
    "DEFAULT_MODELS",
    "INTERVENTIONS",
    "PROFILES",
    "InterventionJob",
    "components_for",
    "detailed",
    "intervention_jobs",
]
