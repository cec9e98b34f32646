"""MLX's ops object: the score steps (`ops.score_steps`) in ``mlx.core``, functional and lazy.

MLX arrays are immutable (like JAX's): every step returns a new array, and nothing runs until
``mx.eval``. Half precision computes each step in float32 and rounds once, as
``mx.fast.scaled_dot_product_attention`` computes its softmax in float32 whatever the inputs.
float64 runs on the CPU, with ``exp`` float32-accurate (`frameworks.mlx.FLOAT64_LIMIT`). The steps
are differentiable by ``mx.vjp`` (the adapter's backward). MLX is imported when an ops object is
made, never at module import.
"""

from __future__ import annotations

import numpy as np

from .mlx import to_mlx
from .ops_upcast import UpcastSteps


def compute_dtype(dtype):
    """The dtype a step computes in: at least float32 (half precision computes in float32)."""
    import mlx.core as mx

    return dtype if dtype in (mx.float32, mx.float64) else mx.float32


class MlxOps(UpcastSteps):
    """MLX arrays: functional updates, evaluated lazily at ``mx.eval``.

    ``dtype`` is what `asarray` converts to (None: an ops object for the score steps only).
    """

    library = "mlx"
    works_in_place = False
    has_buffers = False  # MLX exposes no buffers: nothing to measure

    def __init__(self, dtype: str | None = None, device: str = "cpu") -> None:
        import mlx.core as mx

        self.mx = mx
        self.dtype_name, self.device_name = dtype, device

    # -- arrays ------------------------------------------------------------------------------
    def asarray(self, array: np.ndarray | None, cast: bool = True):
        return to_mlx(array, self.dtype_name if cast else None)

    def snapshot(self, x):
        return x  # immutable

    def synchronize(self, result) -> None:
        self.mx.eval(result)

    def full(self, shape, value: float, dtype, like=None):
        return self.mx.full(shape, value, dtype=dtype)

    def broadcast(self, array, shape, dtype):
        return self.mx.broadcast_to(array.astype(dtype), shape)

    # -- the primitives of `UpcastSteps` (head norm, temperature, gate, softcap, score bias) ----
    def _array_module(self):
        return self.mx

    def _rsqrt(self, x):
        return self.mx.rsqrt(x)

    def _sigmoid(self, x):
        return self.mx.sigmoid(x)

    def _compute_dtype(self, dtype):
        return compute_dtype(dtype)

    # -- the score steps (softcap and the score bias: `UpcastSteps`) -------------------------
    def positional_mask(self, scores, blocked):
        mx = self.mx
        return mx.where(blocked, mx.array(-np.inf, dtype=scores.dtype), scores)

    def softmax(self, scores, empty_rows=None, sinks=None, out=None):
        """Softmax over the last axis; a row with no allowed key gives zeros (the spec), found from the scores
        (``empty_rows`` is not needed; ``out`` unused: functional). ``sinks`` (broadcastable against the
        scores with a key axis of 1) sit in every denominator, the shift ``max(row max, sink)`` (`ops_jax`)."""
        mx = self.mx
        compute = compute_dtype(scores.dtype)
        logits = scores.astype(compute)
        row_max = mx.max(logits, axis=-1, keepdims=True)  # (..., 1)
        if sinks is not None:
            sink = sinks.astype(compute)
            shift = mx.maximum(row_max, sink)  # finite: the sink is
            exp = mx.exp(logits - shift)
            return (exp / (mx.exp(sink - shift) + mx.sum(exp, axis=-1, keepdims=True))).astype(scores.dtype)
        # An all -inf row (nothing allowed) would give -inf - (-inf) = NaN: shift it by 0, exp(-inf) = 0.
        row_max = mx.where(mx.isinf(row_max), mx.zeros_like(row_max), row_max)
        exp = mx.exp(logits - row_max)
        total = mx.sum(exp, axis=-1, keepdims=True)
        # A row with an allowed key has total >= 1 (exp(0) at its maximum); an empty one 0 / 1 = 0.
        return (exp / mx.maximum(total, 1)).astype(scores.dtype)
