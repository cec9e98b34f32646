"""JAX's ops object: the score steps (`ops.score_steps`) in jnp, functional, for `jax.jit` to fuse.

Every step is a pure function of its arguments (JAX arrays are immutable), so the same object
serves a whole batched pass, one head unbatched under `jax.vmap`, and a chunked tile inside
`lax.fori_loop`. Half precision computes each step in float32 and rounds the result back, as
the softmax does (as equinox and ``jax.nn.dot_product_attention`` do). JAX is imported inside
the functions, never at module import.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import numpy_dtype

from .jax import enable_float64_if_needed, jax_device
from .ops_upcast import UpcastSteps


def jax_target(dtype: str, device: str):
    """What every JAX adapter does first in `prepare`: float64 on where asked, then the device."""
    enable_float64_if_needed(dtype)
    return jax_device(device)


def to_jax(array: np.ndarray | None, dtype: str | None, device):
    """A NumPy array -> a JAX array of ``dtype`` (None: keep, e.g. bool masks) placed on ``device``.

    The cast happens in NumPy first (bfloat16 through ml_dtypes, rounding straight
    from float64), so every adapter rounds the canonical float64 data the same way.
    """
    if array is None:
        return None
    import jax

    if dtype is not None:
        array = np.asarray(array).astype(numpy_dtype(dtype))
    return jax.device_put(np.ascontiguousarray(array), device)


def compute_dtype(dtype):
    """The dtype a step computes in: at least float32 (half precision computes in float32)."""
    import jax.numpy as jnp

    return jnp.promote_types(dtype, jnp.float32)


def block_until_ready(result) -> None:
    import jax

    jax.block_until_ready(result)


class JaxOps(UpcastSteps):
    """JAX arrays: functional updates, traced once and compiled by `jax.jit`.

    ``dtype`` and ``device`` are what `asarray` converts to (None: an ops object for the score steps
    only, as a traced pass uses it); the score steps read neither.
    """

    library = "jax"
    works_in_place = False
    has_buffers = False  # XLA places the buffers; nothing to measure

    def __init__(self, dtype: str | None = None, device: str | None = None) -> None:
        self.dtype_name = dtype
        self.device = None if dtype is None else jax_target(dtype, device)

    # -- arrays and products (what the einops pipeline needs beside einops) ------------------
    def asarray(self, array: np.ndarray | None, cast: bool = True):
        return to_jax(array, self.dtype_name if cast else None, self.device)

    def einsum(self, pattern: str, a, b):
        import einops

        return einops.einsum(a, b, pattern)

    def scale(self, q, factor: float):
        return q * factor

    def add_bias(self, y, bias):
        return y + bias

    def rms_norm(self, x, weight, eps: float, pattern: str):
        import einops
        from jax import lax

        xs = x.astype(compute_dtype(x.dtype))
        mean_square = einops.reduce(xs * xs, pattern, "mean")
        return (xs * lax.rsqrt(mean_square + eps) * weight).astype(x.dtype)

    # -- the primitives of `UpcastSteps` (head norm, temperature, gate, softcap, score bias) ----
    def _array_module(self):
        import jax.numpy as jnp

        return jnp

    def _rsqrt(self, x):
        from jax import lax

        return lax.rsqrt(x)

    def _sigmoid(self, x):
        import jax

        return jax.nn.sigmoid(x)

    def _compute_dtype(self, dtype):
        return compute_dtype(dtype)

    def take(self, table, index):
        return table[index]

    def snapshot(self, x):
        return x  # JAX arrays are immutable

    synchronize = staticmethod(block_until_ready)

    def full(self, shape, value: float, dtype, like=None):
        import jax.numpy as jnp

        return jnp.full(shape, value, dtype)

    def broadcast(self, array, shape, dtype):
        import jax.numpy as jnp

        return jnp.full(shape, array, dtype)

    # -- the score steps (softcap and the score bias: `UpcastSteps`) -------------------------
    def positional_mask(self, scores, blocked):
        import jax.numpy as jnp

        return jnp.where(blocked, -jnp.inf, scores)

    def softmax(self, scores, empty_rows=None, sinks=None, out=None):
        """Softmax over the last axis; a row with no allowed key gives zeros (the spec), found from the scores
        themselves (so ``empty_rows`` is not needed); ``out`` unused (functional).

        ``sinks`` (broadcastable against the scores with a key axis of 1): ``a_j = exp(s_j) / (exp(sink) +
        sum_k exp(s_k))``. The shift is ``max(row max, sink)``, finite because the sink is, so a row with no
        allowed key gives exp(-inf) = 0 over exp(0) = 1: zeros, without a special case.
        """
        import jax.numpy as jnp

        compute = compute_dtype(scores.dtype)
        logits = scores.astype(compute)
        if sinks is not None:
            sink = sinks.astype(compute)
            shift = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)  # (..., 1)
            exp = jnp.exp(logits - shift)
            return (exp / (jnp.exp(sink - shift) + jnp.sum(exp, axis=-1, keepdims=True))).astype(scores.dtype)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        # A row of all -inf (nothing allowed) would give -inf - (-inf) = NaN; shifting it by 0
        # instead leaves exp(-inf) = 0 everywhere in that row.
        row_max = jnp.where(jnp.isneginf(row_max), 0, row_max)
        exp = jnp.exp(logits - row_max)
        total = jnp.sum(exp, axis=-1, keepdims=True)
        # A row with an allowed key holds exp(0) = 1 at its maximum, so total >= 1 and the
        # maximum changes nothing; an empty row has total 0 and exp 0, so it stays 0 / 1 = 0.
        return (exp / jnp.maximum(total, 1)).astype(scores.dtype)


# The ops object a traced pass uses (no conversions, so no dtype or device; stateless, so nothing for a program key).
TRACED_OPS = JaxOps()
