"""NumPy's ops object: the score steps (`ops.score_steps`) with NumPy's own primitives, in place.

NumPy has fast matrix products (BLAS) only for float32 and float64. float16 products
fall back to a plain C loop (about ten times slower than float32 BLAS here) and
bfloat16 (from ml_dtypes) has no BLAS at all. So half-precision runs follow the policy
that GPU tensor cores follow: every stage tensor is *stored* in the half type, while
each matrix product and the softmax are *computed* in float32 and rounded back to the
half type when the stage is done. `NumpyPrecision` states that policy once; every step of
`NumpyOps` follows it (compute dtype in, rounded to storage out; in place at full precision).

The NumPy adapters' measured tricks are this object's implementation: the softmax in place
(five passes, no temporary, `softmax_inplace`) and, outside a recording, every score step
walked one L2-sized block at a time (`NumpyOps.in_blocks`). The key axis is the
convention's: -1 for row samples (einops), -2 for column samples (the numpy adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import numpy_dtype
from mha_rosetta.core.variants.gate import sigmoid

HALF_TYPES = ("float16", "bfloat16")
# For two operands NumPy has a single contraction path; giving it explicitly makes
# np.einsum take its batched-matmul route without searching for a path on every call.
TWO_OPERAND_PATH = ("einsum_path", (0, 1))


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


# The softmax makes five passes over the scores. Walking them in blocks that stay in a
# core's L2 cache (1 MiB on the machines this project was measured on) turns four of
# those passes into cache hits (measured: docs/notes/backends-measurements.md). Small score tensors go in one block, so the Python
# loop costs nothing where the tensor is tiny.
SOFTMAX_BLOCK_BYTES = 1 << 20


def _block_indices(scores: np.ndarray, block_bytes: int) -> list[tuple]:
    """The (axis 0, axis 1) indices of ``scores``' blocks: the whole, one item at a time, or one (item, head)."""
    B, H = scores.shape[:2]
    if scores.nbytes <= block_bytes:
        return [(slice(None), slice(None))]
    if H * scores[0, 0].nbytes <= block_bytes:
        return [(b, slice(None)) for b in range(B)]
    return [(b, h) for b in range(B) for h in range(H)]


def _pick(array, index: tuple):
    """The block of a (1|B, 1|H, ...) array (broadcastable against the scores) that matches ``scores[index]``."""
    if array is None:
        return None
    b, h = index
    return array[
        b if isinstance(b, slice) or array.shape[0] > 1 else 0,
        h if isinstance(h, slice) or array.shape[1] > 1 else 0,
    ]


class NumpyOps:
    """NumPy arrays: in-place updates, np.einsum with an explicit path, the NumPy adapters' precision policy.

    Half types are stored as such and computed in float32 (`NumpyPrecision`): ml_dtypes'
    bfloat16 has no einsum loops and float16 has no BLAS. ``keys_axis``: where the scores keep
    their keys (-1 row samples, -2 column samples). ``block_bytes``: `in_blocks`' block size.
    """

    library = "numpy"
    works_in_place = True
    has_buffers = True  # view or copy is measurable (np.shares_memory)

    def __init__(
        self, dtype: str = "float64", device: str = "cpu", *, keys_axis: int = -1, block_bytes=SOFTMAX_BLOCK_BYTES
    ) -> None:
        if keys_axis not in (-1, -2):
            raise ValueError(f"keys_axis must be -1 (row samples) or -2 (column samples), got {keys_axis}")
        self.precision = NumpyPrecision.for_dtype(dtype)
        self.keys_axis, self.block_bytes = keys_axis, block_bytes

    # -- arrays and products (what the einops pipeline needs beside einops) ------------------
    def asarray(self, array: np.ndarray | None, cast: bool = True):
        if array is None:
            return None
        return self.precision.round_to_storage(array) if cast else np.ascontiguousarray(array)

    def einsum(self, pattern: str, a, b):
        P = self.precision
        subscripts = pattern.replace(" ", "")  # single-letter names: "b n d, e d -> b n e" -> "bnd,ed->bne"
        result = np.einsum(subscripts, P.operand(a), P.operand(b), optimize=list(TWO_OPERAND_PATH))
        return P.store(result)

    def add_bias(self, y, bias):
        y += bias  # in place: the product is ours to change
        return y

    def scale(self, q, factor: float):
        return q * np.asarray(factor, dtype=q.dtype)  # a new array: q itself is a stage tensor

    def rms_norm(self, x, weight, eps: float, pattern: str):
        """``x * (mean of squares over ``pattern``'s reduced axes + eps)**-1/2 * weight`` (a new array)."""
        import einops

        P = self.precision
        xs = P.operand(x)
        mean_square = einops.reduce(xs * xs, pattern, "mean")
        return P.store(xs / np.sqrt(mean_square + eps) * P.operand(weight))

    def head_norm(self, x, eps: float, axis: int = -1):
        """A weightless RMS norm over ``axis`` (each head's features: Llama 4's after rotary, Gemma 4's values),
        ``x / sqrt(mean(x**2) + eps)`` in the compute dtype, rounded to storage (a new array)."""
        P = self.precision
        xs = P.operand(x)
        return P.store(xs / np.sqrt(np.mean(xs * xs, axis=axis, keepdims=True) + eps))

    def temper_queries(self, q, factors):
        """Llama 4's temperature: ``q`` times its positions' factors (laid out against it), rounded to storage."""
        P = self.precision
        return P.store(P.operand(q) * factors)

    def output_gate(self, merged, logits):
        """The output gate (``attn_output_gate``): (gate, merged * gate) with gate = sigmoid(logits), laid out like
        ``merged``; the sigmoid without overflow (`core.variants.gate.sigmoid`), in the compute dtype, each result
        rounded to storage."""
        P = self.precision
        gate = P.store(sigmoid(P.operand(logits)))
        return gate, P.store(P.operand(merged) * P.operand(gate))

    def take(self, table, index):
        return table[index]

    def snapshot(self, x):
        return x.copy()

    def synchronize(self, result) -> None:
        return None

    def full(self, shape, value: float, dtype, like=None):
        return np.full(shape, value, dtype=dtype)

    def broadcast(self, array, shape, dtype):
        return np.broadcast_to(array, shape).astype(dtype)  # a copy, updated in place later

    # -- the score steps: compute dtype in, storage out; in place at full precision ----------
    def softcap(self, scores, cap: float):
        """``cap * tanh(scores / cap)`` (`core.variants.softcap`), in place: the spec's formula makes two new arrays
        per call, and per 1 MiB block that is page faults (B=4, H=8, N=512 float32, one block per head: 32.7 ms
        through `core.variants.softcap` and a copy back, 4.8 ms in place; this machine, 2026-12-05)."""
        P = self.precision
        capped = P.operand(scores)
        capped /= cap
        np.tanh(capped, out=capped)
        capped *= cap
        return P.store(capped)

    def add_score_bias(self, scores, bias):
        """``scores + bias``, the bias in the compute dtype, added at full precision and rounded once.

        In place on a C-contiguous buffer (the numpy adapter's); a strided one (np.einsum's output) is added
        into a new array, which NumPy lays out contiguous: the softmax after it then reads rows in memory order.
        """
        P = self.precision
        biased = P.operand(scores)
        if not biased.flags.c_contiguous:
            return P.store(biased + bias)
        biased += bias
        return P.store(biased)

    def positional_mask(self, scores, blocked):
        np.copyto(scores, -np.inf, where=blocked)  # in place
        return scores

    def softmax(self, scores, empty_rows, sinks=None, out=None):
        """`softmax_inplace` over ``keys_axis`` with the sinks (broadcastable to the per-query maximum); in place
        at full precision. ``out`` is unused (the scores' own buffer is the output)."""
        P = self.precision
        sinks = None if sinks is None else P.operand(sinks)
        return P.store(softmax_inplace(P.operand(scores), empty_rows, axis=self.keys_axis, sinks=sinks))

    def in_blocks(self, steps, scores, **parts):
        """``steps(block, **parts' blocks)`` over blocks of ``scores`` (axis 0 the batch, axis 1 the heads or the kv
        heads; ``parts`` broadcastable against them) that fit ``block_bytes``, in place; the whole at once where a
        block would not be in place (half precision) or there is no head axis to walk (one head's scores)."""
        if self.precision.mixed or scores.ndim < 4:
            return steps(scores, **parts)
        for index in _block_indices(scores, self.block_bytes):
            block = scores[index]  # a view
            result = steps(block, **{name: _pick(part, index) for name, part in parts.items()})
            if result is not block:
                block[...] = result
        return scores

    # -- the backward of the steps (`ops.score_steps_backward`): compute dtype in, storage out ----
    def softmax_backward(self, weights, d_weights, sinks: bool):
        """(d_scores, d_sink per query or None) of the softmax over ``keys_axis``: ``A * (dA - sum_keys dA * A)``,
        and the sink's ``-(1 - sum_keys A) * sum_keys dA * A`` (its weight times its cotangent, 0 - row_dot)."""
        P = self.precision
        w, d = P.operand(weights), P.operand(d_weights)
        row_dot = np.sum(d * w, axis=self.keys_axis, keepdims=True)  # one per query
        d_scores = P.store(w * (d - row_dot))
        d_sinks = -(1.0 - w.sum(axis=self.keys_axis, keepdims=True)) * row_dot if sinks else None
        return d_scores, d_sinks

    def softcap_backward(self, d_capped, scores, cap: float):
        """``d_capped * (1 - tanh(scores / cap)**2)``, ``scores`` the softcap's input."""
        P = self.precision
        return P.store(P.operand(d_capped) * (1.0 - np.tanh(P.operand(scores) / cap) ** 2))
