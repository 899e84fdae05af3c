"""The explanation's text helpers, shared by its summary and its sections: layer spans,
per-phase numbers and JSON-ready records.

Axes: ``phase``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def layer_span(layers) -> str:
    """``"2-29"`` for a run of layers, else the list; ``"all"`` when none is named."""
    if not layers:
        return "all"
    xs = sorted(layers)
    if xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs))


def phases_text(xs) -> str:
    """``0.70 / 0.32 / ...``; a missing value as ``-``."""
    return " / ".join("-" if x is None else f"{x:.2f}" for x in xs)


def records(df: pd.DataFrame, cols: list[str]) -> list[dict[str, Any]]:
    """``df[cols]`` as JSON-ready rows (numpy scalars as Python, NaN as None)."""
    return [{k: num(v) for k, v in r.items()} for r in df[cols].to_dict("records")]


def num(v: Any) -> Any:
    """``v`` as a JSON-ready scalar (a numpy scalar as Python, NaN as None)."""
    if isinstance(v, np.generic):
        v = v.item()
    return None if isinstance(v, float) and np.isnan(v) else v


__all__ = ["layer_span", "num", "phases_text", "records"]
