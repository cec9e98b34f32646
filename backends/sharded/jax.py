"""`jax-sharded`: the layer's heads split over a JAX device mesh (tensor parallelism).

Two ways JAX users write it, as two strategies:

* ``standard``: `jax.shard_map` over a 1-D mesh with axis ``"heads"``. Each device gets
  its own block of rows of ``w_q``, ``w_k``, ``w_v`` (its heads: column-parallel), its
  columns of ``w_o`` (row-parallel) and the replicated input; it runs the JAX adapter's
  own per-item function (`jax.layer._mha_one_item`, one head unbatched, vmap over heads)
  on its heads only, which ends in a partial output ``merged_r @ w_o[:, cols_r].T``; one
  `lax.psum` over ``"heads"`` sums the partial outputs, and ``b_o`` is added once, after it.
* ``named_sharding``: the unsharded program of the JAX adapter, jitted with the weights
  placed by `NamedSharding` (``P("heads", None)`` on the rows of w_q/w_k/w_v,
  ``P(None, "heads")`` on the columns of w_o) and the output replicated; XLA's SPMD
  partitioner decides the communication. The number of all-reduces it chose is read from
  the compiled program and reported (`Prepared.info["all_reduces"]`).

Which rows and columns each device holds is `core.sharding` (`shard_plan`,
`shard_params`); GQA with fewer kv heads than devices replicates each kv head on whole
groups of devices, as Megatron does.

The variants' parameters are split by head the way the heads are (`common.variant_shards`), and
what each split costs in collectives (``standard``; ``named_sharding`` leaves it to XLA):

* sinks ``(H,)``, ALiBi's slopes (of the whole layer's H heads, `core.variants.alibi_slopes`:
  a device's heads keep their global slopes, never those of a layer of H/world heads) and
  T5's table ``rel_bias[:, heads]`` (its columns): each device holds its heads' entries; a
  head's scores never leave its device, so these cost no collective;
* head QK-norm's ``(d_k,)`` weights: replicated on every device, statistics per head: none;
* projection QK-norm: its weights split like the rows of w_q and w_k (a device's features of
  the projection), but its statistic is a mean over the *whole* projection: each device sums
  the squares of its features and one ``lax.psum`` per projection (q, and k) adds them up
  before the normalisation, two more psums of (B, N, 1) numbers (a kv head replicated on r
  devices is counted r times, and so is its width, so the mean is right). Measured on the
  check's OLMo-2-like case (4 heads, 2 kv heads, 4 devices): the compiled program holds 2
  all-reduces where the other variants hold 1 (XLA:CPU combines the two psums into one);
  ``named_sharding``'s partitioner chose 3 there;
* the window, the other score steps and the qkv bias: per score or per feature, nothing to communicate.

Decoding through a KV cache (`jax_decode`, the ``standard`` strategy): each device keeps its kv
heads' slice of a static cache sharded over ``"heads"``, one prefill and one step program, a psum
per chunk. MLA runs in its own ``naive`` and ``absorbed`` strategies (`jax_mla`: the latent replicated).

Devices: ``--xla_force_host_platform_device_count`` only works before JAX starts, and the
calling process may have started JAX already (the check runs the other JAX backends
first). So the computation runs in a worker process that this backend starts (with the
flag set) the first time it prepares a case and reuses after; it is torn down at exit.
`forward` asks the worker to run the compiled program and wait for it; `to_numpy` fetches
the output. A dead worker is an error that says so, never a hang (`workers`).
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, numpy_dtype, rotary_tables, shard_mask, shard_params, shard_plan
from mha_rosetta.core.variants import norm_step

from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE
from ..base import STANDARD
from ..frameworks.ops import RegistryVariants
from ..frameworks.score_parts import head_params
from . import jax_decode
from .common import PREPARE_SECONDS, ShardedBackend, check_positive_int, gather_heads, latent_cache_of, variant_shards
from .workers import Programs, WorkerGroup, serve

NAMED_SHARDING = "named_sharding"
# Simulated CPU devices the worker's JAX is started with: enough for 2, 4 and 8 ranks.
SIMULATED_DEVICES = 8
MESH_AXIS = "heads"


def default_world(cfg: MHAConfig, max_devices: int) -> int:
    """The largest rank count up to ``max_devices`` that splits ``cfg``'s heads (1 if none)."""
    for world in range(min(max_devices, cfg.n_heads), 0, -1):
        try:
            shard_plan(cfg, world)
        except ValueError:
            continue
        return world
    return 1


class JaxShardedBackend(ShardedBackend):
    name = "jax-sharded"
    convention = (
        "heads over a device mesh: rows of w_q/w_k/w_v and columns of w_o per device, one psum (shard_map); "
        "or NamedSharding and XLA's partitioner"
    )
    strategies = (STANDARD, NAMED_SHARDING, NAIVE, ABSORBED)  # the last two: MLA's (`jax_mla`)
    rank_noun = "devices"
    # Every variant, in both strategies (the module docstring says how each is split); no backward pass.
    variants = RegistryVariants("jax")  # MLA in its naive and absorbed strategies only
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8: head-parallel decoding (`jax_decode`): each device its kv heads' slice of a static cache, one
    # psum per chunk, in the standard (shard_map) strategy, every variant; MLA's forms on a replicated latent cache.
    decode_caches = (jax_decode.STATIC,)
    decode_strategies = (STANDARD, *MLA_STRATEGIES)
    decode_layouts: ClassVar[dict[str, str]] = jax_decode.DECODE_LAYOUTS

    def __init__(self, name: str | None = None, world: int | None = None, max_devices: int = SIMULATED_DEVICES) -> None:
        super().__init__(name)
        check_positive_int("max_devices", max_devices)
        if world is not None:
            check_positive_int("world", world, "a positive int (the number of devices) or None")
            if world > max_devices:
                raise ValueError(
                    f"world={world} needs more devices than the {max_devices} available "
                    f"(simulated CPU devices, --xla_force_host_platform_device_count={max_devices}); "
                    f"pass max_devices={world} to simulate more"
                )
        self.world, self.max_devices = world, max_devices

    def world_for(self, cfg: MHAConfig) -> int:
        """The rank count a case runs on: the one given, or the largest that splits the heads."""
        return default_world(cfg, self.max_devices) if self.world is None else self.world

    def _new_group(self) -> WorkerGroup:
        # The caller's XLA flags (the check's compile settings, a user's own) go along; the device count is added.
        flags = " ".join(
            (os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={self.max_devices}")
        )
        env = {"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
        return WorkerGroup(self.name, _worker_main, 1, env=env, start_timeout=PREPARE_SECONDS)


# -- the worker process -----------------------------------------------------------------------
def _worker_main(conn, rank: int, size: int) -> None:
    import jax

    from ..jax.executables import settle_x64

    settle_x64()  # in the check: one x64 setting for every program this process traces
    from . import jax_mla
    from .jax_decode import build_decode
    from .jax_decode_step import build_decode_step

    # What the decode and MLA builders reuse (handed in: `jax_mla` cannot import this module, which imports it).
    forward_split = SimpleNamespace(mesh_axis=MESH_AXIS, variant_shards=variant_shards, mesh_of=mesh_of,
                                    compile_on_mesh=compile_on_mesh)  # fmt: skip
    mla = partial(jax_mla.build_forward, forward=forward_split)  # MLA's forms (`jax_mla`)
    programs = Programs(lambda *case: (mla if case[4] in MLA_STRATEGIES else _build)(*case))  # case[4]: the strategy

    def forward(key):
        program = programs[key]
        program["result"] = program["compiled"](*program["args"])
        jax.block_until_ready(program["result"])

    def fetch(key):
        return np.asarray(programs[key]["result"])

    def stages(key):
        return programs[key]["stages"]()

    # A decode run ("run": built once, run whole per request, its sharded cache kept here) or the
    # benchmark's one step ("step"), by the payload's first entry.
    builders = {
        "run": lambda cfg, params, inputs, dtype, strategy, world, _cache: (
            jax_mla.build_decode if strategy in MLA_STRATEGIES else build_decode
        )(cfg, params, inputs, dtype, strategy, world, forward=forward_split),
        "step": partial(build_decode_step, forward=forward_split),
    }
    decoders = Programs(lambda kind, *payload: builders[kind](*payload))
    handlers = {"prepare": programs.prepare, "forward": forward, "fetch": fetch, "stages": stages}
    handlers.update(
        decode_prepare=decoders.prepare,
        decode_run=lambda key: decoders[key]["run"](),
        decode_fetch=lambda key: decoders[key]["fetch"](),
        decode_stages=lambda key: decoders[key]["stages"](),  # one worker: the devices' heads already gathered
        decode_cache=lambda key: latent_cache_of(decoders[key]),  # MLA: each device's (`rank_latent_caches`)
    )
    conn.send(("ok", {"devices": len(jax.devices())}))
    serve(conn, handlers)


def count_all_reduces(hlo_text: str) -> int:
    """All-reduce operations in a compiled XLA program (an async pair counts once)."""
    lines = hlo_text.splitlines()
    return sum(" all-reduce(" in line or " all-reduce-start(" in line for line in lines)


def compile_on_mesh(jitted, args: tuple, key: tuple, plan, **info):
    """``jitted`` compiled for ``args`` (matmul precision "highest") and the case's info: the mesh, the plan, the
    all-reduces XLA's compiled program holds, and ``info`` (how, collectives)."""
    import jax

    from ..jax.executables import compile_program

    with jax.default_matmul_precision("highest"):
        compiled = compile_program(jitted, args, key)
    mesh = f"1-D mesh {MESH_AXIS!r} of {plan.world} simulated CPU devices"
    counted = {"all_reduces": count_all_reduces(compiled.as_text()), "matmul_precision": "highest"}
    return compiled, {"devices": plan.world, "mesh": mesh, "plan": plan.describe(), **info, **counted}


def mesh_of(world: int):
    """The 1-D mesh ``"heads"`` of the first ``world`` devices JAX sees (in the worker process)."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    if world > len(devices):
        raise ValueError(f"world={world} needs more devices than the {len(devices)} JAX sees")
    return Mesh(np.array(devices[:world]), (MESH_AXIS,))


def _build(cfg, params, inputs, dtype, strategy, world):
    """Compile one case on a mesh of ``world`` devices (in the worker process)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from .._layouts import TOKENS_FIRST_STAGE_AXES
    from ..base import StageTensor, canonical_stage
    from ..jax.common import (
        VARIANT_STAGE_AXES,
        enable_float64_if_needed,
        mesh_sum_squares,
        score_bias_inputs,
        shared_program,
    )
    from ..jax.layer import _mha_one_item, batched_tables, mask_for_vmap

    enable_float64_if_needed(dtype)
    mesh = mesh_of(world)
    plan = shard_plan(cfg, world)
    cast = numpy_dtype(dtype)

    def put(array, spec):
        if array is None:
            return None
        array = np.asarray(array)
        array = array.astype(cast) if array.dtype.kind == "f" else array  # masks and T5 buckets keep theirs
        return jax.device_put(np.ascontiguousarray(array), NamedSharding(mesh, spec))

    x_q, x_k, x_v = (put(x, P()) for x in (inputs.query, inputs.key, inputs.value))  # replicated on every device
    # The rotary tables depend on the tokens only, not on the heads: replicated, like the inputs.
    tables = rotary_tables(cfg, inputs)
    if tables is not None:
        tables = (tables.q_cos, tables.q_sin, tables.k_cos, tables.k_sin)
    tables, table_axes = batched_tables(tables)  # on the NumPy tables: a shared table's [0] is a view
    tables = None if tables is None else tuple(put(table, P()) for table in tables)
    # The score bias's tables: ALiBi's distances and T5's buckets depend on the tokens only (replicated);
    # the slopes are per head, split with the heads below.
    score_np, score_axes = score_bias_inputs(cfg, inputs, dtype)
    score_tables = {name: put(table, P()) for name, table in score_np.items() if name != "slopes"}
    collectives = ["one psum of the partial outputs"]
    if strategy == STANDARD:
        local_cfg = plan.local_cfg
        shards = shard_params(cfg, params, world)
        own = variant_shards(cfg, params, world)
        # One block per rank, stacked on a leading axis that the mesh splits: (world, rows, in) etc.
        stacked = {
            name: put(np.stack([getattr(shard, name) for shard in shards]), P(MESH_AXIS))
            for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v")
            if getattr(shards[0], name) is not None
        }
        stacked.update({name: put(np.stack([o[name] for o in own]), P(MESH_AXIS)) for name in own[0]})
        sum_squares = mesh_sum_squares(cfg, MESH_AXIS, world)  # a projection-wide norm's psum, or None
        if sum_squares is not None:
            collectives.append("one psum each of q's and k's sums of squares (projection QK-norm)")
        # Each rank's mask (the user's mask cut to its heads, AND causal), shaped for the local vmaps.
        per_rank = [
            mask_for_vmap(local_cfg, dataclasses.replace(inputs, mask=shard_mask(inputs.mask, plan, rank)))
            for rank in range(world)
        ]
        _, batch_axis, head_axis = per_rank[0]
        allowed = None if per_rank[0][0] is None else put(np.stack([m[0] for m in per_rank]), P(MESH_AXIS))
        one_item = partial(_mha_one_item, cfg=local_cfg, head_mask_axis=head_axis, sum_squares=sum_squares)
        all_stages = jax.vmap(one_item, in_axes=(None, 0, 0, 0, batch_axis, table_axes, score_axes))

        def local_stages(stacked, x_q, x_k, x_v, allowed, tables, score_tables):
            local = {name: stacked[name][0] if name in stacked else None for name in params.as_dict()}
            local["b_o"] = None  # added once, after the all-reduce
            if "slopes" in stacked:  # this device's heads' ALiBi slopes
                score_tables = {**score_tables, "slopes": stacked["slopes"][0]}
            allowed = None if allowed is None else allowed[0]
            return all_stages(local, x_q, x_k, x_v, allowed, tables, score_tables)

        def body(stacked, b_o, x_q, x_k, x_v, allowed, tables, score_tables):
            partial_output = local_stages(stacked, x_q, x_k, x_v, allowed, tables, score_tables)["output"]  # its heads
            output = jax.lax.psum(partial_output, MESH_AXIS)  # the all-reduce of the partial outputs (B, Nq, D)
            return output if b_o is None else output + b_o

        in_specs = (P(MESH_AXIS), P(), P(), P(), P(), P(MESH_AXIS), P(), P())
        forward = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P())
        args = (stacked, put(params.b_o, P()), x_q, x_k, x_v, allowed, tables, score_tables)

        def stage_body(stacked, b_o, x_q, x_k, x_v, allowed, tables, score_tables):
            # Every stage of this device's heads, on a new leading axis that the mesh stacks.
            stages = local_stages(stacked, x_q, x_k, x_v, allowed, tables, score_tables)
            return {name: value[None] for name, value in stages.items() if name != "output"}

        # Each rank's heads come back side by side (context on its head axis, merged on its features).
        stage_fn = jax.shard_map(stage_body, mesh=mesh, in_specs=in_specs, out_specs=P(MESH_AXIS))
        how = f"shard_map over {plan.describe()}; lax.psum of the partial outputs, then + b_o"
    else:
        split_kv = plan.kv_replicas == 1
        specs = {
            "w_q": P(MESH_AXIS, None),  # rows: the heads' scorers (column-parallel)
            "w_k": P(MESH_AXIS, None) if split_kv else P(),
            "w_v": P(MESH_AXIS, None) if split_kv else P(),
            "w_o": P(None, MESH_AXIS),  # columns: what each head's context feeds (row-parallel)
            "b_q": P(MESH_AXIS),
            "b_k": P(MESH_AXIS) if split_kv else P(),
            "b_v": P(MESH_AXIS) if split_kv else P(),
            "b_o": P(),
            "w_gate": P(MESH_AXIS, None),  # the output gate's rows: per head, like w_q's
            "b_gate": P(MESH_AXIS),
            # The variants' per-head parameters (`ParamSpec.head_axis`: the sinks, T5's bias table's columns) split
            # along their head axis; the norm before rotary's weights below.
            **{spec.name: P(*[None] * spec.head_axis, MESH_AXIS) for spec in head_params()},
        }
        step = norm_step(cfg)  # QK-norm's: per-head weights replicated, a projection's split like the biases
        if step is not None:  # (XLA then chooses how to reduce the projection's statistics)
            specs[step.weight("q")] = P() if step.per_head else specs["b_q"]
            specs[step.weight("k")] = P() if step.per_head else specs["b_k"]
        weights = {name: put(array, specs[name]) for name, array in params.as_dict().items()}
        if "slopes" in score_np:
            score_tables["slopes"] = put(score_np["slopes"], P(MESH_AXIS))
        allowed, batch_axis, head_axis = mask_for_vmap(cfg, inputs)
        one_item = partial(_mha_one_item, cfg=cfg, head_mask_axis=head_axis)
        all_stages = jax.vmap(one_item, in_axes=(None, 0, 0, 0, batch_axis, table_axes, score_axes))

        def forward(weights, x_q, x_k, x_v, allowed, tables, score_tables):
            return all_stages(weights, x_q, x_k, x_v, allowed, tables, score_tables)["output"]

        forward = jax.jit(forward, out_shardings=NamedSharding(mesh, P()))
        args = (weights, x_q, x_k, x_v, put(allowed, P()), tables, score_tables)

        def stage_fn(*args):
            return {name: value[None] for name, value in all_stages(*args).items() if name != "output"}

        kv = "split by head" if split_kv else "replicated (fewer kv heads than devices)"
        how = f"jit with NamedSharding: w_q rows and w_o columns over {world} devices, kv weights {kv}; XLA partitions"

    # The closures capture the mesh (its first ``world`` devices), the (local) config, the vmap axes and,
    # for named_sharding, the weight specs (from cfg and world): the same key, the same program, compiled once
    # per worker process (`jax.common.shared_program`).
    key = ("jax-sharded", strategy, cfg, world, batch_axis, head_axis, table_axes, tuple(sorted(score_axes.items())))
    _, jitted = shared_program(key, forward)
    _, jitted_stages = shared_program(("stages", *key), stage_fn)
    collectives = "; ".join(collectives) if strategy == STANDARD else "chosen by XLA's partitioner"
    compiled, info = compile_on_mesh(jitted, args, key, plan, how=how, collectives=collectives)

    def stages():
        """Canonical stage tensors: each device's heads gathered side by side (shard_map), or the
        partitioned program's own (named_sharding), and the compiled program's output."""
        with jax.default_matmul_precision("highest"):
            result = {name: np.asarray(value) for name, value in jitted_stages(*args).items()}
        per_rank = [
            {
                name: canonical_stage(
                    name, StageTensor(value[rank], {**TOKENS_FIRST_STAGE_AXES, **VARIANT_STAGE_AXES}[name])
                )
                for name, value in result.items()
            }
            for rank in range(len(next(iter(result.values()))))
        ]
        stages = gather_heads(plan, per_rank) if strategy == STANDARD else per_rank[0]
        stages["output"] = np.asarray(compiled(*args))
        how = f"each device's heads side by side ({plan.describe()})" if strategy == STANDARD else "XLA-partitioned"
        return stages, how

    return {"compiled": compiled, "args": args, "info": info, "stages": stages}
