"""`jax-sharded`'s KV-cache decode: each device keeps its own heads' slice of a static cache, one psum per chunk.

Head-parallel decoding as Megatron's and vLLM's tensor parallelism do it, on the mesh of
`sharded.jax` (axis ``"heads"``) with its ``standard`` strategy (`jax.shard_map`):

* The cache is the jax adapter's static cache (`jax.decode`: keys after QK-norm and rotary,
  before any GQA repeat; ``k_pos`` and ``k_valid`` beside them), split by kv head: one global
  array ``(B, T, world * Hkv_local, Dk)`` placed with ``NamedSharding(mesh, P(None, None,
  "heads", None))``, so each device holds ``(B, T, Hkv_local, Dk)``: its ``Hkv / world`` kv
  heads, or, with fewer kv heads than devices, the one kv head its group of
  ``world / Hkv`` devices shares (replicated, as `core.shard_plan` says for the forward; the
  global head axis then counts each kv head once per replica). ``k_pos`` and ``k_valid``
  ``(B, T)`` are replicated: every device writes the same positions.
* Two programs, each a `jax.shard_map` inside one `jax.jit`: the prefill (the adapter's own
  per-item function on the device's heads over the prefill's tokens, then its last
  ``min(P, T)`` keys written) and the step (the same function with the jax adapter's
  `jax.decode_programs._decode_attend` as its attention: write at a traced index, attend over every
  slot with the positions' rule). Each ends in one ``lax.psum`` of the partial outputs over
  ``"heads"`` (and ``+ b_o`` once, after it); a projection-wide QK-norm adds its two psums
  of sums of squares, as in the forward. The step's shapes are the same at every step, so
  each program is traced and compiled once per (cfg, world, slots, shapes) in the worker
  process and reused (`TRACES` counts the traces; a run reports the traces it caused in
  ``info["compilations"]``, 0 when it found both compiled).
* The cache is donated to each program (``donate_argnums``): it stays on the devices, written
  in place, from the prefill to the last step of a run, all inside the mesh worker process;
  only every chunk's output (and, when asked, its stages) leave it.
* A window: the ring of `core.decode.ring_capacity` slots, written as the jax adapter writes it
  (`jax.decode_programs._write`); without one, `core.decode.check_capacity` before each chunk.

The benchmark's one step (`jax_decode_step.build_decode_step`, `Backend.prepare_decode`) is the run's step program,
jitted without donation and compiled ahead, on a cache of the jax adapter's random numbers for the
same seed (each device its kv heads' slice), so that its output equals the jax adapter's step.

The variants ride along as in the sharded forward (`sharded.common.variant_shards`): sinks, T5's
table columns and ALiBi's slopes per device's heads (ALiBi's distances and T5's buckets from the
replicated positions), head QK-norm weights replicated, projection QK-norm's psums.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, numpy_dtype, prepare_inputs, shard_params, shard_plan
from mha_rosetta.core.decode import DecodeInputs, cache_capacity, check_capacity, decode_stage_names

from ..decoding import kv_cache_bytes
from .common import sharded_cache_info

STATIC = "static"
CACHE_LAYOUT = "(B, T, Hkv_local, Dk) per device"
DECODE_LAYOUTS = {
    STATIC: (
        "the jax adapter's static (B, T, Hkv, Dk) cache split by kv head: one array (B, T, world*Hkv_local, Dk) "
        "with NamedSharding over its heads axis, each device holding (B, T, Hkv_local, Dk) (a kv head replicated "
        "on its group of devices when Hkv < world), written in place by one jitted shard_map step; with a "
        "window a ring buffer of W - 1 + step slots"
    )
}
_CACHE_NAMES = ("k_cache", "v_cache", "k_pos", "k_valid")
# Every trace of each program key (a run reports the traces it caused: what JAX compiled for it).
TRACES: dict = {}


def gathered_stages(plan, world: int, axes: dict, stacked_stages: dict) -> dict:
    """One chunk's stages as the devices hold them, stacked on axis 0 (one slice a device) -> canonical, each
    device's heads gathered into the whole layer's (`common.gather_heads`)."""
    from ..base import StageTensor, canonical_stage
    from .common import gather_heads

    per_rank = [
        {
            name: canonical_stage(name, StageTensor(np.asarray(value)[rank], axes[name]))
            for name, value in stacked_stages.items()
        }
        for rank in range(world)
    ]
    return gather_heads(plan, per_rank)


def cache_record(slots: int, per_device: int, world: int) -> dict:
    """``info["cache"]`` of the sharded static cache: ``per_device`` bytes of K and V on each of ``world`` devices."""
    return sharded_cache_info(STATIC, CACHE_LAYOUT, slots, per_device, world, rank="device")


def _count(key) -> None:
    TRACES[key] = TRACES.get(key, 0) + 1


def _sharded_weights(cfg: MHAConfig, params: MHAParams, dtype: str, world: int, forward: SimpleNamespace):
    """The mesh, the weights placed on it as in the forward's standard strategy, and what both programs' bodies
    share: each device's parameters, its ALiBi slopes and the psum that ends a chunk. ``forward``: the
    sharded forward's mesh, its axis and variant split (`sharded.jax` passes them: it imports this module)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..jax.common import enable_float64_if_needed, mesh_sum_squares

    MESH_AXIS, variant_shards = forward.mesh_axis, forward.variant_shards
    enable_float64_if_needed(dtype)
    mesh = forward.mesh_of(world)
    plan = shard_plan(cfg, world)
    local = plan.local_cfg
    cast = numpy_dtype(dtype)

    def put(array, spec):
        if array is None:
            return None
        array = np.asarray(array)
        array = array.astype(cast) if array.dtype.kind == "f" else array  # positions, masks, buckets keep theirs
        return jax.device_put(np.ascontiguousarray(array), NamedSharding(mesh, spec))

    # The weights as in the forward's standard strategy: one block per device on a leading axis the mesh splits.
    shards, own = shard_params(cfg, params, world), variant_shards(cfg, params, world)
    stacked = {
        name: put(np.stack([getattr(shard, name) for shard in shards]), P(MESH_AXIS))
        for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v")
        if getattr(shards[0], name) is not None
    }
    stacked.update({name: put(np.stack([o[name] for o in own]), P(MESH_AXIS)) for name in own[0]})
    names = list(params.as_dict())
    sum_squares = mesh_sum_squares(cfg, MESH_AXIS, world)  # a projection-wide norm's psum, or None

    def local_params(stacked):
        weights = {name: stacked[name][0] if name in stacked else None for name in names}
        weights["b_o"] = None  # added once, after the all-reduce
        return weights

    def slopes_of(stacked, tables: dict) -> dict:
        return {**tables, "slopes": stacked["slopes"][0]} if "slopes" in stacked else tables

    def finish(stages, b_o):
        output = jax.lax.psum(stages["output"], MESH_AXIS)  # the all-reduce of the partial outputs (B, s, D)
        output = output if b_o is None else output + b_o
        return output, {name: stages[name][None] for name in decode_stage_names(local) if name != "output"}

    kv_spec = P(None, None, MESH_AXIS, None)  # (B, T, world*Hkv_local, d): each device its heads' slice
    return SimpleNamespace(
        mesh=mesh,
        plan=plan,
        local=local,
        cast=cast,
        put=put,
        stacked=stacked,
        b_o=put(params.b_o, P()),
        sum_squares=sum_squares,
        local_params=local_params,
        slopes_of=slopes_of,
        finish=finish,
        axis=MESH_AXIS,
        kv_spec=kv_spec,
        cache_specs={"k_cache": kv_spec, "v_cache": kv_spec, "k_pos": P(), "k_valid": P()},
        replicated=lambda array: put(array, P()),
    )


def _step_program(w: SimpleNamespace, cfg: MHAConfig, world: int, T: int, table_axes):
    """The step's shard_map (un-jitted) and its key: a chunk of s tokens written at a traced index and attended."""
    import jax
    from jax.sharding import PartitionSpec as P

    from ..jax.common import shared_program
    from ..jax.decode_programs import _decode_attend
    from ..jax.layer import _mha_one_item

    MESH_AXIS, ring = w.axis, cfg.window is not None

    def step_body(stacked, b_o, x, tables, extras, cache, index):
        _count(step_key)  # runs only while JAX traces (and so compiles) this program
        attend = partial(_decode_attend, slots=T, ring=ring)
        one_item = partial(_mha_one_item, cfg=w.local, head_mask_axis=None, attend=attend, sum_squares=w.sum_squares)
        item = {**cache, **w.slopes_of(stacked, extras), "index": index}
        item_axes = {name: (None if name in ("slopes", "bucket_of", "index") else 0) for name in item}
        all_items = jax.vmap(one_item, in_axes=(None, 0, 0, 0, None, table_axes, item_axes))
        stages = all_items(w.local_params(stacked), x, x, x, None, tables, item)
        return {name: stages[name] for name in _CACHE_NAMES}, *w.finish(stages, b_o)

    step_in = (P(MESH_AXIS), P(), P(), P(), P(), w.cache_specs, P())
    out_specs = (w.cache_specs, P(), P(MESH_AXIS))
    # What the body closes over: cfg, the mesh (world) and the slots; JAX's cache then tells shapes apart.
    step_key = ("jax-sharded.decode.step", cfg, world, T, table_axes)
    step_map = jax.shard_map(step_body, mesh=w.mesh, in_specs=step_in, out_specs=out_specs)
    return step_key, shared_program(step_key, step_map, donate_argnums=(5,))


def build_decode(
    cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, strategy: str, world: int, *, forward
):
    """One decode run on a mesh of ``world`` devices (in the worker process): its programs, device arrays and driver.
    ``forward``: `sharded.jax`'s mesh axis and variant split (see `_sharded_weights`)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..jax.common import score_bias_inputs, shared_program, temperature_table, tokens_first_axes
    from ..jax.decode_programs import _bucket_table, full_rotary_tables
    from ..jax.layer import _mha_one_item, cached_heads, mask_for_vmap

    w = _sharded_weights(cfg, params, dtype, world, forward)
    MESH_AXIS = w.axis
    mesh, plan, local, cast, put, stacked, b_o = w.mesh, w.plan, w.local, w.cast, w.put, w.stacked, w.b_o
    sum_squares, local_params, slopes_of, finish = w.sum_squares, w.local_params, w.slopes_of, w.finish

    B, N = inputs.batch, inputs.tokens
    T = cache_capacity(cfg, N, inputs.step)
    ring = cfg.window is not None
    positions, valid = inputs.positions, inputs.valid  # (B, N) each
    tables = full_rotary_tables(cfg, positions)  # (B, N, r/2) each, or None: from the whole run's positions
    chunks = inputs.chunks()

    def chunk_tables(start, stop):
        if tables is None:
            return None
        cos, sin = (put(table[:, start:stop], P()) for table in tables)  # (B, s, r/2): replicated
        return (cos, sin, cos, sin)  # self-attention: the keys are the queries' tokens

    # -- the prefill program ----------------------------------------------------------------
    first = chunks[0][1]
    mask = None if valid[:, :first].all() else valid[:, None, None, :first]  # (B, 1, 1, P): pads are never keys
    prefill_inputs = prepare_inputs(local, inputs.x[:, :first], mask=mask, positions=positions[:, :first])
    allowed, batch_axis, head_axis = mask_for_vmap(local, prefill_inputs)  # no head axis: a padding mask
    if head_axis is not None:
        raise ValueError("a decode run's mask is a padding mask: it has no head axis to shard")
    score_np, score_axes = score_bias_inputs(local, prefill_inputs, dtype)
    score_tables = {name: put(table, P()) for name, table in score_np.items() if name != "slopes"}
    table_axes = None if tables is None else 0
    kept = min(first, T)  # a prefill longer than the ring keeps its last T tokens
    slots = np.arange(first - kept, first) % T if ring else np.arange(kept)

    def prefill_body(stacked, b_o, x, allowed, tables, score_tables, cache, q_pos, q_valid):
        _count(prefill_key)  # runs only while JAX traces (and so compiles) this program
        one_item = partial(_mha_one_item, cfg=local, head_mask_axis=head_axis, sum_squares=sum_squares)
        all_items = jax.vmap(one_item, in_axes=(None, 0, 0, 0, batch_axis, table_axes, score_axes))
        stages = all_items(local_params(stacked), x, x, x, allowed, tables, slopes_of(stacked, score_tables))
        keys, values = cached_heads(local, stages)  # what the scores and the weighted sum read
        new = {"k_cache": keys, "v_cache": values, "k_pos": q_pos, "k_valid": q_valid}
        cache = {name: cache[name].at[:, slots].set(new[name][:, first - kept :]) for name in _CACHE_NAMES}
        return cache, *finish(stages, b_o)

    kv_spec, cache_specs = w.kv_spec, w.cache_specs
    out_specs = (cache_specs, P(), P(MESH_AXIS))
    prefill_in = (P(MESH_AXIS), P(), P(), P(), P(), P(), cache_specs, P(), P())
    axes_key = (batch_axis, tuple(sorted(score_axes.items())), table_axes)
    # What the bodies close over: cfg, the mesh (world), the slots and the prefill's split; JAX's cache
    # then tells shapes and dtypes apart (`jax.common.shared_program`).
    prefill_key = ("jax-sharded.decode.prefill", cfg, world, T, first, axes_key)
    prefill_map = jax.shard_map(prefill_body, mesh=mesh, in_specs=prefill_in, out_specs=out_specs)
    _, prefill = shared_program(prefill_key, prefill_map, donate_argnums=(6,))

    # -- the step program -------------------------------------------------------------------
    span = int(positions.max() - positions.min())
    bucket_of = None if cfg.rel_buckets is None else put(_bucket_table(cfg, span), P())

    step_key, (_, step) = _step_program(w, cfg, world, T, table_axes)

    # -- every chunk's device arguments, put once -------------------------------------------
    def chunk_args(start, stop):
        x = put(inputs.x[:, start:stop], P())  # (B, s, D): replicated on every device
        if start == 0:
            q_pos, q_valid = (put(a[:, :stop], P()) for a in (positions.astype(np.int32), valid))
            return (x, put(allowed, P()), chunk_tables(0, stop), score_tables), (q_pos, q_valid)
        extras = {
            "q_pos": put(positions[:, start:stop].astype(np.int32), P()),
            "q_valid": put(valid[:, start:stop], P()),
            # Llama 4's temperature at the chunk's positions, the cache offset included (B, s)
            **{name: put(t, P()) for name, t in temperature_table(cfg, positions[:, start:stop], dtype).items()},
        }
        if bucket_of is not None:
            extras["bucket_of"] = bucket_of
        index = jax.device_put(np.int32(start), NamedSharding(mesh, P()))  # the write index: traced, 0-d
        return (x, chunk_tables(start, stop), extras), index

    args = [chunk_args(start, stop) for start, stop in chunks]
    Hl, itemsize = plan.local_kv_heads, np.dtype(cast).itemsize
    per_device = kv_cache_bytes(cfg, B, T, itemsize, Hl)

    def empty_cache() -> dict:
        heads = world * Hl  # the global heads axis: each kv head once per replica
        return {
            "k_cache": put(np.zeros((B, T, heads, cfg.d_k)), kv_spec),
            "v_cache": put(np.zeros((B, T, heads, cfg.d_v)), kv_spec),
            "k_pos": put(np.zeros((B, T), np.int32), P()),  # (B, T): each slot's position
            "k_valid": put(np.zeros((B, T), bool), P()),  # (B, T): False = never written / pad
        }

    state: dict = {}

    def run() -> dict:
        """The prefill and every step, the cache donated from one to the next; returns this run's compilations."""
        at_start = {kind: TRACES.get(key, 0) for kind, key in (("prefill", prefill_key), ("step", step_key))}
        cache, used, outputs, stages = empty_cache(), 0, [], []
        with jax.default_matmul_precision("highest"):
            for (start, stop), (chunk, extra) in zip(chunks, args, strict=True):
                if not ring:
                    check_capacity(T, used, stop - start)  # before the step: inside it the write would clamp
                if start == 0:
                    cache, output, local_stages = prefill(stacked, b_o, *chunk, cache, *extra)
                else:
                    cache, output, local_stages = step(stacked, b_o, *chunk, cache, extra)
                used += stop - start
                outputs.append(output)
                stages.append(local_stages)
        jax.block_until_ready(outputs)
        state.update(outputs=outputs, stages=stages, cache=cache)
        counts = {"prefill": TRACES.get(prefill_key, 0), "step": TRACES.get(step_key, 0)}
        return {"compilations": {kind: counts[kind] - at_start[kind] for kind in counts}}

    def fetch() -> np.ndarray:
        return np.concatenate([np.asarray(output) for output in state["outputs"]], axis=1)  # (B, N, D)

    axes = tokens_first_axes(local)

    def chunk_stages() -> list:
        """Each chunk's stages: every device's heads gathered side by side (canonical), and its output."""
        run()
        out = []
        for output, stacked_stages in zip(state["outputs"], state["stages"], strict=True):
            out.append((gathered_stages(plan, world, axes, stacked_stages), np.asarray(output)))
        return out

    info = {
        "cache": cache_record(T, per_device, world),
        "cache_sharding": f"NamedSharding(mesh, {kv_spec}) over a 1-D mesh {MESH_AXIS!r} of {world} devices",
        "ring_buffer": ring,
        "devices": world,
        "plan": plan.describe(),
        "how": "shard_map prefill and step programs over the heads; lax.psum of each chunk's partial outputs, + b_o",
        "compilations": {"prefill": 0, "step": 0},  # filled by each run: its programs' traces
        "matmul_precision": "highest",
    }
    return {"info": info, "run": run, "fetch": fetch, "stages": chunk_stages}
