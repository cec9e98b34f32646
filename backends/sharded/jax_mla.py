"""`jax-sharded`'s multi-head latent attention (MLA, issue 45): the jax adapter's two forms in a `jax.shard_map`.

Tensor parallelism over heads as Megatron and vLLM shard DeepSeek's MLA (`core.sharding`), on the mesh of
`sharded.jax` (axis ``"heads"``): the weights are placed with ``NamedSharding``, each device holding its heads'
rows of ``w_q`` (``q_b_proj`` or ``q_proj``: ``P("heads", None)``), of ``w_k`` and ``w_v`` (``kv_b_proj``'s
``k_nope`` and ``v`` rows), and its columns of ``w_o`` (``P(None, "heads")``): the blocks `core.shard_params` cuts.
The down projections ``w_q_a``, ``w_kv_a``, their biases and RMSNorm weights are replicated (``P()``,
`core.sharding.LATENT_PARAMS`), so every device computes the whole latent ``[c | k_rope]``. Inside the
``shard_map`` each device runs the jax adapter's own MLA pass (`jax.mla`: one head unbatched, vmapped over its
local heads and the batch) with no ``b_o``: ``naive`` expands its heads' keys and values, ``absorbed`` folds its
heads' ``W_UK_h`` into their queries and ``W_O_h W_UV_h`` into its columns of the output. One ``lax.psum`` over
``"heads"`` sums the partial outputs, and ``b_o`` is added once. The masks ``(B, H, Nq, Nk)`` are split by head
with the heads (``P(None, "heads")``).

Decoding (``build_decode``): the jax adapter's static latent cache ``(B, T, R + dr)``, **replicated** (``P()``):
every device holds the whole latent (it has no head axis to split), ``kv_lora_rank + d_rope`` numbers a token per
device. Each chunk is one jitted ``shard_map`` of `jax.mla.latent_step` (write the chunk's rows at a traced index,
attend) with the cache donated, then one psum of the partial outputs.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, allowed_positions, numpy_dtype, shard_plan
from mha_rosetta.core.decode import DecodeInputs
from mha_rosetta.core.sharding import LATENT_PARAMS
from mha_rosetta.core.variants.mla_heads import check_one_input

HOW = "shard_map: each device its heads' rows of w_q, w_k, w_v and columns of w_o, the latent's weights replicated; "


def _placed(cfg: MHAConfig, params: MHAParams, dtype: str, world: int, forward):
    """The mesh, ``put(array, spec)``, the weights placed and their specs, ``b_o`` replicated, the mask spec and
    the body's ``finish`` (the psum of the partial outputs, + b_o). ``forward``: `sharded.jax`'s mesh and axis."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..jax.common import enable_float64_if_needed

    enable_float64_if_needed(dtype)
    axis, mesh = forward.mesh_axis, forward.mesh_of(world)
    cast = numpy_dtype(dtype)

    def put(array, spec):
        """``array`` placed on the mesh by ``spec``, floats in the case's dtype (masks keep theirs); None stays None."""
        if array is not None:
            array = np.asarray(array)
            array = np.ascontiguousarray(array.astype(cast) if array.dtype.kind == "f" else array)
            array = jax.device_put(array, NamedSharding(mesh, spec))
        return array

    by_head = {"w_q": P(axis, None), "w_k": P(axis, None), "w_v": P(axis, None), "w_o": P(None, axis)}
    specs = {**by_head, **dict.fromkeys(LATENT_PARAMS, P())}  # the latent's weights: replicated
    weights = {name: put(value, specs[name]) for name, value in params.as_dict().items() if name in specs}
    weight_specs = {name: specs[name] for name in weights}

    def finish(partial_output, b_o):
        output = jax.lax.psum(partial_output, axis)  # the all-reduce of the partial outputs (B, N, D)
        return output if b_o is None else output + b_o

    return mesh, put, weights, weight_specs, put(params.b_o, P()), P(None, axis), finish


def build_forward(cfg: MHAConfig, params: MHAParams, inputs, dtype: str, strategy: str, world: int, *, forward):
    """MLA's ``strategy`` on ``world`` devices, compiled (in the worker process): what `sharded.jax`'s worker keeps
    of a case (the executable, its arguments, the info, the stages: the output only, as the jax adapter's forms)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from ..jax.common import numpy_rotary_tables, shared_program
    from ..jax.mla import _forward, _masks

    check_one_input(inputs.key, inputs.value)
    plan = shard_plan(cfg, world)
    mesh, put, weights, weight_specs, b_o, mask_spec, finish = _placed(cfg, params, dtype, world, forward)
    local_pass = _forward(plan.local_cfg, strategy)  # the jax adapter's MLA pass, on a device's heads
    B, Nq, Nk = inputs.query.shape[0], inputs.query.shape[1], inputs.key.shape[1]
    blocked, empty = _masks(cfg, allowed_positions(cfg, inputs), B, Nq, Nk)  # (B, H, Nq, Nk): split by head below
    tables = tuple(put(table, P()) for table in numpy_rotary_tables(cfg, inputs))  # (1|B, N, dr/2): replicated
    tables += (None,)  # the temperature's factors: none (the sharded adapters refuse it, `_mla.QUERY_STEPS`)

    def body(weights, b_o, x_q, x_k, tables, blocked, empty):
        return finish(local_pass(weights, x_q, x_k, x_k, tables, blocked, empty), b_o)  # its heads, no b_o; psum

    in_specs = (weight_specs, P(), P(), P(), P(), mask_spec, mask_spec)
    program = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P())
    key = ("jax-sharded.mla", strategy, cfg, world)  # what the body closes over: the local config, the mesh
    _, jitted = shared_program(key, program)
    args = (weights, b_o, put(inputs.query, P()), put(inputs.key, P()), tables, put(blocked, mask_spec),
            put(empty, mask_spec))  # fmt: skip
    compiled, info = forward.compile_on_mesh(
        jitted, args, key, plan,
        how=HOW + f"the jax adapter's {strategy} form on the local heads, lax.psum of the partial outputs, + b_o",
        collectives="one psum of the partial outputs (the latent is computed on every device: none for it)",
    )  # fmt: skip

    def stages():  # the forms' inner arrays are not recorded (as in the jax adapter): the output only
        return {"output": np.asarray(compiled(*args))}, "the devices' partial outputs, psum'd"

    return {"compiled": compiled, "args": args, "info": info, "stages": stages}


def build_decode(cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, strategy: str, world: int, *,
                 forward):  # fmt: skip
    """One decode run of MLA's ``strategy`` on ``world`` devices (in the worker process): the replicated latent cache,
    one jitted shard_map step per chunk, the cache donated from one to the next. Answers as
    `jax_decode.build_decode` does, and ``cache``: each device's copy of the last run's cache, NumPy."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..jax.common import shared_program
    from ..jax.mla import decode_chunk_arrays, latent_step
    from .common import replicated_latent_cache

    plan = shard_plan(cfg, world)
    mesh, put, weights, weight_specs, b_o, mask_spec, finish = _placed(cfg, params, dtype, world, forward)
    B, N, _ = inputs.x.shape
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    step_of_local = partial(latent_step, plan.local_cfg, strategy)  # the jax adapter's step, on a device's heads

    def step_body(weights, b_o, cache, x, start, tables, blocked, empty):
        cache, partial_output = step_of_local(weights, cache, x, start, tables, blocked, empty)
        return cache, finish(partial_output, b_o)  # the cache the same on every device; one psum

    in_specs = (weight_specs, P(), P(), P(), P(), P(), mask_spec, mask_spec)
    program = jax.shard_map(step_body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()))
    _, step = shared_program(("jax-sharded.mla.decode", strategy, cfg, world), program, donate_argnums=(2,))
    chunks = [
        (put(x, P()), jax.device_put(start, NamedSharding(mesh, P())), tuple(put(t, P()) for t in tables),
         put(blocked, mask_spec), put(empty, mask_spec))
        for x, start, tables, blocked, empty in decode_chunk_arrays(cfg, inputs, dtype)
    ]  # fmt: skip
    state: dict = {}

    def run() -> dict:
        cache, outputs = put(np.zeros((B, N, rows)), P()), []  # (B, T, R + dr): the whole latent on every device
        with jax.default_matmul_precision("highest"):
            for x, start, tables, blocked, empty in chunks:
                cache, output = step(weights, b_o, cache, x, start, tables, blocked, empty)
                outputs.append(output)
        jax.block_until_ready(outputs)
        state.update(outputs=outputs, cache=cache)
        return {}

    def fetch() -> np.ndarray:
        return np.concatenate([np.asarray(output) for output in state["outputs"]], axis=1)  # (B, N, D)

    def stages() -> list:
        """Per chunk: no head stage (the forms record none) and the psum'd output."""
        run()
        return [({}, np.asarray(output)) for output in state["outputs"]]

    def caches() -> list[np.ndarray]:
        """Each device's copy of the cache, in mesh order: the replicated latent."""
        shards = sorted(state["cache"].addressable_shards, key=lambda shard: mesh.devices.tolist().index(shard.device))
        return [np.asarray(shard.data) for shard in shards]

    layout = "(B, T, R + dr) per device: [c | k_rope] a row per token, replicated (P()), static, donated each chunk"
    info = {
        "cache": replicated_latent_cache(cfg, B, N, np.dtype(numpy_dtype(dtype)).itemsize, layout, world, "devices"),
        "devices": world,
        "plan": plan.describe(),
        "how": HOW + "one jitted shard_map step per chunk (jax.mla.latent_step), lax.psum of its partial outputs",
        "matmul_precision": "highest",
    }
    return {"info": info, "run": run, "fetch": fetch, "stages": stages, "cache": caches}
