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

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``summary``: its summary: the tables as markdown (``summary.md``), ``summary.json`` or figures;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.fixes.jobs import FixStatsJob, stats_jobs, train_jobs
from phasemech.experiments.fixes.profiles import (
    FIXES,
    GOAL_REDUCTION,
    NONINFERIORITY,
    PROFILES,
    VARIANTS,
    Variant,
    test_task,
    train_config,
)
from phasemech.experiments.fixes.study import (
    FIXES_EXPERIMENT,
    budget_table,
    convergence_table,
    finish,
    fix_curves,
    matched_table,
    profile_dict,
)

__all__ = [
    "FIXES",
    "FIXES_EXPERIMENT",
    "FixStatsJob",
    "GOAL_REDUCTION",
    "NONINFERIORITY",
    "PROFILES",
    "VARIANTS",
    "Variant",
    "budget_table",
    "convergence_table",
    "finish",
    "fix_curves",
    "matched_table",
    "profile_dict",
    "stats_jobs",
    "test_task",
    "train_config",
    "train_jobs",
]
