"""Head-by-source-phase attention of a small compressed model trained on a copy task, as an
experiment (it replaces the standalone script ``analyses/head_phase_attention.py``).

The model: a 2-layer attention-only ``PhaseTransformer`` whose layers both use ``gated``
compression (stride d = 4, raw window 2d = 8, 4 heads), trained on a repeated-random-sequence
task: tokens ``x_0..x_{P-1}`` followed by the same ``P`` tokens. Predicting the second copy
needs the token after the previous occurrence, ``P`` positions back: far outside the raw window,
so it must be read through compressed blocks.

One stage: a :class:`CopyTaskJob` per seed trains the model in its own folder (resumable: a
checkpoint holds the weights, the optimizer, the schedule and the batch generator, so a resumed
run ends with the weights an uninterrupted one would have), then measures the attention mass per
(layer, head, source phase), averaged over the second copy's queries and from each answer
position onto its needle (the source token, ``P - 1`` back), and the copy accuracy by needle
phase. The finish writes ``phase_attention_mean.parquet``, ``phase_attention_needle.parquet``,
``copy_accuracy.parquet``, ``train_loss.parquet``, ``summary.json``, ``summary.md`` and the two
heatmaps ``head_phase_attention.html`` (query mean) and ``head_phase_needle.html`` (answer ->
needle) into the experiment folder.

Axes: ``layer, head, phase`` (source or needle phase on the model's grid); ``seed`` rows.

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``summary``: its summary: the tables as markdown (``summary.md``), ``summary.json`` or figures;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.head_attention.jobs import (
    CopyTaskJob,
    build_model,
    copy_batch,
    copy_jobs,
    copy_loss,
    measure,
    train_copy_model,
)
from phasemech.experiments.head_attention.profiles import (
    LOSS_FILE,
    MODEL_DIR,
    PROFILES,
    STATE_FILE,
    VOCAB,
)
from phasemech.experiments.head_attention.study import HEAD_ATTENTION, finish
from phasemech.experiments.head_attention.summary import (
    TABLES,
    over_seeds,
    summary_markdown,
    tables,
    write_figures,
)

__all__ = [
    "CopyTaskJob",
    "HEAD_ATTENTION",
    "LOSS_FILE",
    "MODEL_DIR",
    "PROFILES",
    "STATE_FILE",
    "TABLES",
    "VOCAB",
    "build_model",
    "copy_batch",
    "copy_jobs",
    "copy_loss",
    "finish",
    "measure",
    "over_seeds",
    "summary_markdown",
    "tables",
    "train_copy_model",
    "write_figures",
]
