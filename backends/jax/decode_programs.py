"""The jax adapter's decode programs (`backends.jax.decode` jits them): the cache write at a traced index
(a ring's too), the attention of a chunk over the cache, the position tables, and the prefill and step
programs over one item (vmapped over the batch), with ``TRACES`` counting their traces."""

from __future__ import annotations

from collections import Counter
from functools import partial
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, rotary_tables
from mha_rosetta.core.decode import decode_stage_names
from mha_rosetta.core.variants import t5_buckets

from .layer import _attend_all_heads, _mha_one_item, cached_heads

# The per-item cache arrays, as the step's vmapped item dict carries them (batch axis 0).
_CACHE_NAMES = ("k_cache", "v_cache", "k_pos", "k_valid")


def _write(cache, new, index, *, slots: int, ring: bool):
    """One item's cache (T, ...) with ``new`` (s, ...) written at token ``index`` (a traced int32 scalar).

    Not a ring: one ``dynamic_update_slice`` at ``index`` (the caller checked the capacity). A
    ring: token t in slot ``t % T``; one token is a dynamic slice at ``index % T``, several may
    straddle the end and are a scatter on the wrapped slots (s <= T, so the slots are distinct).
    """
    import jax.numpy as jnp
    from jax import lax

    s = new.shape[0]
    zeros = (jnp.zeros((), index.dtype),) * (cache.ndim - 1)  # start indices share one integer type
    if not ring:
        return lax.dynamic_update_slice(cache, new, (index, *zeros))
    if s == 1:
        return lax.dynamic_update_slice(cache, new, (index % slots, *zeros))
    return cache.at[(index + jnp.arange(s, dtype=index.dtype)) % slots].set(new)  # (T, ...)


def _decode_attend(
    q_rotated, k_rotated, v_heads, allowed, head, item, *, cfg: MHAConfig, head_mask_axis, slots: int, ring: bool
):
    """`layer._mha_one_item`'s attention step for one item of a decode step: write, then attend to the cache.

    q_rotated (s, H, Dk), k_rotated (s, Hkv, Dk), v_heads (s, Hkv, Dv): the step's new tokens;
    ``item``: this item's cache (``k_cache`` (T, Hkv, Dk), ``v_cache`` (T, Hkv, Dv), ``k_pos`` (T,),
    ``k_valid`` (T,)), the step's ``q_pos`` (s,) and ``q_valid`` (s,), the write ``index`` and, with
    T5's bias, ``bucket_of`` (the bucket of every distance from ``-span``, `_bucket_table`). Returns
    the context (s, H, Dv) and the updated cache.
    """
    write = partial(_write, index=item["index"], slots=slots, ring=ring)
    cache = {
        "k_cache": write(item["k_cache"], k_rotated),  # after QK-norm, rotary and its norm: Hkv heads, never repeated
        "v_cache": write(item["v_cache"], v_heads),
        "k_pos": write(item["k_pos"], item["q_pos"]),
        "k_valid": write(item["k_valid"], item["q_valid"]),
    }
    heads = attend_over_cache(
        q_rotated, cache["k_cache"], cache["v_cache"], cache["k_pos"], cache["k_valid"], head, item, cfg=cfg
    )
    return {"context": heads["context"], **cache}  # context (s, H, Dv)


def attend_over_cache(q_rotated, keys, values, k_pos, k_valid, head, item, *, cfg: MHAConfig):
    """The step's queries (s, H, Dk) over a cache's slots: keys (T, Hkv, Dk), values (T, Hkv, Dv), each slot's
    position ``k_pos`` (T,) and ``k_valid`` (T,), the rules of `core.decode.decode_allowed` in jnp (a contiguous
    cache's slots and a paged cache's gathered pages alike). Returns `layer._attend_all_heads`'s stages."""
    import jax.numpy as jnp

    q_pos, k_pos = item["q_pos"][:, None], k_pos[None, :]  # (s, 1), (1, T)
    # core.decode.decode_allowed in jnp: causal and window on the positions, only written real slots.
    allowed = (k_pos <= q_pos) & k_valid[None, :]  # (s, T)
    if cfg.window is not None:
        allowed = allowed & (k_pos > q_pos - cfg.window)
    if cfg.attention_chunk_size is not None:  # Llama 4's chunks on the positions, the cache offset included
        allowed = allowed & (k_pos // cfg.attention_chunk_size == q_pos // cfg.attention_chunk_size)
    scores_item = {}
    if cfg.has_score_bias:
        distance = k_pos - q_pos  # (s, T): p_j - p_i
        if "slope" in head:  # a distance's slope (ALiBi's)
            scores_item["distance"] = distance.astype(head["slope"].dtype)
        if cfg.rel_buckets is not None:
            table = item["bucket_of"]  # (2 span + 1,)
            span = (table.shape[0] - 1) // 2
            scores_item["bucket"] = table[jnp.clip(distance + span, 0, 2 * span)]  # (s, T); masked pairs clip
    return _attend_all_heads(q_rotated, keys, values, allowed, head, scores_item, cfg=cfg, head_mask_axis=None)


def _bucket_table(cfg: MHAConfig, span: int) -> np.ndarray:
    """T5's bucket of every distance ``-span .. span`` (`core.variants.t5_buckets`), int32 (2 span + 1,)."""
    distance = np.arange(-span, span + 1, dtype=np.int64)
    return t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional).astype(np.int32)


def full_rotary_tables(cfg: MHAConfig, positions: np.ndarray) -> tuple | None:
    """The rotary tables ``(cos, sin)`` (B, N, r/2) of every token's position, or None without rope.

    From the whole sequence at once (`core.rotary_tables`), so that a scaling that reads the
    sequence length sees the full forward's; queries and keys share them (self-attention).
    """
    tables = rotary_tables(cfg, SimpleNamespace(positions=positions, kv_positions=positions))
    return None if tables is None else (tables.q_cos, tables.q_sin)


def step_rotary_tables(cfg: MHAConfig, job) -> tuple | None:
    """A timed step's rotary tables (B, s, r/2): the whole span's (`full_rotary_tables` of ``0 .. context + step -
    1``, as a run computes them) at each row's own positions (`DecodeStep.positions`; a ragged batch's differ)."""
    span = np.arange(job.context + job.step)[None].repeat(job.batch, 0)  # (B, context + step)
    tables = full_rotary_tables(cfg, span)
    if tables is None:
        return None
    at = job.positions()[..., None]  # (B, s, 1): the step's positions index the span's tables
    return tuple(np.take_along_axis(table, at, axis=1) for table in tables)  # (B, s, r/2) copies


# Every trace of each program key (`JaxDecoder.compilations` reads the count since a decoder was built).
TRACES: Counter = Counter()


def _prefill_program(
    cfg: MHAConfig, capacity: int, key: tuple, axes, params, x, allowed, tables, cache, score_tables, q_pos, q_valid
):
    """The prefill: the adapter's forward over its P tokens, then its last min(P, T) keys written.

    ``axes`` (static): the mask's batch and head in_axes (`layer.mask_for_vmap`) and the score
    tables' batch in_axes (`common.score_bias_inputs`), as the forward's vmaps take them.
    """
    import jax

    TRACES[key] += 1  # runs only while JAX traces (and so compiles) this program
    batch_axis, head_axis, score_axes = axes
    one_item = partial(_mha_one_item, cfg=cfg, head_mask_axis=head_axis)
    table_axes = None if tables is None else 0
    stages = jax.vmap(one_item, in_axes=(None, 0, 0, 0, batch_axis, table_axes, dict(score_axes)))(
        params, x, x, x, allowed, tables, score_tables
    )
    P, T = x.shape[1], capacity
    kept = min(P, T)  # a prefill longer than the ring keeps its last T tokens
    slots = np.arange(P - kept, P) % T if cfg.window is not None else np.arange(kept)  # static: P and T are shapes
    keys, values = cached_heads(cfg, stages)  # what the scores and the weighted sum read
    new = {"k_cache": keys, "v_cache": values, "k_pos": q_pos, "k_valid": q_valid}
    cache = {name: cache[name].at[:, slots].set(new[name][:, P - kept :]) for name in _CACHE_NAMES}
    return cache, {name: stages[name] for name in decode_stage_names(cfg)}


def _step_program(cfg: MHAConfig, capacity: int, key: tuple, params, x, tables, extras, cache, index):
    """One step of s tokens: x (B, s, D); the cache written at ``index`` (traced) and attended to."""
    import jax

    TRACES[key] += 1  # runs only while JAX traces (and so compiles) this program
    attend = partial(_decode_attend, slots=capacity, ring=cfg.window is not None)
    one_item = partial(_mha_one_item, cfg=cfg, head_mask_axis=None, attend=attend)
    item = {**cache, **extras, "index": index}
    item_axes = {name: (None if name in ("slopes", "bucket_of", "index") else 0) for name in item}
    table_axes = None if tables is None else 0
    stages = jax.vmap(one_item, in_axes=(None, 0, 0, 0, None, table_axes, item_axes))(
        params, x, x, x, None, tables, item
    )
    return {name: stages[name] for name in _CACHE_NAMES}, {name: stages[name] for name in decode_stage_names(cfg)}
