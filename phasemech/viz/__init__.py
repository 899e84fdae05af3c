"""Figures: every function takes tables computed elsewhere and returns a ``go.Figure`` (or, for
the dashboard, writes one HTML page); nothing here runs a model.

One template and one colour/dash/marker per design for every figure (``style``); figure families
by what they show: ``phase`` (accuracy and attention by phase), ``effects`` (intervention
effects), ``training`` (curves along training), ``theory`` (the theory model), ``dashboard``.
"""

from phasemech.viz.effects import effect_heatmap, specialization_scatter
from phasemech.viz.phase import (
    attention_pattern_phases,
    head_phase_heatmap,
    per_phase_accuracy,
    per_phase_polar,
)
from phasemech.viz.style import (
    COLUMN_WIDTH,
    DESIGN_COLORS,
    DESIGN_DASH,
    DESIGN_SYMBOL,
    EFFECT_SCALE,
    FLAT_COLOR,
    FONT,
    MARGIN,
    MEAN_DASH,
    OTHER_COLORS,
    PHASE_SCALE,
    UNCLUSTERED_COLOR,
    apply_template,
    design_of,
)
from phasemech.viz.theory import prediction_scatter, theory_curves, theory_plateau
from phasemech.viz.training import training_dynamics

__all__ = [
    "COLUMN_WIDTH",
    "DESIGN_COLORS",
    "DESIGN_DASH",
    "DESIGN_SYMBOL",
    "EFFECT_SCALE",
    "FLAT_COLOR",
    "FONT",
    "MARGIN",
    "MEAN_DASH",
    "OTHER_COLORS",
    "PHASE_SCALE",
    "UNCLUSTERED_COLOR",
    "apply_template",
    "attention_pattern_phases",
    "design_of",
    "effect_heatmap",
    "head_phase_heatmap",
    "per_phase_accuracy",
    "per_phase_polar",
    "prediction_scatter",
    "specialization_scatter",
    "theory_curves",
    "theory_plateau",
    "training_dynamics",
]
