"""Honest per-phase retrieval statistics (the reporting template of ``docs/statistics.md``).

Modules by job: ``targets`` (checked input, cluster resampling), ``intervals``, ``omnibus``
(tests of no phase effect), ``gap`` (the phase gap and comparisons of gaps), ``report``.

Input: one tidy row per evaluated **target** with columns

* ``correct``: bool or 0/1, whether the target was retrieved;
* ``phase``: int in ``[0, stride)``, the target's phase ``phi`` on the compression grid;
* ``depth``: float in ``[0, 1]``, relative position of the source in the context;
* ``seq_id``: the sequence the target came from. Targets of one sequence are correlated, so the
  sequence is the resampling **cluster**. ``seq_id`` need only be unique within a seed;
* ``seed`` (optional): the training seed of the model, a cluster level above sequences.

Other columns are ignored. Bad input raises ``ValueError`` before any work.

Names used throughout: ``d`` = ``stride``; ``k``, ``n`` = correct and total targets (per phase
unless said otherwise; in :func:`harmonics` ``k`` is the harmonic index); array axes ``target``
(N rows), ``cluster`` (C sequences, numbered so that each seed's sequences are contiguous),
``phase`` (d), ``replicate`` (B bootstrap or permutation draws), ``split`` (random halves).
Shape comments read ``(B, C)`` etc.

The keyword ``seed`` of the functions seeds the random number generator; the ``seed`` column
names training seeds. Every random draw comes from numpy generators seeded with ``seed``, so a
call is deterministic given ``seed`` (and :func:`phase_report` reproduces the standalone calls).

Which test to trust: the chi-square, logistic and harmonic tests treat targets as independent
Bernoulli trials. Under a design that draws each target's phase at random (independently of
its sequence) that is still a valid randomisation test of "no phase effect", but if all targets
of a sequence share one phase draw (one grid offset per sequence) those p-values are too small:
prefer the cluster bootstrap intervals then. The permutation test shuffles phase labels between
targets, so it carries the same assumption.
"""

from phasemech.measure.stats.gap import compare_gaps, design_guard, paired_phase_test, phase_gap
from phasemech.measure.stats.intervals import by_depth, newcombe_diff, per_phase, wilson_ci
from phasemech.measure.stats.omnibus import chi2_phase, harmonics, holm, logistic_phase_test
from phasemech.measure.stats.report import PhaseReport, phase_report

__all__ = [
    "PhaseReport",
    "by_depth",
    "chi2_phase",
    "compare_gaps",
    "design_guard",
    "harmonics",
    "holm",
    "logistic_phase_test",
    "newcombe_diff",
    "paired_phase_test",
    "per_phase",
    "phase_gap",
    "phase_report",
    "wilson_ci",
]
