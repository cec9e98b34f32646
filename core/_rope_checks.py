"""The checks every ``MHAConfig.rope_scaling`` key goes through: a number, a length (shared by `core.rope_scaling`
and `core.longrope`, so that each rule and its message are written once). NumPy-free, standard library only."""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard

NAME = "MHAConfig.rope_scaling"


def is_real(value: object) -> TypeGuard[numbers.Real]:
    """An int or float (NumPy's too), not a bool (``factor=True`` is a typo, not a number)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def number(key: str, value: object) -> float:
    """A finite float > 0, or an error naming ``key``."""
    if not is_real(value):
        raise TypeError(f"{NAME}[{key!r}] must be a finite number > 0, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{NAME}[{key!r}] must be a finite number > 0, got {out!r}")
    return out


def length(key: str, value: object) -> int:
    """A positive int (a context length), or an error naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{NAME}[{key!r}] must be a positive int (a length in tokens), got {value!r} ({type(value).__name__})"
        )
    if value <= 0:
        raise ValueError(f"{NAME}[{key!r}] must be a positive int (a length in tokens), got {value!r}")
    return int(value)
