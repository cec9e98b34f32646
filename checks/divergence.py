"""Where two implementations part ways: the first stage, in pipeline order, that differs.

Both sides give their stage tensors in the canonical layout of `core.stages` (the
oracle's `reference_stages`, an adapter's `Backend.canonical_stages`). Walking
`core.STAGES` in order and stopping at the first stage outside tolerance names the
step that went wrong: a wrong head split shows up at ``q_heads`` while ``q`` still
agrees; a forgotten scale at ``scores``; a transposed output weight at ``output``.
A stage that one side does not expose (a fused kernel hides its insides) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, STAGE_NAMES, compare


@dataclass(frozen=True)
class Divergence:
    """The first stage outside tolerance and how far apart the two sides are there."""

    stage: str
    max_abs: float
    max_rel: float
    detail: str  # the comparison summary, or a shape mismatch
    compared: tuple[str, ...]  # the stages both sides exposed, in pipeline order

    @property
    def step(self) -> str:
        """The pipeline step that produces the stage ("split heads" for q_heads)."""
        return STAGE_BY_NAME[self.stage].step

    def summary(self) -> str:
        return (
            f"first divergent stage {self.stage} ({self.step}): max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"
        )

    def as_dict(self) -> dict:
        return {
            "stage": self.stage,
            "step": self.step,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "detail": self.detail,
            "compared": list(self.compared),
        }


def shared_stages(a: dict, b: dict) -> tuple[str, ...]:
    """Stage names present on both sides, in pipeline order."""
    return tuple(name for name in STAGE_NAMES if name in a and name in b)


def first_divergence(
    a: dict, b: dict, dtype: str, atol: float | None = None, rtol: float | None = None
) -> Divergence | None:
    """The first stage where ``a`` and ``b`` differ beyond the tolerance of ``dtype``, or None.

    ``dtype`` is the lower precision of the two sides (see `core.lower_precision`).
    Returns None when every shared stage agrees (the difference, if any, lies in a
    stage one side does not expose).
    """
    compared = shared_stages(a, b)
    for name in compared:
        with np.errstate(invalid="ignore"):  # NaN on one side is a difference, not a warning
            result = compare(a[name], b[name], dtype, atol, rtol)
        if not result.ok:
            return Divergence(name, result.max_abs, result.max_rel, result.summary(), compared)
    return None
