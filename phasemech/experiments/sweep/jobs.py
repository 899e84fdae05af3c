"""The phase sweep's jobs: the train jobs of a profile (through the
learning-rate search of :mod:`phasemech.experiments.lr_search`) and one :class:`SweepStatsJob`
per (design, stride, heads, T): the full statistics template, seeds pooled (clusters: seed,
then content) at the final checkpoint, for all targets and for those beyond the raw window, and
per seed at every scored checkpoint.

Axes: ``target`` rows; ``phase`` on each reported grid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.core.grid import phase_of
from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.jobs import Job, TrainJob, payload, scored_targets
from phasemech.experiments.lr_search import analysed_runs, search_stages, with_lr
from phasemech.experiments.sweep.profiles import run_specs, train_config


def make_jobs(
    p: Profile, lr: float | None, seeds: tuple[int, ...], steps: int | None = None
) -> list[TrainJob]:
    """The train jobs of ``seeds`` at learning rate ``lr`` (None: the config's default), on a
    budget of ``steps`` (None: the profile's)."""
    jobs = []
    for s in run_specs(p):
        if s.seed in seeds:
            name = s.name if lr is None else f"{s.name}_lr{lr:g}"
            cfg = with_lr(train_config(s, p), lr)
            if steps is not None and steps != cfg.steps:
                cfg = dataclasses.replace(cfg, steps=steps)
            jobs.append(TrainJob(cfg, name=name, test_sequences=p.test_sequences, score_all=True))
    return jobs


search_jobs, seed_jobs = search_stages(make_jobs)


def train_jobs(p: Profile, done: Done | None = None) -> list[TrainJob]:
    """Every model of a profile without a learning-rate search (each seed at the default)."""
    return make_jobs(p, None, p.seeds, p.steps)


def grids(design: str, stride: int, strides: tuple[int, ...]) -> list[int]:
    """Phase grids a run is reported on: its own stride (a dense control is trained per stride,
    on that stride's data)."""
    return [stride]


# --------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class SweepStatsJob(Job):
    """The statistics of one (design, stride, heads, T) group of runs. Its config names the
    runs (their train jobs); their results travel as payload."""

    kind: ClassVar[str] = "sweep_stats"
    group: tuple[tuple[str, Any], ...]  # (design, stride, heads, seq_len) as pairs
    runs: tuple[TrainJob, ...]
    grids: tuple[int, ...]
    n_boot: int
    n_perm: int
    results: tuple[dict[str, Any], ...] = payload(default=())

    @property
    def label(self) -> str:
        g = dict(self.group)
        return f"stats {g['design']}_d{g['stride']}_h{g['heads']}_T{g['seq_len']}"

    def run(self, workdir: Path) -> dict[str, Any]:
        from threadpoolctl import threadpool_limits

        frames = []
        for job, result in zip(self.runs, self.results, strict=True):
            frames.append(scored_targets(job, result).assign(seed=job.train.seed))
        df = pd.concat(frames, ignore_index=True)
        # one BLAS thread: the workers already fill the cores
        with threadpool_limits(1):
            return {"rows": self._rows(df)}

    def _rows(self, df: pd.DataFrame) -> list[dict[str, Any]]:
        key = dict(self.group)
        final_of = df.groupby("seed")["step"].transform("max")
        fin = df[df["step"] == final_of]
        rows = []
        for stride in self.grids:
            for targets in ("all", "far"):
                pooled = {**key, "seed": "pooled", "step": "final", "targets": targets}
                row = report_row(pooled, fin, stride, self.n_boot, self.n_perm)
                rows += [] if row is None else [row]
            for (seed, step), g in df.groupby(["seed", "step"]):
                final = int(step) == int(final_of[g.index[0]])
                stage = "final" if final else str(int(step))
                k = {**key, "seed": str(int(seed)), "step": stage, "targets": "all"}
                rows.append(report_row(k, g, stride, min(self.n_boot, 200), min(self.n_perm, 200)))
        return rows


def report_row(key: dict, df: pd.DataFrame, stride: int, n_boot: int, n_perm: int) -> dict | None:
    """One row of ``results.parquet``: the statistics template of ``df`` on grid ``stride``
    (None for the ``far`` targets of a context too short to have any)."""
    from phasemech.measure.stats import phase_report

    if key["targets"] == "far":
        # sources at least W + d - 1 = 3d - 1 back are read only through blocks (W = 2d);
        # at d = 16 and T = 64 no target lies that far back
        df = df[df["distance"] >= 3 * stride - 1]
        if not len(df):
            return None
    sdf = df.assign(phase=phase_of(df["source_pos"].to_numpy(), stride))
    # clusters: contents; with several seeds, seeds then contents (stats resamples both)
    sdf["seq_id"] = sdf["group_id"] + 1_000_000 * sdf["seed"]
    # paired blocks: one target of one content (and seed) seen at every shift
    sdf["pair_id"] = sdf["seq_id"] * 1024 + sdf["target"]
    if key.get("seed") != "pooled":
        sdf = sdf.drop(columns="seed")
    rep = phase_report(sdf, stride, n_boot=n_boot, n_perm=n_perm, seed=0)
    pp, gap = rep.per_phase, rep.gap
    return {
        **key,
        "phase_stride": stride,
        "n": rep.n,
        "accuracy": rep.accuracy,
        "acc_by_phase": [round(float(x), 4) for x in pp["accuracy"]],
        "n_per_phase": int(pp["n"].min()),
        **{k: gap[k] for k in ("raw_gap", "null_median", "null_p95", "p_perm", "debiased_gap")},
        "debiased_lo": gap["debiased_lo"],
        "debiased_hi": gap["debiased_hi"],
        "weak_phase": gap["argmin_phase"],
        "p_logistic": rep.logistic["p"],
        "p_chi2": rep.chi2["p"],
        "p_paired": rep.paired.get("p", float("nan")),
        "p_harmonic_min_holm": float(rep.harmonics["p_holm"].min()),
        "guard_uniform_p": rep.guard["uniform_p"],
        "guard_independence_p": rep.guard["independence_p"],
    }


def stats_jobs(p: Profile, done: Done) -> list[SweepStatsJob]:
    """Stage 2: one statistics job per (design, stride, heads, T) group of trained runs."""
    groups: dict[tuple, list[tuple[TrainJob, dict]]] = {}
    # models below the profile's pooling threshold never enter a gap
    for job, result in analysed_runs(done, p.get("pool_min_accuracy", 0.0)):
        c = job.train
        key = (c.compression.design, c.compression.stride, c.model.n_heads, c.task.seq_len)
        groups.setdefault(key, []).append((job, result))
    jobs = []
    for (design, stride, heads, seq_len), members in groups.items():
        group = (("design", design), ("stride", stride), ("heads", heads), ("seq_len", seq_len))
        jobs.append(
            SweepStatsJob(
                group=group,
                runs=tuple(j for j, _ in members),
                grids=tuple(grids(design, stride, p.strides)),
                n_boot=p.n_boot,
                n_perm=p.n_perm,
                results=tuple(r for _, r in members),
            )
        )
    return jobs


__all__ = [
    "SweepStatsJob",
    "grids",
    "make_jobs",
    "report_row",
    "search_jobs",
    "seed_jobs",
    "stats_jobs",
    "train_jobs",
]
