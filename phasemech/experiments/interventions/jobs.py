"""The interventions experiment's jobs: an
:class:`InterventionJob` per trained model (ablation, patching, attribution patching and
probes), its detailed tables written into its own folder and the small tables the summary
reads returned.

Axes: ``layer, unit, phase``; ``target`` rows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from phasemech.core.io import atomic_write, json_safe, write_json_atomic
from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.jobs import Job, TrainJob, job_device, report_progress, trained_run
from phasemech.experiments.lr_search import analysed_runs
from phasemech.interventions.ablation_plan import components_for


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
    :func:`phasemech.experiments.interventions.summary.summary_tables`)."""

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
        from phasemech.experiments.interventions.summary import summary_tables
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


__all__ = ["InterventionJob", "intervention_jobs", "patch_sites_for"]
