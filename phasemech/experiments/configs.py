"""The experiments, by name: each is an :class:`~phasemech.experiments.experiment.Experiment`
(profiles, stages of jobs, a finish that writes its tables).

``phasemech run EXPERIMENT --profile P`` runs one of them
(:func:`phasemech.experiments.experiment.run_experiment` from Python); ``tiny`` is each
experiment's seconds-long smoke profile. The real-model studies (``audit``, ``explain``) also
take a config of their own through :func:`~phasemech.experiments.audit.study.run_audit` and
:func:`~phasemech.experiments.explain.run.run_explain` (``phasemech audit``, ``explain``).
"""

from __future__ import annotations

from phasemech.experiments.audit.study import AUDIT
from phasemech.experiments.experiment import Experiment
from phasemech.experiments.explain.run import EXPLAIN
from phasemech.experiments.fixes.study import FIXES_EXPERIMENT
from phasemech.experiments.head_attention.study import HEAD_ATTENTION
from phasemech.experiments.interventions.study import INTERVENTIONS
from phasemech.experiments.pretrained.study import PRETRAINED
from phasemech.experiments.showcase.study import FIGURES
from phasemech.experiments.sweep.study import PHASE_SWEEP
from phasemech.experiments.theory_trained.study import THEORY_TRAINED

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        PHASE_SWEEP,
        FIGURES,
        FIXES_EXPERIMENT,
        THEORY_TRAINED,
        PRETRAINED,
        INTERVENTIONS,
        HEAD_ATTENTION,
        AUDIT,
        EXPLAIN,
    )
}


def experiment(name: str) -> Experiment:
    """The experiment called ``name``; a one-line error names the ones that exist."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment {name!r} is unknown: allowed {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name]


__all__ = ["EXPERIMENTS", "experiment"]
