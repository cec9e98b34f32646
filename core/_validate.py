"""The checks `MHAConfig` and the variants' entries (`core.variants`) run on one field each.

Each names the field (``MHAConfig.<name>``), the rule and the value given, so that every
refusal reads the same wherever the rule is stated.
"""

from __future__ import annotations

import math


def require_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; MHAConfig(d_model=True) is a typo, not a width.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"MHAConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"MHAConfig.{name} must be a positive int, got {value}")


def require_positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"MHAConfig.{name} must be a finite positive number, got {value!r}")
    return float(value)


def require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"MHAConfig.{name} must be a bool, got {value!r} ({type(value).__name__})")
