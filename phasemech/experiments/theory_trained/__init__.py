"""Theory vs trained models, as an experiment: do gated heads specialise on phases as the
gradient-flow model says?

Gated models (2 layers, layer 2 compressed at stride d = 4, raw window 2d, d_head 16; at d = 8
``converged_d8`` uses d_model 128 and d_head 32, which leave the loss plateau) with
H = 2, 4 and 8 heads (fewer heads than phases, as many, more), trained on phase-uniform MQAR
(T = 64: a target's window competes with N = T/d = 16 windows). Stages: (1)-(2) a
:class:`TrainJob` per (H, seed), through the learning-rate search of
:mod:`phasemech.experiments.lr_search` where the profile has rates (seed 0 at every rate, the
other seeds at the better one); (3) a :class:`TheoryFitJob` per chosen model: the effective
pooling weight ``W[head, phase]`` each gated head gives target tokens
(``phasemech.theory.fit``), the theory's accuracy per phase from ``W`` against the measured
one (targets beyond the raw window, read only through blocks), and a :class:`TheorySimJob` per
H: the theory simulated from scratch at the same H, d, N. The pooled rank test uses only
models that learned (off the MQAR loss plateau, or at the profile's ``min_accuracy``): a model
that retrieves nothing has no phase ranking to explain. The finish writes ``results.parquet``,
``weights.parquet``, ``convergence.parquet``, ``lr_search.parquet``, ``summary.json`` and
``summary.md``.

Axes: ``head``, ``phase``; ``target`` rows.

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``summary``: its summary: the tables as markdown (``summary.md``), ``summary.json`` or figures;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.theory_trained.jobs import (
    TheoryFitJob,
    TheorySimJob,
    fit_jobs,
    make_jobs,
    search_jobs,
    seed_jobs,
    theory_config,
)
from phasemech.experiments.theory_trained.profiles import D_HEAD, PROFILES, task, train_config
from phasemech.experiments.theory_trained.study import THEORY_TRAINED, finish, pooled_tests

__all__ = [
    "D_HEAD",
    "PROFILES",
    "THEORY_TRAINED",
    "TheoryFitJob",
    "TheorySimJob",
    "finish",
    "fit_jobs",
    "make_jobs",
    "pooled_tests",
    "search_jobs",
    "seed_jobs",
    "task",
    "theory_config",
    "train_config",
]
