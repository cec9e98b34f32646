"""Backward passes with ``jax.vjp``: the forward and its pullback compiled together by ``jax.jit``.

``jax.vjp(forward, *primals)`` traces the forward and returns its pullback; calling the
pullback on the cotangent gives the gradient of every primal. Both happen inside one jitted
function, compiled ahead of time outside the timed region (like the forward), so the timed
region is one XLA program: the forward and the backward, nothing else. The three inputs are
three primals even when they are one array, so each slot gets its own gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..base import PreparedVJP, tensor_to_numpy
from .common import CompiledForward, block_until_ready, to_jax


def jax_vjp_prepared(
    forward: Callable,
    primals: tuple,
    extras: tuple,
    cotangent: np.ndarray,
    dtype: str,
    target,
    matmul_precision: str,
    to_canonical: Callable[[object], dict],
    info: dict,
    key: tuple | None = None,
) -> PreparedVJP:
    """``forward(params, x_q, x_k, x_v, *extras)`` differentiated with respect to its first four arguments.

    ``to_canonical(param_grads)`` maps the gradient of the first primal (the library's own
    parameter tree) to canonical arrays by name. ``key``: the forward's program key
    (`common.shared_program`); the step below closes over the forward only, so its key is
    ``("vjp", *key)``. None: compiled afresh.
    """
    import jax

    def step(primals, extras, cotangent):
        output, pullback = jax.vjp(lambda *p: forward(*p, *extras), *primals)
        return output, pullback(cotangent)

    step_key = None if key is None else ("vjp", *key)
    compiled = CompiledForward(step, (primals, extras, to_jax(cotangent, dtype, target)), matmul_precision, step_key)

    def to_grads(native) -> dict:
        _, (param_grads, d_x_q, d_x_k, d_x_v) = native
        slots = {"d_x_q": d_x_q, "d_x_k": d_x_k, "d_x_v": d_x_v}
        return {**{name: tensor_to_numpy(g) for name, g in slots.items()}, **to_canonical(param_grads)}

    info = {"backward": "jax.vjp, forward and pullback in one jax.jit program", **info}
    return PreparedVJP(compiled, to_grads, block_until_ready, compile=compiled.compile, info=info)


def canonical_param_grads(param_grads: dict) -> dict:
    """A gradient tree already keyed by canonical name (w_q ... b_o) -> NumPy, absent biases dropped."""
    return {name: tensor_to_numpy(g) for name, g in param_grads.items() if g is not None}
