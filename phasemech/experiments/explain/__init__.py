"""``phasemech explain``: which components make a real model's weak phase weak? Selection,
layers and heads, by causal intervention on the audit's own prompts.

Axes: ``prompt`` (the audit's paired prompts: every content at every phase), ``pair`` (one
content: clean at its strong phase, corrupted at its weak one), ``layer``, ``head``, ``phase``.

An explanation is one :class:`ExplainConfig`: a probe (:class:`~phasemech.experiments.probe.
config.ProbeConfig`, the audit's: one design and grid on one model, in one regime, at one
context), on the prompts ``phasemech audit`` scores (the same task, contents and seed
give the same prompts). It runs in three steps through the experiment launcher, each step's
jobs cached under ``OUT/jobs`` (a rerun computes nothing, a killed one resumes):

1. ``observe`` (every prompt): the answer under the null and the design, the needle's
   selection in every selecting layer and head (:func:`~phasemech.interventions.oracle.
   needle_selection`), the oracle forcing the needle's block in every layer (four forms: add
   or replace, at the answer rows or every row after the needle) and in each layer alone (add
   and replace at every row after the needle; :func:`~phasemech.interventions.oracle.
   force_needle`), and each head's mean output;
2. ``intervene``: zero and mean ablation of every head on every prompt, and on each content's
   (strong, weak) pair the exact patching of every head and every layer's residual, and
   attribution patching of every head (:mod:`phasemech.interventions.prompt_patching`). The
   strong and weak phases are the design's best and worst accuracy in step 1 unless
   ``contrast_phases`` names them; only contents whose strong-phase prompt is answered right
   (first token) are paired;
3. ``heads``: the oracle again, in the ``top_heads`` heads that matter most (largest exact
   patching effect); beside it ``groups``: groups of heads ablated together (the
   ``group_sizes`` heads that read the needle most under the null, from ``attend``, and each
   layer's heads), zero, mean (step 1's means) and resample (another content's prompt at
   another phase; :mod:`phasemech.interventions.group_ablation`).

Beside step 2 runs ``attend`` (every prompt): each head's attention from the row predicting
the first answer token onto the needle's first answer token, under the null and the design
(as the audit reads it: ``hook_pattern``, or ``hook_token_pattern`` on compressed layers),
and ``decompose`` (every prompt): the selection at that row split into its tokens' terms,
for the needle's block, the block it competes with and the sink's
(:mod:`phasemech.interventions.decompose`).

:mod:`phasemech.experiments.explain.run` runs the steps as the stages of an experiment
(:data:`EXPLAIN`: ``phasemech run explain``); :mod:`phasemech.experiments.explain.tables`
turns the results into the tables.

One folder, one study (the old module path still imports these names):

- ``config``: :class:`ExplainConfig` (what one explanation is) and the analyses it may run;
- ``jobs``: :class:`ExplainJob` (one step on a few prompts or pairs, worker side);
- ``tables``: the tables of the steps' results;
- ``groups``: the ``groups`` step's units, resample sources and tables, and the selection at
  the needle-reading heads;
- ``run``: :data:`EXPLAIN` and :func:`run_explain` (the steps through the launcher);
- ``summary``: ``summary.md`` and ``summary.json`` from the tables.
"""

from phasemech.experiments.explain.config import ANALYSES, SELECTING, ExplainConfig
from phasemech.experiments.explain.jobs import (
    ExplainJob,
    check_explain,
    contrast_phases,
    explain_jobs,
)
from phasemech.experiments.explain.run import EXPLAIN, run_explain

__all__ = [
    "ANALYSES",
    "EXPLAIN",
    "ExplainConfig",
    "ExplainJob",
    "SELECTING",
    "check_explain",
    "contrast_phases",
    "explain_jobs",
    "run_explain",
]
