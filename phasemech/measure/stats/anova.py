"""A parametric test of "no phase effect" on paired per-target effects: the blocked (two-way,
no interaction) ANOVA F for phase, many units at once.

Axes: ``unit`` (rows tested together: they share one design), ``target``, ``phase``,
``block`` (the strata that absorb content: ``(group_id, target)`` blocks or depth bins).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int
from scipy import stats as sps

#: relative size of a residual below which it counts as zero (the fit is exact)
_EXACT_RTOL = 1e-12


def _residual_ss(
    x: Float[np.ndarray, "target col"], y: Float[np.ndarray, "target unit"]
) -> tuple[Float[np.ndarray, "unit"], int]:
    """Per column of ``y``, the residual sum of squares after least squares on ``x``, and the
    rank of ``x``."""
    beta, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    res = y - x @ beta
    return (res**2).sum(0), int(rank)


def blocked_phase_anova(
    effects: Float[np.ndarray, "unit target"],
    phase: Int[np.ndarray, "target"],
    block: Int[np.ndarray, "target"],
    stride: int,
) -> tuple[Float[np.ndarray, "unit"], Float[np.ndarray, "unit"], tuple[int, int]]:
    """``(F, p, (df_phase, df_resid))`` per unit: the model ``effect = block + phase + error``
    against ``effect = block + error`` (sequential sums of squares, exact on unbalanced
    designs). A unit whose effects the two models fit exactly gets ``F = 0, p = 1`` when
    phase explains nothing and ``F = inf, p = 0`` when it explains everything; a design with
    no residual degree of freedom gives NaN."""
    n = len(phase)
    eff = np.asarray(effects, dtype=np.float64)
    blocks = np.zeros((n, int(block.max()) + 1))
    blocks[np.arange(n), block] = 1.0
    phases = np.zeros((n, stride))
    phases[np.arange(n), phase] = 1.0
    rss0, r0 = _residual_ss(blocks, eff.T)
    rss1, r1 = _residual_ss(np.hstack([blocks, phases]), eff.T)
    df1, df2 = r1 - r0, n - r1
    if df1 < 1 or df2 < 1:
        nan = np.full(len(eff), np.nan)
        return nan, nan, (df1, df2)
    scale = np.maximum(((eff - eff.mean(1, keepdims=True)) ** 2).sum(1), 1e-300)
    between = np.maximum(rss0 - rss1, 0.0)
    exact = rss1 <= _EXACT_RTOL * scale
    no_phase = between <= _EXACT_RTOL * scale
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where(exact, np.inf, (between / df1) / (rss1 / df2))
    f = np.where(no_phase, 0.0, f)
    return f, sps.f.sf(f, df1, df2), (df1, df2)


__all__ = ["blocked_phase_anova"]
