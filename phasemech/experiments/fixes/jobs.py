"""The fixes experiment's jobs: a :class:`TrainJob` per (fix, seed),
then a :class:`FixStatsJob` per fix: its statistics template (seeds pooled) and its comparison
with its baseline (:func:`~phasemech.measure.stats.compare_gaps`).

Axes: ``target`` rows; ``phase`` on the fixes' shared grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.fixes.profiles import (
    GOAL_REDUCTION,
    NONINFERIORITY,
    VARIANTS,
    test_task,
    train_config,
)
from phasemech.experiments.jobs import Job, TrainJob, payload, scored_targets
from phasemech.experiments.sweep.jobs import report_row
from phasemech.measure.learning import PLATEAU_EXIT, all_off_plateau


def train_jobs(p: Profile, done: Done | None = None) -> list[TrainJob]:
    """Stage 1: every (fix, seed); seeds outermost, so every fix has a first seed early."""
    fixes = p.get("fixes")
    for fix in fixes:
        base = VARIANTS[fix].baseline
        if base is not None and base not in fixes:
            raise ValueError(f"fix {fix!r} needs its baseline {base!r} in the profile's fixes")
    return [
        TrainJob(
            train_config(fix, seed, p), name=f"{fix}_s{seed}",
            test_sequences=p.test_sequences, test_task=test_task(p),
        )
        for seed in p.seeds for fix in fixes
    ]  # fmt: skip


def fix_of(job: TrainJob) -> str:
    """The fix a training job trains: its name without the ``_s{seed}`` suffix."""
    return job.name.rsplit("_s", 1)[0]


@dataclass(frozen=True)
class FixStatsJob(Job):
    """Statistics of one fix, and its comparison with its baseline."""

    kind: ClassVar[str] = "fix_stats"
    fix: str
    runs: tuple[TrainJob, ...]
    baseline: tuple[TrainJob, ...]
    stride: int
    n_boot: int
    n_perm: int
    #: every seed of the fix must reach this test accuracy for the fix to count
    min_accuracy: float = PLATEAU_EXIT
    results: tuple[dict[str, Any], ...] = payload(default=())
    baseline_results: tuple[dict[str, Any], ...] = payload(default=())

    @property
    def label(self) -> str:
        return f"stats {self.fix}"

    def run(self, workdir: Path) -> dict[str, Any]:
        from threadpoolctl import threadpool_limits

        fix = _targets(self.runs, self.results)
        with threadpool_limits(1):  # the workers already fill the cores
            rows = self._rows(fix)
            if not self.baseline:
                return {"rows": rows, "comparison": []}
            base = _targets(self.baseline, self.baseline_results)
            return {"rows": rows, "comparison": self._compare(base, fix, pd.DataFrame(rows))}

    def _rows(self, df: pd.DataFrame) -> list[dict[str, Any]]:
        rows = []
        for scope in ("all", "far"):
            key = {"design": self.fix, "seed": "pooled", "targets": scope}
            row = report_row(key, df, self.stride, self.n_boot, self.n_perm)
            rows += [] if row is None else [row]  # no far targets at a large stride
        for seed, g in df.groupby("seed"):
            key = {"design": self.fix, "seed": str(int(seed)), "targets": "all"}
            rows.append(
                report_row(key, g, self.stride, min(self.n_boot, 200), min(self.n_perm, 200))
            )
        for r in rows:
            r["fix"] = r.pop("design")
        return rows

    def _compare(self, base: pd.DataFrame, fix: pd.DataFrame, rows: pd.DataFrame) -> list[dict]:
        from phasemech.measure.stats import compare_gaps

        d = self.stride
        far_from = 3 * d - 1  # beyond the raw window W = 2d: read through blocks only
        out = []
        for scope in ("all", "far"):
            a, b = (x.assign(phase=x["source_pos"] % d, seq_id=x["group_id"]) for x in (base, fix))
            if scope == "far":
                a, b = a[a["distance"] >= far_from], b[b["distance"] >= far_from]
                if not (len(a) and len(b)):  # a context too short for far targets
                    continue
            c = compare_gaps(a, b, d, n_boot=self.n_boot, seed=0)
            # the cut reaches the goal, is real (CI above 0), costs no more than NONINFERIORITY
            # of mean accuracy, and every seed of both the fix and its baseline learned (a
            # model on the plateau is flat for no good reason; a gap cut against a baseline
            # that never learned compares nothing)
            base_ok = bool((base.groupby("seed")["correct"].mean() >= self.min_accuracy).all())
            meets = (
                c["reduction"] >= GOAL_REDUCTION
                and c["reduction_lo"] > 0
                and c["accuracy_diff_lo"] > -NONINFERIORITY
                and all_off_plateau(rows, self.fix, self.min_accuracy)
                and base_ok
            )
            base_fix = fix_of(self.baseline[0])
            out.append({"fix": self.fix, "baseline": base_fix, "targets": scope, **c,
                        "baseline_learned": base_ok, "meets_goal": bool(meets)})  # fmt: skip
        return out


def _targets(runs: tuple[TrainJob, ...], results: tuple[dict, ...]) -> pd.DataFrame:
    frames = [
        scored_targets(job, r).assign(seed=job.train.seed)
        for job, r in zip(runs, results, strict=True)
    ]
    return pd.concat(frames, ignore_index=True)


def stats_jobs(p: Profile, done: Done) -> list[FixStatsJob]:
    """Stage 2: one statistics job per fix (with its baseline's runs for the comparison)."""
    by_fix: dict[str, list[tuple[TrainJob, dict]]] = {}
    for job, result in done.of(TrainJob):
        by_fix.setdefault(fix_of(job), []).append((job, result))
    jobs = []
    for fix in p.get("fixes"):
        base = VARIANTS[fix].baseline
        members, baseline = by_fix[fix], by_fix.get(base, []) if base else []
        jobs.append(
            FixStatsJob(
                fix, tuple(j for j, _ in members), tuple(j for j, _ in baseline), p.strides[0],
                p.n_boot, p.n_perm, p.get("min_accuracy", PLATEAU_EXIT),
                tuple(r for _, r in members), tuple(r for _, r in baseline),
            )
        )  # fmt: skip
    return jobs


__all__ = ["FixStatsJob", "fix_of", "stats_jobs", "train_jobs"]
