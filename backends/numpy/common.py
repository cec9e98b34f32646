"""NumPy building blocks shared by the NumPy-array adapters: precision policy, masks, softmax.

NumPy has fast matrix products (BLAS) only for float32 and float64. float16 products
fall back to a plain C loop (about ten times slower than float32 BLAS here) and
bfloat16 (from ml_dtypes) has no BLAS at all. So half-precision runs follow the policy
that GPU tensor cores follow: every stage tensor is *stored* in the half type, while
each matrix product and the softmax are *computed* in float32 and rounded back to the
half type when the stage is done. `NumpyPrecision` states that policy once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import numpy_dtype

HALF_TYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class NumpyPrecision:
    """Storage dtype of the stage tensors and the dtype each operation computes in."""

    name: str  # the requested dtype name
    storage: np.dtype
    compute: np.dtype

    @classmethod
    def for_dtype(cls, name: str) -> NumpyPrecision:
        storage = numpy_dtype(name)
        compute = np.dtype(np.float32) if name in HALF_TYPES else storage
        return cls(name, storage, compute)

    @property
    def mixed(self) -> bool:
        """True when stages are stored in a half type but computed in float32."""
        return self.storage != self.compute

    def info(self) -> dict:
        """What a run records about its arithmetic (for `Prepared.info`)."""
        if not self.mixed:
            return {"storage_dtype": self.name, "compute_dtype": self.name}
        return {
            "storage_dtype": self.name,
            "compute_dtype": "float32",
            "rounding": f"each stage rounded to {self.name}; products and softmax computed in float32 "
            "(NumPy has no BLAS for half types)",
        }

    def round_to_storage(self, array: np.ndarray) -> np.ndarray:
        """A canonical float64 array rounded to the storage dtype (parameters, inputs)."""
        return np.ascontiguousarray(np.asarray(array).astype(self.storage))

    def operand(self, array: np.ndarray) -> np.ndarray:
        """A stored array as the compute dtype (a no-op unless mixed)."""
        return array.astype(self.compute) if self.mixed else array

    def store(self, array: np.ndarray) -> np.ndarray:
        """A computed array rounded to the storage dtype (a no-op unless mixed)."""
        return array.astype(self.storage) if self.mixed else array

    def matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``a @ b`` computed in the compute dtype, returned in the compute dtype.

        ``out`` is a reusable workspace in the compute dtype; it is used when the
        operands need no conversion (full precision), ignored otherwise.
        """
        if not self.mixed:
            return np.matmul(a, b, out=out)
        return np.matmul(self.operand(a), self.operand(b))


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


def apply_mask_inplace(scores: np.ndarray, mask: MaskArrays | None) -> np.ndarray:
    """Set blocked positions of ``scores`` to -inf, in place, and return it."""
    if mask is not None:
        np.copyto(scores, -np.inf, where=mask.blocked)
    return scores


def softmax_inplace(
    scores: np.ndarray, empty_rows: np.ndarray | None, axis: int = -1, sinks: np.ndarray | None = None
) -> np.ndarray:
    """Softmax over ``axis`` (the key axis), in place, with the spec's answer for empty rows.

    A query whose keys are all blocked (all -inf) gets all-zero weights. Such queries
    are known from the mask before the forward pass; their maximum is replaced by 0 (so
    the shift leaves them at -inf and exp gives exact zeros) and their total by 1 (so the
    division gives zeros, not 0/0). No NaN is produced on the way. Other queries pay
    nothing beyond the usual max-subtraction softmax: five passes over the scores.

    ``sinks`` (attention sinks, `core.variants.softmax_with_sinks`): each head's learned logit,
    broadcastable to the per-query maximum (``(1, H, 1, 1)`` for column-sample scores
    ``(B, H, Nk, Nq)``, a scalar for one head), in every denominator and nowhere else. The
    shift is the larger of the row's maximum and the sink, always finite, so an empty row
    needs no special case: its exps are all 0 and its total is the sink's own term.
    """
    peak = np.max(scores, axis=axis, keepdims=True)  # one per query
    if sinks is not None:
        np.maximum(peak, sinks, out=peak)  # finite: the sink always is
    elif empty_rows is not None:
        np.copyto(peak, 0.0, where=empty_rows)
    scores -= peak  # the largest logit becomes 0: exp cannot overflow
    np.exp(scores, out=scores)
    total = np.sum(scores, axis=axis, keepdims=True)  # one per query
    if sinks is not None:
        total += np.exp(sinks - peak)  # the sink's share of the row: in the denominator only
    elif empty_rows is not None:
        np.copyto(total, 1.0, where=empty_rows)
    # One reciprocal per query, then a multiply per element (cheaper than a divide).
    scores *= np.reciprocal(total, out=total)
    return scores


def softcap_inplace(scores: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(scores / cap)`` (`core.variants.softcap`), in place, and return it."""
    scores /= cap
    np.tanh(scores, out=scores)
    scores *= cap
    return scores


# The softmax makes five passes over the scores. Walking them in blocks that stay in a
# core's L2 cache (1 MiB on the machines this project was measured on) turns four of
# those passes into cache hits (measured: docs/notes/backends-measurements.md). Small score tensors go in one block, so the Python
# loop costs nothing where the tensor is tiny.
SOFTMAX_BLOCK_BYTES = 1 << 20


def softmax_blocks_inplace(
    scores: np.ndarray,
    mask: MaskArrays | None,
    block_bytes: int = SOFTMAX_BLOCK_BYTES,
    *,
    softcap: float | None = None,
    bias: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Softcap, score bias, mask and softmax ``(B, H, ...)`` scores over ``mask.keys_axis`` (-2 without a
    mask means keys on axis -2), one (batch item) or one (batch item, head) at a time.

    The same numbers as `softcap_inplace`, adding ``bias`` ``(1|B, 1|H, ...)``, `apply_mask_inplace`
    then `softmax_inplace` (with ``sinks`` ``(1|B, 1|H, 1, 1)``) on the whole tensor, in the pipeline
    order of `core.variants`; each step is skipped when its argument is None.
    """
    B, H = scores.shape[:2]
    axis = -2 if mask is None else mask.keys_axis
    if scores.nbytes <= block_bytes:
        blocks = [(slice(None), slice(None))]
    elif H * scores[0, 0].nbytes <= block_bytes:
        blocks = [(b, slice(None)) for b in range(B)]
    else:
        blocks = [(b, h) for b in range(B) for h in range(H)]

    def pick(array, b, h):  # the block of a (1|B, 1|H, ...) array matching scores[b, h] (its axes may be 1)
        return array[
            b if isinstance(b, slice) or array.shape[0] > 1 else 0,
            h if isinstance(h, slice) or array.shape[1] > 1 else 0,
        ]

    for b, h in blocks:
        block = scores[b, h]
        if softcap is not None:
            softcap_inplace(block, softcap)
        if bias is not None:
            block += pick(bias, b, h)
        sink = None if sinks is None else pick(sinks, b, h)
        if mask is None:
            softmax_inplace(block, None, axis=axis, sinks=sink)
            continue
        np.copyto(block, -np.inf, where=pick(mask.blocked, b, h))
        softmax_inplace(block, None if mask.empty_rows is None else pick(mask.empty_rows, b, h), axis=axis, sinks=sink)
    return scores
