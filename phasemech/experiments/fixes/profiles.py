"""The fixes the paper left untested, as an experiment: do staggered or random grids, or
phase-jittered data, close the phase gap?

Matched models (same size, data stream, steps and seeds; only the fix differs), each trained on
phase-uniform MQAR and scored on one shared phase-balanced test set of the plain task:

- ``aligned``: every layer and head on the grid ``o = 0`` (the baseline);
- ``staggered_head``: KV head ``g`` of ``G`` on offset ``(g*d)//G`` (``offsets="per_head"``);
- ``staggered_layer``: compressed layer ``r`` of ``n`` on ``(r*d)//n`` (``offsets="per_layer"``),
  on 3-layer models with layers 2 and 3 compressed, against ``aligned_3layer``;
- ``random_offset``: a fresh grid offset per sequence at every training forward, offset 0 at
  test time (``offsets="random"``);
- ``jittered_data``: aligned grid, training pairs separated by 0..``jitter`` random fillers (the
  test set is not jittered).

Phases are absolute, ``pos mod d``: the phase a user of the deployed model sees. Stages: (1) a
:class:`TrainJob` per (fix, seed); (2) a :class:`FixStatsJob` per fix: the statistics template
per seed and seeds pooled (all targets, and those beyond the raw window), and against its
baseline the gap reduction and the accuracy change with paired cluster-bootstrap CIs
(``compare_gaps``). The goal: a cut of the debiased gap by >= :data:`GOAL_REDUCTION` with its CI
above 0, mean accuracy not lower by more than :data:`NONINFERIORITY` (CI), every seed of the fix
off the loss plateau (:mod:`phasemech.measure.learning`). The finish writes ``results.parquet``,
``comparison.parquet``, ``summary.json`` (what ``analyses/report.py`` reads once recorded in
``analyses/results/fixes_<profile>.json``) and ``summary.md``.

Axes: ``target`` rows; ``phase`` = ``source_pos mod stride``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from phasemech.core.config import CompressionConfig
from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.data.tasks import MQARTask
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import Job, TrainJob, payload, scored_targets
from phasemech.experiments.lr_search import convergence_frame
from phasemech.experiments.sweep import SYSTEM_TRAINING, report_row, system_geometry
from phasemech.experiments.sweep_summary import matched_gaps
from phasemech.measure.learning import PLATEAU_EXIT, all_off_plateau
from phasemech.training.config import ModelSpec, TrainConfig

GOAL_REDUCTION = 0.70
NONINFERIORITY = 0.01


@dataclass(frozen=True)
class Variant:
    """One way to train a model; ``baseline`` names the variant it is compared with."""

    offsets: str = "aligned"
    jitter: bool = False
    n_layers: int = 2
    layers: tuple[int, ...] = (1,)
    baseline: str | None = "aligned"


# Layer 2 (the retrieval layer of the induction circuit) is compressed, as in the phase sweep.
# Per-layer staggering needs two compressed layers: its own matched 3-layer pair. (A pilot with
# both layers of a 2-layer model compressed left aligned and per-head models on the plateau.)
VARIANTS = {
    "aligned": Variant(baseline=None),
    "staggered_head": Variant(offsets="per_head"),
    "random_offset": Variant(offsets="random"),
    "jittered_data": Variant(jitter=True),
    "aligned_3layer": Variant(n_layers=3, layers=(1, 2), baseline=None),
    "staggered_layer": Variant(
        offsets="per_layer", n_layers=3, layers=(1, 2), baseline="aligned_3layer"
    ),
}
FIXES = tuple(VARIANTS)


def _profile(steps: int, seeds, **kw) -> Profile:
    fixes = kw.pop("fixes", FIXES)
    jitter = kw.pop("jitter", 2)
    more = kw.pop("extra_items", ())
    target = kw.pop("target_accuracy", None)
    designs = kw.pop("designs", ("mean",))
    return Profile(
        steps=steps, seeds=seeds, designs=designs, checkpoint_every=None,
        target_accuracy=target, extra=(("fixes", fixes), ("jitter", jitter), *more), **kw,
    )  # fmt: skip


PROFILES = {
    # one seed: the smoke test of every fix and comparison, as fast as the test suite needs
    "tiny": _profile(20, (0,), strides=(4,), heads=(2,), seq_lens=(32,), n_pairs=4, jitter=1,
                     test_sequences=64, n_boot=50, n_perm=50, eval_every=10),
    # the largest gap of the default phase sweep: mean pooling, d = 8, 2 heads, T = 64
    "default": _profile(2000, (0, 1, 2), strides=(8,), heads=(2,)),
    # the budget axis: the 2-layer variants again with twice the steps
    "long": _profile(4000, (0, 1, 2), strides=(8,), heads=(2,),
                     fixes=("aligned", "staggered_head", "random_offset", "jittered_data")),
    # every fix and its baseline trained to convergence (the recipe's 8000 steps, early stop
    # at 0.99): a fix counts only if all its seeds reach 0.95 test accuracy; compared at
    # equal accuracy (final) and along training at equal budget (budget.parquet)
    "converged": _profile(8000, (0, 1, 2), strides=(4,), heads=(2,), test_sequences=2048,
                          target_accuracy=0.99, extra_items=(("min_accuracy", 0.95),)),
    # the offset fixes on the real systems (phase_sweep --profile systems): the 2-layer grid
    # fixes, at that profile's recipe, one profile per system ("systems_nsa", ...)
    **{f"systems_{design}{suffix}": _profile(
           4000, (0, 1, 2), strides=(16,) if design == "hca" else (4,), heads=(2,),
           seq_lens=(seq_len,), test_sequences=2048, target_accuracy=0.99,
           fixes=("aligned", "staggered_head", "random_offset"), designs=(design,),
           extra_items=(("min_accuracy", 0.95),))
       for design in ("nsa", "dsa", "csa", "hca", "partition")
       # the same at T = 128 (phase_sweep --profile systems_T128): "systems_partition_T128"
       for suffix, seq_len in (("", 64), ("_T128", 128))},
}  # fmt: skip


def test_task(p: Profile) -> MQARTask:
    """The one test task every fix is scored on (never jittered)."""
    return MQARTask(vocab_size=64, seq_len=p.seq_lens[0], n_pairs=p.n_pairs, stride=p.strides[0])


def train_config(fix: str, seed: int, p: Profile) -> TrainConfig:
    if fix not in VARIANTS:
        raise ValueError(f"fix={fix!r} is invalid: allowed {FIXES}")
    v, d = VARIANTS[fix], p.strides[0]
    jitter = p.get("jitter") if v.jitter else 0
    task = MQARTask(64, p.seq_lens[0], p.n_pairs, stride=d, jitter=jitter)
    comp = CompressionConfig(
        p.designs[0], stride=d, window=2 * d, offsets=v.offsets, layers=v.layers,
        **system_geometry(p.designs[0], d),
    )  # fmt: skip
    return TrainConfig(
        task=task,
        model=ModelSpec(n_layers=v.n_layers, d_model=p.d_model, n_heads=p.heads[0]),
        compression=comp,
        steps=p.steps,
        eval_every=p.eval_every,
        checkpoint_every=None,
        eval_sequences=512 if p.test_sequences >= 512 else 64,
        # the profile decides early stopping (the budget profiles train every step)
        target_accuracy=p.target_accuracy,
        seed=seed,
        **SYSTEM_TRAINING.get(p.designs[0], {}),
    )


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


def _fix_of(job: TrainJob) -> str:
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
            base_fix = _fix_of(self.baseline[0])
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
        by_fix.setdefault(_fix_of(job), []).append((job, result))
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


def fix_curves(done: Done) -> pd.DataFrame:
    """Every held-out evaluation of every run: fix, seed, step, accuracy and raw gap (max - min
    of per-phase accuracy)."""
    frames = []
    for job, result in done.of(TrainJob):
        c = pd.DataFrame(result["curve"])
        if not len(c):
            continue
        by = np.vstack(c["accuracy_by_phase"].to_numpy())
        c = c.assign(raw_gap=by.max(1) - by.min(1), fix=_fix_of(job), seed=job.train.seed)
        frames.append(c[["fix", "seed", "step", "accuracy", "raw_gap"]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def budget_table(curve: pd.DataFrame) -> pd.DataFrame:
    """Each fix beside its baseline at equal training budget, from :func:`fix_curves`: at
    every evaluated step, the mean over seeds of held-out accuracy and raw gap. A run that
    stopped early at its target keeps its last evaluation at later steps (it had converged)."""
    rows = []
    for fix, g in curve.groupby("fix", sort=False) if len(curve) else ():
        base = VARIANTS[fix].baseline if fix in VARIANTS else None
        seeds = [c.set_index("step") for _, c in g.groupby("seed")]
        for step in sorted(g["step"].unique()):
            at = [c[c.index <= step].iloc[-1] for c in seeds if c.index.min() <= step]
            rows.append({"fix": fix, "baseline": base, "step": int(step), "seeds": len(at),
                         "accuracy": float(np.mean([a["accuracy"] for a in at])),
                         "raw_gap": float(np.mean([a["raw_gap"] for a in at]))})  # fmt: skip
    return pd.DataFrame(rows)


def convergence_table(done: Done) -> pd.DataFrame:
    """Fix x seed: steps to 0.95 held-out accuracy, final step, held-out and test accuracy,
    training seconds, and ``converged``."""
    runs = done.of(TrainJob)
    df = convergence_frame(runs)
    df.insert(0, "fix", [_fix_of(j) for j, _ in runs])
    return df


def matched_table(curve: pd.DataFrame) -> pd.DataFrame:
    """Each fix's held-out raw gap by held-out accuracy band (every evaluation of every seed
    in :func:`fix_curves`), with its baseline's in the same band: the fix against its baseline
    at equal accuracy."""
    m = matched_gaps(curve, by=("fix",))
    if not len(m):
        return m
    m["baseline"] = [VARIANTS[f].baseline if f in VARIANTS else None for f in m["fix"]]
    base = m[["fix", "band", "raw_gap", "n"]].rename(
        columns={"fix": "baseline", "raw_gap": "baseline_raw_gap", "n": "baseline_n"}
    )
    return m.merge(base, on=["baseline", "band"], how="left")


def profile_dict(p: Profile) -> dict[str, Any]:
    """The profile as the recorded fixes summaries name it."""
    return {
        "design": p.designs[0], "stride": p.strides[0], "heads": p.heads[0],
        "seq_len": p.seq_lens[0], "n_pairs": p.n_pairs, "seeds": list(p.seeds),
        "steps": p.steps, "jitter": p.get("jitter"), "test_sequences": p.test_sequences,
        "n_boot": p.n_boot, "n_perm": p.n_perm, "eval_every": p.eval_every,
        "fixes": list(p.get("fixes")),
        # a seed counts as learned at this held-out accuracy; runs stopped early at the target
        "min_accuracy": p.get("min_accuracy", PLATEAU_EXIT), "target_accuracy": p.target_accuracy,
    }  # fmt: skip


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    from phasemech.experiments.fixes_summary import (
        budget_markdown,
        convergence_markdown,
        matched_markdown,
        summary_markdown,
    )

    stats = done.of(FixStatsJob)
    results = pd.DataFrame([r for _, res in stats for r in res["rows"]])
    comparison = pd.DataFrame([c for _, res in stats for c in res["comparison"]])
    atomic_write(out / "results.parquet", lambda tmp: results.to_parquet(tmp))
    atomic_write(out / "comparison.parquet", lambda tmp: comparison.to_parquet(tmp))
    curve = fix_curves(done)  # read once: the budget and matched tables both bin it
    budget, conv, matched = budget_table(curve), convergence_table(done), matched_table(curve)
    for name, df in (("budget", budget), ("convergence", conv), ("matched", matched)):
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    train_min = sum(r["train_seconds"] for _, r in done.of(TrainJob)) / 60
    summary = json_safe(
        {
            "profile": profile_dict(p),
            "training_minutes": train_min,
            "goal_reduction": GOAL_REDUCTION,
            "noninferiority": NONINFERIORITY,
            "plateau_exit": PLATEAU_EXIT,
            "results": results.to_dict("records"),
            "comparison": comparison.to_dict("records"),
            "budget": budget.to_dict("records"),
            "convergence": conv.to_dict("records"),
            "matched": matched.to_dict("records"),
        }
    )
    write_json_atomic(out / "summary.json", summary)
    text = (
        summary_markdown(results, comparison, p, train_min)
        + convergence_markdown(conv)
        + matched_markdown(matched)
        + budget_markdown(budget)
    )
    write_text_atomic(out / "summary.md", text)
    return summary


FIXES_EXPERIMENT = Experiment(
    name="fixes",
    profiles=PROFILES,
    stages=(train_jobs, stats_jobs),
    finish=finish,
    about="matched models with and without each offset or data fix, gaps compared",
)

__all__ = [
    "FIXES",
    "FIXES_EXPERIMENT",
    "GOAL_REDUCTION",
    "NONINFERIORITY",
    "PROFILES",
    "VARIANTS",
    "FixStatsJob",
    "train_config",
    "train_jobs",
]
