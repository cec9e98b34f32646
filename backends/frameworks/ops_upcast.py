"""The steps JAX's and MLX's ops objects write alike: computed in at least float32, rounded back once.

Both libraries' arrays are immutable values, so a step is one expression: upcast (half precision
computes in float32, as their softmax does), compute, round back to the input's dtype. What differs
is only the spelling of four primitives, which each ops object gives (`ops_jax.JaxOps`,
`ops_mlx.MlxOps`): its array module (``mean``, ``tanh``), ``rsqrt``, ``sigmoid`` and the compute
dtype. Nothing is imported here: each library stays imported only where its ops object is used.
"""

from __future__ import annotations


class UpcastSteps:
    """Mixin: head norm, query temperature, output gate, softcap and score bias over the four primitives below."""

    def _array_module(self):
        """The library's array module (``jax.numpy``, ``mlx.core``): its ``mean`` and ``tanh``."""
        raise NotImplementedError

    def _rsqrt(self, x):
        raise NotImplementedError

    def _sigmoid(self, x):
        raise NotImplementedError

    def _compute_dtype(self, dtype):
        """The dtype a step computes in: at least float32."""
        raise NotImplementedError

    def _upcast(self, x):
        return x.astype(self._compute_dtype(x.dtype))

    def head_norm(self, x, eps: float, axis: int = -1):
        """A weightless RMS norm over ``axis`` (each head's features: Llama 4's after rotary, Gemma 4's values),
        ``x * rsqrt(mean(x**2) + eps)`` in at least float32, rounded back to ``x``'s dtype."""
        xs = self._upcast(x)
        return (xs * self._rsqrt(self._array_module().mean(xs * xs, axis=axis, keepdims=True) + eps)).astype(x.dtype)

    def temper_queries(self, q, factors):
        """Llama 4's temperature: ``q`` times its positions' factors (laid out against it), in at least float32."""
        return (self._upcast(q) * factors).astype(q.dtype)

    def output_gate(self, merged, logits):
        """The output gate (``attn_output_gate``): (gate, merged * gate) with gate = sigmoid(logits), laid out
        like ``merged``; the sigmoid in at least float32, rounded back to the logits' dtype."""
        gate = self._sigmoid(self._upcast(logits)).astype(logits.dtype)
        return gate, merged * gate

    # -- the score steps --------------------------------------------------------------------
    def softcap(self, scores, cap: float):
        """``cap * tanh(scores / cap)`` (`core.variants.softcap`), in at least float32, rounded once."""
        return (cap * self._array_module().tanh(self._upcast(scores) / cap)).astype(scores.dtype)

    def add_score_bias(self, scores, bias):
        """``scores + bias``: the bias (float32 or float64) added in at least float32, rounded once."""
        return (self._upcast(scores) + bias).astype(scores.dtype)
