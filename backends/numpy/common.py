"""NumPy building blocks shared by the NumPy-array adapters: the precision policy and the mask.

The precision policy (`NumpyPrecision`: half types stored, computed in float32) and the score
steps (in place, in L2-sized blocks) are NumPy's ops object's (`frameworks.ops_numpy`); this
module holds the mask as the column-sample adapter prepares it once (`MaskArrays`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Re-exported: the adapters, the explainer and the tests import the precision policy (and the in-place
# softmax) from here.
from ..frameworks.ops_numpy import HALF_TYPES, NumpyPrecision, softmax_inplace  # noqa: F401


@dataclass(frozen=True)
class MaskArrays:
    """A mask prepared once for in-place use: what to block, and which query rows are empty.

    ``keys_axis`` says where the score matrices keep their keys: -1 for ``(..., Nq, Nk)``
    (row samples) or -2 for ``(..., Nk, Nq)`` (column samples: one column per query).
    ``blocked`` has the caller's broadcastable shape, ``(1|B, 1|H)`` plus the two token
    axes in that order; ``empty_rows`` is the same with the key axis of length 1, or None
    when every query may attend to at least one key (the usual case, which then costs
    nothing).
    """

    blocked: np.ndarray
    empty_rows: np.ndarray | None
    keys_axis: int

    @classmethod
    def from_allowed(cls, allowed: np.ndarray | None, keys_axis: int = -1) -> MaskArrays | None:
        if allowed is None:
            return None
        if keys_axis not in (-1, -2):
            raise ValueError(f"keys_axis must be -1 or -2, got {keys_axis}")
        if keys_axis == -2:
            allowed = allowed.swapaxes(-1, -2)  # (1|B, 1|H, Nk, Nq)
        empty = ~allowed.any(axis=keys_axis, keepdims=True)  # key axis of length 1
        return cls(blocked=~allowed, empty_rows=empty if empty.any() else None, keys_axis=keys_axis)

    def for_head(self, head: int) -> MaskArrays:
        """The mask of one query head, without the head axis, for loops over heads."""

        def pick(array):
            return array[:, 0] if array.shape[1] == 1 else array[:, head]

        return MaskArrays(
            pick(self.blocked), None if self.empty_rows is None else pick(self.empty_rows), self.keys_axis
        )
