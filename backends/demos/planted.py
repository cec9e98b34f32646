"""A planted backward-only bug, for the explainer's backward section: GQA that forgets to sum over the group.

Grouped-query attention written by repeating each kv head for its G query heads is correct in the forward,
but the backward must *sum* the G gradients that come back to a repeated head. `NoGroupSumBackend` (the
numpy adapter with `NoGroupSumVJP`) takes the first one instead: the forward check passes it and the
gradient check names it. Built directly, never registered.
"""

from __future__ import annotations

import numpy as np

from ..numpy import NumpyBackend
from ..numpy.common import NumpyPrecision
from ..numpy.layer import ColumnSampleMHA
from ..numpy.vjp import ColumnSampleVJP, prepare_numpy_vjp


class NoGroupSumVJP(ColumnSampleVJP):
    """The bug: a repeated kv head keeps the gradient of its group's first query head only."""

    @staticmethod
    def group_sum(d_heads: np.ndarray) -> np.ndarray:
        return d_heads[:, :, 0]  # should be d_heads.sum(axis=2)


class NoGroupSumBackend(NumpyBackend):
    """The numpy adapter (correct forward) with the GQA backward that forgets to sum over the group."""

    name = "numpy:gqa-no-sum"
    strategies = ("standard",)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        precision = NumpyPrecision.for_dtype(dtype)
        return prepare_numpy_vjp(
            ColumnSampleMHA, cfg, params, inputs, cotangent, precision, strategy, vjp_class=NoGroupSumVJP
        )
