"""Input checks shared by the library: each raises a one-line ``ValueError`` that names the
function, the bad value and what is allowed, before any work starts."""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(x: Any) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def check_int(where: str, name: str, value: Any, low: int) -> int:
    """``value`` as an int, if it is an integer ``>= low``."""
    if not is_int(value) or value < low:
        raise ValueError(f"{where}: {name}={value!r} is invalid: must be an int >= {low}")
    return int(value)


__all__ = ["check_int", "is_int"]
