"""The experiment behind ``make figures``: trained models, their dashboard panels, the
showcase model's grid-contrast patching and the theory's predictions, as tables.

Stages: (1) the phase sweep's :class:`TrainJob` of each model of the profile; (2) a
:class:`PanelJob` per model (per-phase accuracy and gap, head attention on the needle by phase,
head zero-ablation effects by phase with their specialisation tests, an example pattern) and a
:class:`TheoryJob`; (3) a :class:`PatchJob` for the *showcase*: the compressed model whose most
phase-specialised compressed-layer head ranks first (Holm p < 0.05, then the range of its
per-phase ablation effect), among models with test accuracy >= 0.9 when any. The finish writes
``per_phase.parquet`` (per-phase accuracy with cluster-bootstrap CIs per design x stride x heads
x T and grid, seeds pooled, final checkpoints), ``panels.json``, ``patch_grid.parquet``,
``theory_predictions.json`` and ``summary.json`` under ``RUNS/<folder>/showcase/``. Figures
are drawn from these by ``analyses/figures.py``.

Axes: ``layer, head, phase``; ``target`` rows.

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``panels``: its page: the dashboard's panels, computed per run and cached;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.showcase.jobs import (
    PanelJob,
    PatchJob,
    TheoryJob,
    best_head,
    panel_jobs,
    patch_jobs,
    pick_showcase,
)
from phasemech.experiments.showcase.profiles import PROFILES, SHOWCASE_DIR
from phasemech.experiments.showcase.study import FIGURES, finish, per_phase_table

__all__ = [
    "FIGURES",
    "PROFILES",
    "PanelJob",
    "PatchJob",
    "SHOWCASE_DIR",
    "TheoryJob",
    "best_head",
    "finish",
    "panel_jobs",
    "patch_jobs",
    "per_phase_table",
    "pick_showcase",
]
