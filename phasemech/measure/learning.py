"""Did a model learn the task? The rule that keeps models that never left the loss plateau out
of every gap, fix and average.

MQAR training sits on a loss plateau (no induction: held-out accuracy 0.20-0.22, near and far
alike) before it drops abruptly. A model still there retrieves nothing, so its flat phase
profile says nothing about phase: gaps are read only from models above :data:`PLATEAU_EXIT`.
"""

from __future__ import annotations

import pandas as pd

PLATEAU_EXIT = 0.30


def off_plateau(accuracy: float) -> bool:
    """Did a model leave the MQAR loss plateau (held-out accuracy >= :data:`PLATEAU_EXIT`)?"""
    return bool(accuracy >= PLATEAU_EXIT)


def seeds_off_plateau(
    results: pd.DataFrame, fix: str, threshold: float = PLATEAU_EXIT
) -> tuple[int, int]:
    """``(seeds at or above threshold, seeds)`` of ``fix``, from its per-seed rows of
    ``results`` (columns ``fix``, ``seed`` with ``"pooled"`` rows left out, ``accuracy``); the
    default threshold is the plateau's exit, a stricter one asks for convergence."""
    per = results[(results["fix"] == fix) & (results["seed"] != "pooled")]
    return int((per["accuracy"] >= threshold).sum()), len(per)


def all_off_plateau(results: pd.DataFrame, fix: str, threshold: float = PLATEAU_EXIT) -> bool:
    up, n = seeds_off_plateau(results, fix, threshold)
    return up == n


__all__ = ["PLATEAU_EXIT", "all_off_plateau", "off_plateau", "seeds_off_plateau"]
