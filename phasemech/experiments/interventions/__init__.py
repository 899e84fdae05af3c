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

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``summary``: its summary: the tables as markdown (``summary.md``), ``summary.json`` or figures;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.interventions.jobs import (
    InterventionJob,
    intervention_jobs,
    patch_sites_for,
)
from phasemech.experiments.interventions.profiles import DEFAULT_MODELS, OUT_DIR, PROFILES
from phasemech.experiments.interventions.study import INTERVENTIONS, detailed, finish

__all__ = [
    "DEFAULT_MODELS",
    "INTERVENTIONS",
    "InterventionJob",
    "OUT_DIR",
    "PROFILES",
    "detailed",
    "finish",
    "intervention_jobs",
    "patch_sites_for",
]
