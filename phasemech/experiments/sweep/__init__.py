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

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``summary``: its summary: the tables as markdown (``summary.md``), ``summary.json`` or figures;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.sweep.jobs import (
    SweepStatsJob,
    grids,
    make_jobs,
    report_row,
    search_jobs,
    seed_jobs,
    stats_jobs,
    train_jobs,
)
from phasemech.experiments.sweep.profiles import (
    PROFILES,
    SYSTEM_GEOMETRY_STRIDES,
    SYSTEM_TRAINING,
    RunSpec,
    design_options,
    run_specs,
    system_geometry,
    train_config,
)
from phasemech.experiments.sweep.study import PHASE_SWEEP, finish, gap_curve

__all__ = [
    "PHASE_SWEEP",
    "PROFILES",
    "RunSpec",
    "SYSTEM_GEOMETRY_STRIDES",
    "SYSTEM_TRAINING",
    "SweepStatsJob",
    "design_options",
    "finish",
    "gap_curve",
    "grids",
    "make_jobs",
    "report_row",
    "run_specs",
    "search_jobs",
    "seed_jobs",
    "stats_jobs",
    "system_geometry",
    "train_config",
    "train_jobs",
]
