"""The ``jax-sharded`` backend's one timed decode step (`Backend.prepare_decode`), built in each worker from
the run's step program (`backends.sharded.jax_decode`)."""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.decode import ring_capacity

from ..decoding import kv_cache_bytes
from .jax_decode import _sharded_weights, _step_program, cache_record, gathered_stages


def build_decode_step(
    cfg: MHAConfig, params: MHAParams, batch, context, step, dtype, strategy, world, cache, seed, *, forward
):
    """The benchmark's one step (`Backend.prepare_decode`): ``step`` tokens at positions ``context ..`` onto the
    sharded cache holding ``context`` tokens of random numbers (a window's ring full), compiled ahead.

    The numbers are the jax adapter's (`jax.decode.prepare_decode_step`): the whole layer's K (B, T, Hkv, Dk),
    then V, then the step's x, from ``seed``; each device holds its kv heads' slice, so that one seed gives
    jax and jax-sharded the same step. The step program is the run's (`_step_program`), jitted here without
    donation: the timed call repeats on the same cache (each call copies its slice of the cache once).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..jax.common import temperature_table, tokens_first_axes
    from ..jax.decode_programs import _bucket_table, full_rotary_tables

    w = _sharded_weights(cfg, params, dtype, world, forward)
    plan = w.plan
    ring = ring_capacity(cfg, step)
    T = context + step if ring is None else ring
    rng = np.random.default_rng(seed)
    Hkv = cfg.n_kv_heads
    k_all = rng.standard_normal((batch, T, Hkv, cfg.d_k))  # (B, T, Hkv, Dk): the whole layer's, as jax draws it
    v_all = rng.standard_normal((batch, T, Hkv, cfg.d_v))
    x = rng.standard_normal((batch, step, cfg.d_model))  # (B, s, D)

    def split(array):  # (B, T, Hkv, d) -> (B, T, world*Hkv_local, d): device r's block is its kv heads
        return np.concatenate(
            [array[:, :, plan.kv_heads_of(r).start : plan.kv_heads_of(r).stop] for r in range(world)], axis=2
        )

    held = np.arange(max(0, context - T), context)  # the slots' tokens: the ring's last T (slot t % T)
    k_pos = np.zeros(T, np.int32)
    k_pos[held % T] = held
    k_valid = np.zeros(T, bool)
    k_valid[held % T] = True
    kv_cache = {
        "k_cache": w.put(split(k_all), w.kv_spec),
        "v_cache": w.put(split(v_all), w.kv_spec),
        "k_pos": w.replicated(np.broadcast_to(k_pos, (batch, T)).copy()),
        "k_valid": w.replicated(np.broadcast_to(k_valid, (batch, T)).copy()),
    }
    positions = np.broadcast_to(np.arange(context, context + step, dtype=np.int64), (batch, step))  # (B, s)
    tables = full_rotary_tables(cfg, np.arange(context + step)[None].repeat(batch, 0))
    table_axes = None if tables is None else 0
    if tables is not None:
        cos, sin = (w.replicated(table[:, context:]) for table in tables)  # (B, s, r/2)
        tables = (cos, sin, cos, sin)
    extras = {
        "q_pos": w.replicated(positions.astype(np.int32)),
        "q_valid": w.replicated(np.ones((batch, step), bool)),
        **{name: w.replicated(t) for name, t in temperature_table(cfg, positions, dtype).items()},  # Llama 4's
    }
    if cfg.rel_buckets is not None:
        extras["bucket_of"] = w.replicated(_bucket_table(cfg, context + step))
    index = jax.device_put(np.int32(context), NamedSharding(w.mesh, P()))  # the write index: traced, 0-d
    args = (w.stacked, w.b_o, w.replicated(x), tables, extras, kv_cache, index)
    _, (step_map, _) = _step_program(w, cfg, world, T, table_axes)
    jitted = jax.jit(step_map)  # not donated: the timed call repeats on the same cache
    with jax.default_matmul_precision("highest"):
        compiled = jitted.lower(*args).compile()  # ahead of time, once
    state: dict = {}

    def run():
        state["result"] = compiled(*args)
        jax.block_until_ready(state["result"])

    def fetch() -> np.ndarray:
        return np.asarray(state["result"][1])  # (B, s, D)

    axes = tokens_first_axes(w.local)

    def stages() -> list:
        _, output, stacked_stages = compiled(*args)
        return [(gathered_stages(plan, world, axes, stacked_stages), np.asarray(output))]

    per_device = kv_cache_bytes(cfg, batch, T, np.dtype(w.cast).itemsize, plan.local_kv_heads)
    info = {
        "cache": cache_record(T, per_device, world),
        "cache_copied_per_call": True,  # not donated (see the docstring)
        "compilations": {"step": 1},  # compiled ahead, here; the timed forward calls the executable
        "context": context,
        "step": step,
        "devices": world,
        "plan": plan.describe(),
        "matmul_precision": "highest",
    }
    return {"info": info, "run": run, "fetch": fetch, "stages": stages}
