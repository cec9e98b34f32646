"""The chunked (memory-linear) strategy of the JAX adapter: `lax.map` over query blocks,
`lax.fori_loop` over key blocks, one head written unbatched and `jax.vmap` over heads, jitted.

The recurrence is the one described in `_chunking`, written for one head as the JAX
adapter writes everything: ``q (Nq, Dk)``, ``k (Nk, Dk)``, ``v (Nk, Dv)``. It replaces the
adapter's attention step only (`layer._mha_one_item` takes it as ``attend``): the
projections, QK-norm, rotary embedding, head split and merge are the adapter's own. XLA
needs static shapes, so the token axes are padded up to whole blocks (padding keys are
masked by their index, padding queries are cut off at the end): the blocks need not divide
the token counts. `lax.map` walks the query blocks one after another (a `vmap` would hold
every tile at once); for each, `lax.fori_loop` walks the key blocks, and under a causal
mask its trip count stops at the last key block some query of the block may see, so blocks
after every query's position are never computed. The causal mask is computed per tile from
the token positions (``p_j <= p_i``, `core.inputs.causal_allowed`: top-left with the default
positions, bottom-right on a decode step's), and the trip counts come from the same positions
(`_chunking.key_block_end`, in NumPy at prepare time); a user mask is read a tile at a time
with `lax.dynamic_slice`. Under `vmap` each step computes one tile per head.

The variants, carried tile by tile in the order of the stages:

* the score steps run on each tile (`frameworks.ops.masked_scores`), ALiBi's bias from the tile's
  positions (``slope * (p_j - p_i)``, no (Nq, Nk) table); T5's buckets are computed in NumPy at
  prepare time (`core.variants.t5_buckets`, its float32 logarithm bit for bit) and read a
  tile at a time like the user mask, the gather from ``rel_bias`` being the tile's own;
* the window is computed per tile from the positions. With the default positions (the
  indices) the key loop also starts at the first block the window reaches, and without
  ``causal`` stops at the last, so whole tiles outside the window are never visited; with
  other positions every tile is visited and masked (the positions need not be sorted);
* the sinks start the online softmax (`frameworks.ops.online_start`, as `_chunking` says).

The scores, capped and biased scores and the weights are never held whole
(`chunked_hidden`).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES
from mha_rosetta.core.variants import relative_distances, t5_buckets

from .._chunking import CHUNKED_HIDDEN_STAGES, key_block_end, resolve_chunk
from ..frameworks.ops import masked_scores, online_start
from ..frameworks.ops_jax import TRACED_OPS
from ..frameworks.score_parts import distance_slopes, picked_parts
from .common import temperature_table

# The variants' score stages, which the chunked step holds one tile at a time, like the scores.
VARIANT_SCORE_STAGES = SCORE_VARIANT_STAGES


def chunked_hidden(cfg: MHAConfig) -> tuple[str, ...]:
    """The stages of ``cfg`` the chunked strategy never holds whole: every score-like stage."""
    return tuple(dict.fromkeys((*CHUNKED_HIDDEN_STAGES, *VARIANT_SCORE_STAGES)))  # once, whoever lists them


def _blocks(n: int, block: int) -> int:
    return -(-n // block)  # ceil(n / block)


def _key_block_range(q_start, stop, n_k_blocks: int, *, cfg: MHAConfig, q_block: int, k_block: int, skip: bool):
    """(first, stop) key blocks the query block starting at ``q_start`` must visit.

    Causal: ``stop`` is the block's entry of the ``k_stop`` table (`chunked_tables`: on the positions,
    the key blocks after the last one some query of the block may see are masked); without causal,
    every block. ``skip`` (the positions are the indices): the window of W keys starts W - 1 before
    the block's first query, and without causal ends W - 1 after its last.
    """
    import jax.numpy as jnp

    first = 0
    if not cfg.causal:
        stop = n_k_blocks
    if skip and cfg.window is not None:
        first = jnp.maximum(0, (q_start - cfg.window + 1) // k_block)
        if not cfg.causal:
            stop = jnp.minimum(n_k_blocks, (q_start + q_block - 1 + cfg.window - 1) // k_block + 1)
    if skip and cfg.attention_chunk_size is not None:  # Llama 4's chunks: from the first query's chunk start
        C = cfg.attention_chunk_size
        first = jnp.maximum(first, (q_start // C * C) // k_block)
        if not cfg.causal:  # to the last query's chunk end
            stop = jnp.minimum(stop, (((q_start + q_block - 1) // C + 1) * C - 1) // k_block + 1)
    return first, stop


def _chunked_one_head(q, k, v, allowed, head, item, *, cfg: MHAConfig, q_block, k_block, n_k, skip):
    """Online-softmax attention of one head: q (Nq_pad, Dk), k (Nk_pad, Dk), v (Nk_pad, Dv),
    allowed (Nq_pad, Nk_pad) or None; token axes padded to whole blocks. Returns (Nq_pad, Dv).

    ``head``: this head's score parts by keyword, ``slope`` and ``rel`` (buckets,) where its variants are on;
    ``item``: this batch item's ``q_pos`` (Nq_pad,), ``k_pos`` (Nk_pad,) and ``bucket``
    (Nq_pad, Nk_pad), where needed, and the key-block trip counts ``k_stop`` (n_q_blocks,) under
    causal (`chunked_tables`).
    """
    import jax.numpy as jnp
    from jax import lax

    compute = jnp.promote_types(q.dtype, jnp.float32)  # half precision accumulates in float32
    q, k, v = q.astype(compute), k.astype(compute), v.astype(compute)
    n_k_blocks = k.shape[0] // k_block

    def one_query_block(i):
        q_start = i * q_block
        queries = lax.dynamic_slice_in_dim(q, q_start, q_block) * cfg.scale  # (qb, Dk)
        q_pos = lax.dynamic_slice_in_dim(item["q_pos"], q_start, q_block) if "q_pos" in item else None  # (qb,)

        def one_key_block(j, carry):
            peak, total, acc = carry  # (qb, 1), (qb, 1), (qb, Dv)
            k_start = j * k_block
            keys = lax.dynamic_slice_in_dim(k, k_start, k_block)  # (kb, Dk)
            values = lax.dynamic_slice_in_dim(v, k_start, k_block)  # (kb, Dv)
            tile = queries @ keys.T  # (qb, kb): the one score tile of this head
            if q_pos is not None:
                k_pos = lax.dynamic_slice_in_dim(item["k_pos"], k_start, k_block)  # (kb,)
                distance = k_pos[None, :] - q_pos[:, None]  # (qb, kb): p_j - p_i
            bias = None
            if "slope" in head:  # a distance's slope (`score_parts.distance_slopes`: ALiBi's)
                bias = head["slope"].astype(compute) * distance.astype(compute)
            if cfg.rel_buckets is not None:
                bucket = lax.dynamic_slice(item["bucket"], (q_start, k_start), (q_block, k_block))  # (qb, kb)
                rel = head["rel"].astype(compute)[bucket]
                bias = rel if bias is None else bias + rel
            k_idx = k_start + jnp.arange(k_block)  # (kb,)
            ok = jnp.broadcast_to(k_idx[None, :] < n_k, tile.shape)  # padding keys are never attended to
            if cfg.causal:  # on the positions (core.inputs.causal_allowed): p_j <= p_i
                ok = ok & (distance <= 0)
            if cfg.window is not None:  # on the positions (core.variants.window_allowed)
                ok = ok & ((distance > -cfg.window) if cfg.causal else (jnp.abs(distance) < cfg.window))
            if cfg.attention_chunk_size is not None:  # Llama 4's chunks (core.variants.chunk_allowed)
                C = cfg.attention_chunk_size
                ok = ok & (k_pos[None, :] // C == q_pos[:, None] // C)
            if allowed is not None:  # a token axis of length 1 broadcasts (padding masks): read it whole
                starts = [start if n > 1 else 0 for start, n in zip((q_start, k_start), allowed.shape, strict=True)]
                sizes = [block if n > 1 else 1 for block, n in zip((q_block, k_block), allowed.shape, strict=True)]
                ok = ok & lax.dynamic_slice(allowed, starts, sizes)
            tile = masked_scores(TRACED_OPS, cfg, tile, bias=bias, blocked=~ok)  # the compute dtype throughout
            new_peak = jnp.maximum(peak, tile.max(axis=-1, keepdims=True))
            # Nothing allowed yet: peak stays -inf and the shift is 0, so exp(-inf) = 0, never NaN.
            shift = jnp.where(jnp.isneginf(new_peak), 0.0, new_peak)
            p = jnp.exp(tile - shift)
            rescale = jnp.exp(peak - shift)  # exp(old peak - new peak): 0 where nothing was seen
            return new_peak, total * rescale + p.sum(axis=-1, keepdims=True), acc * rescale + p @ values

        # The trip count in the loop index's integer type (int64 under x64), which the tile offsets share.
        stop = item["k_stop"][i].astype(jnp.asarray(q_start).dtype) if cfg.causal else n_k_blocks
        first, stop = _key_block_range(q_start, stop, n_k_blocks, cfg=cfg, q_block=q_block, k_block=k_block, skip=skip)
        acc = jnp.zeros((q_block, v.shape[-1]), compute)
        parts = picked_parts(cfg, head)  # this head's score parts, scalars
        peak, total = online_start(TRACED_OPS, parts, (q_block, 1), compute)  # from the sink, where on
        _, total, acc = lax.fori_loop(first, stop, one_key_block, (peak, total, acc))
        # A query that saw no allowed key has total 0 (or the sink's share) and acc 0: the spec's zero.
        return acc / jnp.where(total > 0, total, 1.0)  # (qb, Dv)

    n_q_blocks = q.shape[0] // q_block
    context = lax.map(one_query_block, jnp.arange(n_q_blocks))  # (nqb, qb, Dv), one block after another
    return context.reshape(n_q_blocks * q_block, -1)  # (Nq_pad, Dv)


def _pad_tokens(x, target: int):
    """(N, ...) -> (target, ...) with zeros after the last token (a copy, linear in N)."""
    import jax.numpy as jnp

    return jnp.pad(x, [(0, target - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _chunked_all_heads(
    q_heads, k_heads, v_heads, allowed, head, item, *, cfg: MHAConfig, head_mask_axis, chunk, skip: bool
):
    """`_chunked_one_head` vmapped over the heads, the JAX adapter's way (`layer._attend_all_heads`).

    q_heads (Nq, H, Dk), k_heads (Nk, Hkv, Dk), v_heads (Nk, Hkv, Dv), rotated where rope is on;
    ``allowed`` padded to whole blocks (`pad_mask_to_blocks`); ``head`` (`layer.head_owned`) mapped
    with the query heads, ``item`` (`chunked_tables`) shared by them. Returns the context (Nq, H, Dv) only.
    """
    import jax

    q_block, k_block = chunk
    n_q, n_k = q_heads.shape[0], k_heads.shape[0]
    H, Hkv, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v
    q_pad, k_pad = _blocks(n_q, q_block) * q_block, _blocks(n_k, k_block) * k_block
    q_heads = _pad_tokens(q_heads, q_pad)  # (Nq_pad, H, Dk)
    k_heads = _pad_tokens(k_heads, k_pad)  # (Nk_pad, Hkv, Dk)
    v_heads = _pad_tokens(v_heads, k_pad)  # (Nk_pad, Hkv, Dv)
    one_head = partial(_chunked_one_head, cfg=cfg, q_block=q_block, k_block=k_block, n_k=n_k, skip=skip)
    if G == 1:
        over_heads = jax.vmap(one_head, in_axes=(1, 1, 1, head_mask_axis, 0, None), out_axes=1)
        context = over_heads(q_heads, k_heads, v_heads, allowed, head, item)  # (Nq_pad, H, Dv)
    else:
        # GQA as in the JAX adapter: the inner vmap shares a group's k and v (in_axes None), the outer maps the groups.
        q_groups = q_heads.reshape(q_pad, Hkv, G, Dk)  # (Nq_pad, Hkv, G, Dk)
        head = {name: value.reshape(Hkv, G, *value.shape[1:]) for name, value in head.items()}  # (Hkv, G, ...)
        over_group = jax.vmap(one_head, in_axes=(1, None, None, head_mask_axis, 0, None), out_axes=1)
        over_groups = jax.vmap(over_group, in_axes=(1, 1, 1, head_mask_axis, 0, None), out_axes=1)
        context = over_groups(q_groups, k_heads, v_heads, allowed, head, item)  # (Nq_pad, Hkv, G, Dv)
    # (Nq, H, Dv): padding queries cut off, back in the storage dtype.
    return {"context": context[:n_q].reshape(n_q, H, Dv).astype(q_heads.dtype)}


def _positions_are_indices(inputs: MHAInputs) -> bool:
    """True when the token positions are 0..N-1 (the defaults), so a window is a band of the indices."""
    return all(
        np.array_equal(positions, np.arange(positions.shape[-1])[None])
        for positions in (inputs.positions, inputs.kv_positions)
    )


def chunked_tables(cfg: MHAConfig, inputs: MHAInputs, chunk: tuple[int, int], dtype: str) -> tuple[dict, dict]:
    """The tables `_chunked_one_head` reads, padded to whole blocks, and their batch in_axes.

    ``slopes`` (H,) ALiBi's per-head slopes (float32, float64 for float64; never per item), ``q_pos``/``k_pos``
    (1|B, N_pad) int32 when causality, the window or ALiBi reads the positions; ``bucket``
    (1|B, Nq_pad, Nk_pad) int32, T5's buckets (`core.variants.t5_buckets`), with relative bias;
    ``k_stop`` (n_q_blocks,) int32 under causal, each query block's key-block trip count
    (`_chunking.key_block_end` on the positions, one for every batch item, so never mapped). A
    table shared by every batch item loses its batch axis and is left unmapped. NumPy, untimed.
    """
    q_pad = _blocks(inputs.q_tokens, chunk[0]) * chunk[0]
    k_pad = _blocks(inputs.kv_tokens, chunk[1]) * chunk[1]
    tables = {}
    slopes = distance_slopes(cfg)  # (H,) float64 or None: ALiBi's, on the positions
    if cfg.causal or cfg.window is not None or slopes is not None or cfg.attention_chunk_size is not None:
        # Padding positions are never read: padding keys are masked by index, padding queries cut off.
        tables["q_pos"] = np.pad(inputs.positions, [(0, 0), (0, q_pad - inputs.q_tokens)]).astype(np.int32)
        tables["k_pos"] = np.pad(inputs.kv_positions, [(0, 0), (0, k_pad - inputs.kv_tokens)]).astype(np.int32)
    if cfg.rel_buckets is not None:
        distance = relative_distances(inputs.positions, inputs.kv_positions)  # (1|B, Nq, Nk)
        buckets = t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)
        pad = [(0, 0), (0, q_pad - inputs.q_tokens), (0, k_pad - inputs.kv_tokens)]
        tables["bucket"] = np.pad(buckets, pad).astype(np.int32)  # (1|B, Nq_pad, Nk_pad)
    axes = {}
    if cfg.causal:
        q_block, k_block = chunk
        stops = [
            _blocks(
                key_block_end(
                    (q_start, min(q_start + q_block, inputs.q_tokens)),
                    inputs.kv_tokens,
                    True,
                    inputs.positions,
                    inputs.kv_positions,
                ),
                k_block,
            )
            for q_start in range(0, q_pad, q_block)
        ]
        tables["k_stop"], axes["k_stop"] = np.asarray(stops, dtype=np.int32), None  # (n_q_blocks,)
    if slopes is not None:
        float_dtype = np.float64 if dtype == "float64" else np.float32
        tables["slopes"], axes["slopes"] = slopes.astype(float_dtype), None  # (H,)
    tables.update(temperature_table(cfg, inputs.positions, dtype))  # (1|B, Nq) unpadded: read before the tiles
    for name, table in tables.items():
        if name in ("slopes", "k_stop"):
            continue
        shared = table.shape[0] == 1
        tables[name], axes[name] = (table[0], None) if shared else (table, 0)
    return tables, axes


def chunked_attention(cfg: MHAConfig, inputs: MHAInputs, chunk: tuple[int, int] | None, dtype: str):
    """(attend, chunk, (tables, axes), skipping): the function that replaces `_attend_all_heads` in
    `layer._mha_one_item`, the blocks it uses (the defaults where None, cut to the token counts),
    its per-item tables (`chunked_tables`) and, in words, which tiles it skips (for ``Prepared.info``).
    ``attend``'s keywords are everything it closes over (`layer.vmapped_pass` keys the program by them)."""
    chunk = resolve_chunk(chunk, inputs.q_tokens, inputs.kv_tokens)
    local = cfg.window is not None or cfg.attention_chunk_size is not None  # a window or Llama 4's chunks
    skip = local and _positions_are_indices(inputs)
    skipping = "key blocks after every query's position (causal on the positions)" if cfg.causal else "none"
    if cfg.window is not None:
        skipping = (
            f"key blocks outside the window of {cfg.window} (and after every query's position)"
            if skip
            else "none by index (custom positions): every tile masked by the window on the positions"
        )
    if cfg.attention_chunk_size is not None:
        skipping = (
            f"key blocks outside each query block's chunks of {cfg.attention_chunk_size} positions"
            if skip
            else "none by index (custom positions): every tile masked by the chunks on the positions"
        )
    attend = partial(_chunked_all_heads, chunk=chunk, skip=skip)
    return attend, chunk, chunked_tables(cfg, inputs, chunk, dtype), skipping


def pad_mask_to_blocks(allowed, inputs: MHAInputs, chunk: tuple[int, int]):
    """The user's mask (shaped by `mask_for_vmap`) with its token axes padded to whole blocks
    with False (never allowed); an axis of length 1 broadcasts and stays. NumPy, untimed."""
    if allowed is None:
        return None
    q_pad = _blocks(inputs.q_tokens, chunk[0]) * chunk[0]
    k_pad = _blocks(inputs.kv_tokens, chunk[1]) * chunk[1]
    n_q, n_k = allowed.shape[-2:]
    pad = [(0, 0)] * (allowed.ndim - 2) + [(0, q_pad - n_q if n_q > 1 else 0), (0, k_pad - n_k if n_k > 1 else 0)]
    return np.pad(allowed, pad, constant_values=False)
