"""The idealized retrieval model (``docs/theory.md``), the module it is imported from: the model
and its gradient flow live in :mod:`phasemech.theory.gradient_flow`, the re-derivation of its
predictions in :mod:`phasemech.theory.derivations`; every name of both is importable here.

Axes: ``head`` (H), ``slot`` (d, the local position in a window), ``phase`` (d, the target's
absolute phase), ``draw`` (offset draws for random offsets), ``step``.
"""

from __future__ import annotations

from phasemech.theory.derivations import (
    THEORY_MD,
    predictions,
    predictions_text,
)

# not in ``__all__`` (helpers of the text and of the claims report): `X as X` keeps them here
from phasemech.theory.derivations import fmt_num as fmt_num
from phasemech.theory.derivations import fmt_time as fmt_time
from phasemech.theory.gradient_flow import (
    TheoryConfig,
    Trajectory,
    accuracy,
    critical_beta_over_d,
    flow,
    g,
    g_prime,
    g_second,
    head_ablation,
    loss,
    margins,
    simulate,
    softmax,
    uniform_eigenvalue,
)

__all__ = [
    "THEORY_MD",
    "TheoryConfig",
    "Trajectory",
    "accuracy",
    "critical_beta_over_d",
    "flow",
    "g",
    "g_prime",
    "g_second",
    "head_ablation",
    "loss",
    "margins",
    "predictions",
    "predictions_text",
    "simulate",
    "softmax",
    "uniform_eigenvalue",
]
