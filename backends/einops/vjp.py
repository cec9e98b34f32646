"""The einops adapters' backward: the array library's own autodiff through the adapter's own forward call.

torch arrays: ``torch.autograd.grad``; JAX arrays: ``jax.vjp``, jitted. The forward is the very
call the adapter's `Prepared` makes (`run_pipeline` on its converted arguments: weights, inputs,
masks and rotary tables), differentiated with respect to the weights and the three inputs. The
weights enter the pipeline with their head axes split out by einops (`canonical_weights`), so
their gradients come back in that layout and go home through `gradients_to_canonical`.

einops on NumPy arrays has no backward: NumPy has no automatic differentiation, and a
hand-written one would be the numpy adapter's column-sample backward again (the point of
the einops adapters is that the framework does the axis bookkeeping, so writing the
adjoint of every einsum by hand here would defeat it). It says so instead of running.
"""

from __future__ import annotations

from functools import partial

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._grad_layout import gradients_to_canonical
from .._mla import MLA_STRATEGIES
from ..base import UnsupportedCase
from ..frameworks.ops import OPS_BY_LIBRARY
from .layer import canonical_weights
from .mla import mla_weights
from .plans import plan_for

NUMPY_REASON = (
    "einops-numpy has no backward: NumPy has no autodiff, and a hand-written backward is the numpy adapter's "
    "(column samples); einops-torch and einops-jax differentiate this same einsum pipeline"
)


def prepare_einops_vjp(
    backend, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, cotangent, dtype, device, strategy: str
):
    if backend.array_library == "numpy":
        raise UnsupportedCase(NUMPY_REASON)
    prepared = backend._prepare(cfg, params, inputs, dtype, device, strategy)
    call = prepared.forward  # jax: a CompiledForward (.fn, .args); torch: a function with .pipeline
    forward, args = (call.fn, call.args) if backend.array_library == "jax" else call.pipeline
    key = (
        call.key if backend.array_library == "jax" else None
    )  # the forward's program key (`jax.common.shared_program`)
    weights, extras = args[0], args[4:]  # extras: masks and rotary tables, not differentiated
    ops = OPS_BY_LIBRARY[backend.array_library](dtype, device)
    x_q, x_k, x_v = (ops.asarray(x) for x in (inputs.query, inputs.key, inputs.value))  # three separate slots
    # How the pass holds the weights (head axes named): MLA's forms theirs (`mla.mla_weights`).
    to_native = (
        partial(mla_weights, cfg) if strategy in MLA_STRATEGIES else partial(canonical_weights, cfg, plan=plan_for(cfg))
    )
    info = {"array_library": backend.array_library, **prepared.info}

    def to_canonical(native_grads) -> dict:
        return gradients_to_canonical(cfg, to_native, native_grads)

    if backend.array_library == "jax":
        from ..jax.vjp import jax_vjp_prepared

        primals = (weights, x_q, x_k, x_v)
        precision = backend.matmul_precision
        return jax_vjp_prepared(
            forward, primals, extras, cotangent, dtype, ops.device, precision, to_canonical, info, key
        )
    from ..torch.vjp import autograd_prepared, leaf

    weights = {name: leaf(w) for name, w in weights.items()}
    x_q, x_k, x_v = leaf(x_q), leaf(x_k), leaf(x_v)
    leaves = {"d_x_q": x_q, "d_x_k": x_k, "d_x_v": x_v, **{f"native/{n}": w for n, w in weights.items()}}

    def to_canonical_torch(grads: dict) -> dict:
        native = {name.split("/", 1)[1]: grads.pop(name) for name in list(grads) if name.startswith("native/")}
        return {**grads, **to_canonical(native)}

    allow_tf32 = backend.matmul_precision != "highest"

    def run():
        return forward(weights, x_q, x_k, x_v, *extras)

    return autograd_prepared(run, leaves, ops.asarray(cotangent), to_canonical_torch, device, allow_tf32, info)
