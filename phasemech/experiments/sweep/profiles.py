"""The from-scratch phase sweep as an experiment: do compressed models retrieve worse at some
phases?

Same-size 2-layer attention-only models (``d_model`` 64) on phase-uniform MQAR (V = 64, 8
pairs), layer 2 compressed with a raw window of 2d; designs ``none`` (the dense control) and
every compression; every model scored on one shared phase-balanced test set per length at each
checkpoint. Stages: (1) :class:`TrainJob` per model; (2) :class:`SweepStatsJob` per (design,
stride, heads, T): the full statistics template, seeds pooled (clusters: seed, then content) at
the final checkpoint, for all targets and for those beyond the raw window, and per seed at every
scored checkpoint. The finish writes ``results.parquet`` (one row per design x stride x heads x
T x seed|pooled x step x targets), ``gap_vs_accuracy.parquet`` (held-out gap along training)
and ``summary.json``.

Axes: ``target`` rows; ``phase`` on each reported grid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from phasemech.core.config import CompressionConfig
from phasemech.core.grid import phase_of
from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.data.tasks import MQARTask
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import Job, TrainJob, payload, scored_targets
from phasemech.experiments.lr_search import (
    analysed_runs,
    chosen_runs,
    convergence_table,
    curves,
    search_stages,
    search_table,
    with_lr,
)
from phasemech.experiments.sweep_summary import (
    convergence_markdown,
    matched_gaps,
    summary_markdown,
)
from phasemech.training.config import ModelSpec, TrainConfig

_SWEEP = dict(strides=(4, 8), heads=(2, 4), seeds=(0, 1, 2))
_TINY = dict(
    steps=30,
    designs=("none", "gated"),
    strides=(4,),
    heads=(2,),
    seq_lens=(32,),
    eval_every=10,
    checkpoint_every=10,
    target_accuracy=None,
    test_sequences=64,
    n_boot=50,
    n_perm=50,
    n_pairs=4,
)
#: the real systems' recipe (docs/designs.md): the "converged" recipe, HCA at its own stride
_SYSTEMS = dict(
    steps=4000, strides=(4,), heads=(2,), seeds=(0, 1, 2), target_accuracy=0.99,
    checkpoint_every=500, test_sequences=2048,
    extra=(("lrs", (3e-3,)), ("pool_min_accuracy", 0.95),
           ("design_strides", (("hca", (16,)), ("none", (4, 16))))),
)  # fmt: skip
_SYSTEMS_ALL = ("none", "nsa", "dsa", "csa", "hca", "partition")


def _systems(designs: tuple[str, ...], *extra: tuple[str, Any], **kw: Any) -> Profile:
    """The systems' recipe for ``designs``, with more ``extra`` options and fields."""
    return Profile(**{**_SYSTEMS, "designs": designs, "extra": _SYSTEMS["extra"] + extra, **kw})


_POST = ("design_options", (("csa", (("pool_rope", "post"),)), ("hca", (("pool_rope", "post"),))))
PROFILES = {
    "tiny": Profile(**_TINY),
    # the learning-rate search's smoke test: two rates on seed 0, seed 1 at the better one
    "tiny_search": Profile(**{**_TINY, "seeds": (0, 1)}, extra=(("lrs", (1e-3, 3e-2)),)),
    "default": Profile(
        steps=2000, **_SWEEP, seq_lens=(64, 128), long_designs=("none", "gated"),
        long_strides=(8,),
    ),
    # the budget axis: does a longer run escape the plateau, and does the gap close?
    "long": Profile(steps=5000, **{**_SWEEP, "heads": (4,)}, designs=("none", "gated")),
    # the from-scratch claims at convergence: the training recipe's defaults (8000 steps, early
    # stop at 0.99), a learning-rate search on seed 0, seeds 1-2 at the best rate, and only
    # models that reached 0.95 held-out accuracy pooled into a gap
    "converged": Profile(
        steps=8000, strides=(4,), heads=(2, 4), seeds=(0, 1, 2), designs=("none", "mean",
        "gated", "mlp"), target_accuracy=0.99, checkpoint_every=500, test_sequences=2048,
        # the search: 3e-3 (the recipe) and 1e-3 on seed 0 for 2000 steps; seeds 1-2 then get
        # the full 8000 at the better rate (ranked by steps to 0.95, then accuracy)
        extra=(("lrs", (3e-3, 1e-3)), ("search_steps", 2000), ("pool_min_accuracy", 0.95)),
    ),
    # the same at d = 8 (its prefix spans 8 positions: longer plateaus, the budget may not do)
    "converged_d8": Profile(
        steps=8000, strides=(8,), heads=(2, 4), seeds=(0, 1, 2), designs=("none", "mean",
        "gated", "mlp"), target_accuracy=0.99, checkpoint_every=500, test_sequences=2048,
        extra=(("lrs", (3e-3,)), ("pool_min_accuracy", 0.95)),
    ),
    # the d = 8 recipe that converges (docs/training.md): the same sweep with d_model 128 (a
    # head dimension of 64 / 32 at H = 2 / 4); at d_model 64 a third of the models stayed on
    # the plateau for 8000 steps. Without mlp: its seed-0 models (H = 2 and 4) were still on
    # the plateau at d_model 128 after 2600-2800 steps, and a session's 2 cores could not
    # carry six more 8000-step runs (docs/training.md)
    "converged_d8_wide": Profile(
        steps=8000, strides=(8,), heads=(2, 4), seeds=(0, 1, 2), designs=("none", "mean",
        "gated"), d_model=128, target_accuracy=0.99, checkpoint_every=500,
        test_sequences=2048, extra=(("lrs", (3e-3,)), ("pool_min_accuracy", 0.95)),
    ),
    # the context axis: T = 128 (32 blocks per context at d = 4), H = 2, at the rate the T = 64
    # search kept for every H = 2 setting (3e-3)
    "converged_T128": Profile(
        steps=8000, strides=(4,), heads=(2,), seeds=(0, 1, 2), seq_lens=(128,), designs=("none",
        "mean", "gated", "mlp"), target_accuracy=0.99, checkpoint_every=500,
        test_sequences=2048, extra=(("lrs", (3e-3,)), ("pool_min_accuracy", 0.95)),
    ),
    # the real systems (docs/designs.md) beside the dense control, at the recipe of
    # "converged"; HCA compresses at a much larger rate than the rest (16 at T = 64, against
    # 128 at 1M tokens in the real model), so it and its dense control run at d = 16
    "systems": _systems(_SYSTEMS_ALL),
    # the context axis for the systems: T = 128 (twice the blocks per context), the same recipe
    "systems_T128": _systems(_SYSTEMS_ALL, seq_lens=(128,)),
    # pre- against post-RoPE pooling (DeepSeek-V4 pools pre-RoPE and rotates the entry at its
    # block start): csa / hca with rotary positions (the lab's default is learned absolute
    # positions, under which the option changes nothing)
    "systems_rotary": _systems(("none", "csa", "hca"), ("positional", "rotary")),
    "systems_rotary_post": _systems(("none", "csa", "hca"), ("positional", "rotary"), _POST),
    # NSA's gate as its paper states it, an MLP and a sigmoid (32 SiLU units), against the
    # one-linear-map gate of "systems"
    "systems_nsa_mlp_gate": _systems(
        ("none", "nsa"), ("design_options", (("nsa", (("gate_hidden", 32),)),)),
        ("design_strides", (("none", (4,)),)),  # the later entry wins: no d = 16 control
    ),
    "full": Profile(
        steps=4000, **{**_SWEEP, "seeds": (0, 1, 2, 3, 4)}, seq_lens=(64, 128),
        long_designs=("none", "gated", "mean"), long_heads=(2, 4), target_accuracy=None,
        test_sequences=8192, n_boot=1000, n_perm=1000,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class RunSpec:
    design: str
    stride: int  # dense runs: the largest stride (phases on smaller grids derive from it)
    heads: int
    seq_len: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.design}_d{self.stride}_h{self.heads}_T{self.seq_len}_s{self.seed}"


def run_specs(p: Profile) -> list[RunSpec]:
    """Every model of the profile (``p.models``: only those, in that order)."""
    specs = []
    for t_i, seq_len in enumerate(p.seq_lens):
        designs = p.designs if t_i == 0 else p.long_designs
        heads = p.heads if t_i == 0 else p.long_heads
        strides = p.strides if t_i == 0 else p.long_strides
        own = dict(p.get("design_strides", ())) if t_i == 0 else {}
        for design in designs:
            # a dense control per stride: it sees the same data stream as the compressed
            # models of that stride (the task's prefix spans one stride)
            for d in own.get(design, strides):
                specs += [RunSpec(design, d, h, seq_len, s) for h in heads for s in p.seeds]
    if p.models is None:
        return specs
    by_name = {s.name: s for s in specs}
    missing = [m for m in p.models if m not in by_name]
    if missing:
        raise ValueError(f"profile models {missing} are not runs of the sweep")
    return [by_name[m] for m in p.models]


#: the systems' own geometry at toy scale, in strides: NSA compresses blocks of 2d every d
#: (32 every 16 in the paper) and selects blocks of 2d here (64 in the paper, 4d)
SYSTEM_GEOMETRY_STRIDES = {"nsa": {"block_len": 2, "select_len": 2}}


#: the systems' own training: DSA trains its indexer in a dense warm-up before sparse attention
#: (without it the indexer starts random, keeps the wrong pools, and the model stayed on the
#: loss plateau: docs/training.md); a dense model learns the task in 200-300 steps
SYSTEM_TRAINING = {"dsa": {"selection_warmup": 500}}


def system_geometry(design: str, stride: int) -> dict[str, int]:
    return {k: v * stride for k, v in SYSTEM_GEOMETRY_STRIDES.get(design, {}).items()}


def design_options(design: str, p: Profile) -> dict[str, Any]:
    """The profile's compression options for ``design`` (``extra`` ``design_options``: e.g.
    csa's ``pool_rope``), as CompressionConfig keywords."""
    return dict(dict(p.get("design_options", ())).get(design, ()))


def train_config(spec: RunSpec, p: Profile) -> TrainConfig:
    # the task's random prefix spans the model's own stride: phases uniform on its grid with the
    # least positional spread (one shared prefix over the largest stride kept d = 4 models on
    # the loss plateau, docs/training.md); dense and compressed models of a stride share it
    task = MQARTask(vocab_size=64, seq_len=spec.seq_len, n_pairs=p.n_pairs, stride=spec.stride)
    if spec.design == "none":
        comp = CompressionConfig("none", stride=spec.stride)
    else:
        comp = CompressionConfig(
            spec.design,
            stride=spec.stride,
            window=2 * spec.stride,
            layers=(1,),
            **system_geometry(spec.design, spec.stride),
            **design_options(spec.design, p),
        )
    return TrainConfig(
        task=task,
        model=ModelSpec(
            n_layers=2,
            d_model=p.d_model,
            n_heads=spec.heads,
            positional_embedding_type=p.get("positional", "standard"),
        ),
        compression=comp,
        steps=p.steps,
        eval_every=p.eval_every,
        checkpoint_every=p.checkpoint_every,
        eval_sequences=512 if p.test_sequences >= 512 else 64,
        target_accuracy=p.target_accuracy,
        seed=spec.seed,
        **SYSTEM_TRAINING.get(spec.design, {}),
    )


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


# ------------------------------------------------------------------------------------ finish


def gap_curve(done: Done, p: Profile) -> pd.DataFrame:
    """Held-out raw gap along training, per evaluation of every run (for matching compressed
    runs to dense ones at equal accuracy)."""
    rows = []
    for job, result in chosen_runs(done):
        c = job.train
        for m in result["curve"]:
            by = np.asarray(m["accuracy_by_phase"], dtype=float)
            for stride in grids(c.compression.design, c.compression.stride, p.strides):
                # accuracy by phase on a coarser grid: phases fold (mod), counts are equal
                folded = by.reshape(-1, stride).mean(0) if len(by) != stride else by
                rows.append(
                    {
                        "design": c.compression.design,
                        "stride": stride,
                        "heads": c.model.n_heads,
                        "seq_len": c.task.seq_len,
                        "seed": c.seed,
                        "step": m["step"],
                        "accuracy": m["accuracy"],
                        "raw_gap": float(folded.max() - folded.min()),
                    }
                )
    return pd.DataFrame(rows)


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """``results.parquet``, ``gap_vs_accuracy.parquet`` and ``summary.json`` under ``out``."""
    rows = [r for _, res in done.of(SweepStatsJob) for r in res["rows"]]
    results = pd.DataFrame(rows)
    atomic_write(out / "results.parquet", lambda tmp: results.to_parquet(tmp))
    curve = gap_curve(done, p)
    atomic_write(out / "gap_vs_accuracy.parquet", lambda tmp: curve.to_parquet(tmp))
    conv, search = convergence_table(done), search_table(done)
    for name, df in (("convergence", conv), ("lr_search", search), ("curves", curves(done))):
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    trained = chosen_runs(done)
    summary = {
        # the width travels with the recording (the report reads it, not today's profile)
        "profile": {
            "d_model": p.d_model,
            "n_pairs": p.n_pairs,
            "steps": p.steps,
            "positional": p.get("positional", "standard"),
            "design_options": {d: dict(o) for d, o in p.get("design_options", ())},
        },
        "models": len(trained),
        "train_seconds": sum(r["train_seconds"] for _, r in trained),
        "runs": [
            {
                "name": j.name,
                "step": r["step"],
                "heldout_accuracy": r["heldout_accuracy"],
                "test_accuracy": r["test_accuracy"],
                "seconds": r["seconds"],
            }
            for j, r in trained
        ],
        "rows": rows,
        "matched": matched_gaps(curve).to_dict("records"),
        "convergence": conv.to_dict("records"),
        "lr_search": search.to_dict("records"),
    }
    summary = json_safe(summary)
    write_json_atomic(out / "summary.json", summary)
    text = summary_markdown(out.name, results, curve, summary["train_seconds"], p, len(trained))
    text += convergence_markdown(conv, search)
    write_text_atomic(out / "summary.md", text)
    return summary


PHASE_SWEEP = Experiment(
    name="phase_sweep",
    profiles=PROFILES,
    stages=(search_jobs, seed_jobs, stats_jobs),
    finish=finish,
    about="from-scratch models of every design, trained, scored and reported per phase",
)


__all__ = [
    "PHASE_SWEEP",
    "PROFILES",
    "RunSpec",
    "SweepStatsJob",
    "grids",
    "report_row",
    "run_specs",
    "train_config",
    "train_jobs",
]
