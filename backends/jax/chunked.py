"""The chunked (memory-linear) strategy of the JAX adapter: `lax.map` over query blocks,
`lax.fori_loop` over key blocks, one head written unbatched and `jax.vmap` over heads, jitted.

The recurrence is the one described in `_chunking`, written for one head as the JAX
adapter writes everything: ``q (Nq, Dk)``, ``k (Nk, Dk)``, ``v (Nk, Dv)``. It replaces the
adapter's attention step only (`layer._mha_one_item` takes it as ``attend``): the
projections, rotary embedding, head split and merge are the adapter's own. XLA needs static
shapes, so the token axes are padded up to whole blocks (padding keys are masked by
their index, padding queries are cut off at the end): the blocks need not divide the
token counts. `lax.map` walks the query blocks one after another (a `vmap` would hold
every tile at once); for each, `lax.fori_loop` walks the key blocks, and under a causal
mask its trip count stops at the diagonal, so blocks above it are never computed. The
causal mask is computed per tile from the indices; a user mask is read a tile at a time
with `lax.dynamic_slice`. Under `vmap` each step computes one tile per head.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs

from .._chunking import CHUNKED_HIDDEN_STAGES, resolve_chunk
from .._layouts import TOKENS_FIRST_STAGE_AXES

# Tokens first, like the rest of the JAX adapter; the score-like stages do not exist here.
CHUNKED_STAGE_AXES = {name: axes for name, axes in TOKENS_FIRST_STAGE_AXES.items() if name not in CHUNKED_HIDDEN_STAGES}


def _blocks(n: int, block: int) -> int:
    return -(-n // block)  # ceil(n / block)


def _chunked_one_head(q, k, v, allowed, *, scale, causal, q_block, k_block, n_k):
    """Online-softmax attention of one head: q (Nq_pad, Dk), k (Nk_pad, Dk), v (Nk_pad, Dv),
    allowed (Nq_pad, Nk_pad) or None; token axes padded to whole blocks. Returns (Nq_pad, Dv)."""
    import jax.numpy as jnp
    from jax import lax

    compute = jnp.promote_types(q.dtype, jnp.float32)  # half precision accumulates in float32
    q, k, v = q.astype(compute), k.astype(compute), v.astype(compute)
    n_k_blocks = k.shape[0] // k_block

    def one_query_block(i):
        q_start = i * q_block
        queries = lax.dynamic_slice_in_dim(q, q_start, q_block) * scale  # (qb, Dk)
        q_pos = q_start + jnp.arange(q_block)  # (qb,)

        def one_key_block(j, carry):
            peak, total, acc = carry  # (qb, 1), (qb, 1), (qb, Dv)
            k_start = j * k_block
            keys = lax.dynamic_slice_in_dim(k, k_start, k_block)  # (kb, Dk)
            values = lax.dynamic_slice_in_dim(v, k_start, k_block)  # (kb, Dv)
            tile = queries @ keys.T  # (qb, kb): the one score tile of this head
            k_pos = k_start + jnp.arange(k_block)  # (kb,)
            ok = jnp.broadcast_to(k_pos[None, :] < n_k, tile.shape)  # padding keys are never attended to
            if causal:
                ok = ok & (k_pos[None, :] <= q_pos[:, None])
            if allowed is not None:  # a token axis of length 1 broadcasts (padding masks): read it whole
                starts = [start if n > 1 else 0 for start, n in zip((q_start, k_start), allowed.shape, strict=True)]
                sizes = [block if n > 1 else 1 for block, n in zip((q_block, k_block), allowed.shape, strict=True)]
                ok = ok & lax.dynamic_slice(allowed, starts, sizes)
            tile = jnp.where(ok, tile, -jnp.inf)
            new_peak = jnp.maximum(peak, tile.max(axis=-1, keepdims=True))
            # Nothing allowed yet: peak stays -inf and the shift is 0, so exp(-inf) = 0, never NaN.
            shift = jnp.where(jnp.isneginf(new_peak), 0.0, new_peak)
            p = jnp.exp(tile - shift)
            rescale = jnp.exp(peak - shift)  # exp(old peak - new peak): 0 where nothing was seen
            return new_peak, total * rescale + p.sum(axis=-1, keepdims=True), acc * rescale + p @ values

        # Causal (top-left): keys from the block's last query + 1 on are masked, so the loop stops there.
        stop = jnp.minimum(n_k_blocks, (q_start + q_block + k_block - 1) // k_block) if causal else n_k_blocks
        init = (
            jnp.full((q_block, 1), -jnp.inf, compute),
            jnp.zeros((q_block, 1), compute),
            jnp.zeros((q_block, v.shape[-1]), compute),
        )
        _, total, acc = lax.fori_loop(0, stop, one_key_block, init)
        # A query that saw no allowed key has total 0 and acc 0: dividing by 1 gives the spec's zero.
        return acc / jnp.where(total > 0, total, 1.0)  # (qb, Dv)

    n_q_blocks = q.shape[0] // q_block
    context = lax.map(one_query_block, jnp.arange(n_q_blocks))  # (nqb, qb, Dv), one block after another
    return context.reshape(n_q_blocks * q_block, -1)  # (Nq_pad, Dv)


def _pad_tokens(x, target: int):
    """(N, ...) -> (target, ...) with zeros after the last token (a copy, linear in N)."""
    import jax.numpy as jnp

    return jnp.pad(x, [(0, target - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _chunked_all_heads(q_heads, k_heads, v_heads, allowed, *, cfg: MHAConfig, head_mask_axis, chunk):
    """`_chunked_one_head` vmapped over the heads, the JAX adapter's way (`layer._attend_all_heads`).

    q_heads (Nq, H, Dk), k_heads (Nk, Hkv, Dk), v_heads (Nk, Hkv, Dv), rotated where rope is on;
    ``allowed`` padded to whole blocks (`pad_mask_to_blocks`). Returns the context (Nq, H, Dv) only.
    """
    import jax

    q_block, k_block = chunk
    n_q, n_k = q_heads.shape[0], k_heads.shape[0]
    H, Hkv, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v
    q_pad, k_pad = _blocks(n_q, q_block) * q_block, _blocks(n_k, k_block) * k_block
    q_heads = _pad_tokens(q_heads, q_pad)  # (Nq_pad, H, Dk)
    k_heads = _pad_tokens(k_heads, k_pad)  # (Nk_pad, Hkv, Dk)
    v_heads = _pad_tokens(v_heads, k_pad)  # (Nk_pad, Hkv, Dv)
    one_head = partial(_chunked_one_head, scale=cfg.scale, causal=cfg.causal, q_block=q_block, k_block=k_block, n_k=n_k)
    if G == 1:
        context = jax.vmap(one_head, in_axes=(1, 1, 1, head_mask_axis), out_axes=1)(q_heads, k_heads, v_heads, allowed)
    else:
        # GQA as in the JAX adapter: the inner vmap shares a group's k and v (in_axes None), the outer maps the groups.
        q_groups = q_heads.reshape(q_pad, Hkv, G, Dk)  # (Nq_pad, Hkv, G, Dk)
        over_group = jax.vmap(one_head, in_axes=(1, None, None, head_mask_axis), out_axes=1)
        over_groups = jax.vmap(over_group, in_axes=(1, 1, 1, head_mask_axis), out_axes=1)
        context = over_groups(q_groups, k_heads, v_heads, allowed)  # (Nq_pad, Hkv, G, Dv)
    # (Nq, H, Dv): padding queries cut off, back in the storage dtype.
    return {"context": context[:n_q].reshape(n_q, H, Dv).astype(q_heads.dtype)}


def chunked_attention(cfg: MHAConfig, inputs: MHAInputs, chunk: tuple[int, int] | None):
    """(attend, chunk): the function that replaces `_attend_all_heads` in `layer._mha_one_item`,
    and the blocks it uses (the defaults where None, cut to the token counts)."""
    chunk = resolve_chunk(chunk, inputs.q_tokens, inputs.kv_tokens)
    return partial(_chunked_all_heads, chunk=chunk), chunk


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
