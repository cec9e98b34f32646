"""``jax-best``'s programs: the forward and the decode step as pure functions of (in, out) weights, the one
``TRACES`` counter of their traces, and the conversion of canonical parameters and inputs into their arguments
(`backends.best.jax` jits them; see there why the weights are (in, out) and the cache (B*Hkv, C, d))."""

from __future__ import annotations

from collections import Counter

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions, rotary_tables

from ..jax.common import jax_inputs, rotate_last_axis, softmax_with_empty_rows, to_jax
from .common import folded_allowed

# Traces of each program key (a counter bumped inside the traced functions, which run only when JAX traces).
TRACES: Counter = Counter()


# -- the programs ---------------------------------------------------------------------------------------
def _linear(p: dict, x, name: str):
    """``x @ W + b`` with W stored (in, out): (..., in) -> (..., out)."""
    y = x @ p[f"w_{name}"]
    bias = p[f"b_{name}"]
    return y if bias is None else y + bias


def _rotate(cfg: MHAConfig, heads, tables):
    """Rotary on heads (B, N, n, Dk) with tables (cos, sin) (1|B, N, r/2); the heads themselves without rope."""
    if tables is None:
        return heads
    cos, sin = (t[:, :, None, :] for t in tables)  # (1|B, N, 1, r/2)
    return rotate_last_axis(heads, cos, sin, cfg.rope)


def _softmax(scores, allowed):
    """Softmax over the keys; with a mask, a row with no allowed key gives zeros (the spec's answer). Without
    one no row can be empty, and ``jax.nn.softmax`` skips that test (4% of a forward at B=4, N=512, D=512)."""
    import jax

    return jax.nn.softmax(scores, axis=-1) if allowed is None else softmax_with_empty_rows(scores)


def _softmax_over_slots(scores, allowed):
    """Softmax over the slots, axis 1 of a step's scores (B*Hkv, C, G*s); with a mask, a query row that sees no
    slot gives zeros (the spec's answer: ``jax.nn.softmax`` gives NaN for it)."""
    import jax
    import jax.numpy as jnp

    weights = jax.nn.softmax(scores, axis=1)
    return weights if allowed is None else jnp.where(jnp.any(allowed, axis=1, keepdims=True), weights, 0)


def best_forward(cfg: MHAConfig, p: dict, x_q, x_k, x_v, tables, allowed, stages: bool = False):
    """The forward, (B, Nq, D); with ``stages`` every stage by name instead (the untimed stage dump).

    ``tables``: (q_cos, q_sin, k_cos, k_sin) (1|B, N, r/2) or None; ``allowed``: (1|B, Hkv|1, G*Nq, Nk)
    bool (True = may attend; `folded_forward_allowed`) or None.
    """
    import jax.numpy as jnp

    B, Nq, _ = x_q.shape
    Nk = x_k.shape[1]
    H, Hkv, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v
    q, k, v = _linear(p, x_q, "q"), _linear(p, x_k, "k"), _linear(p, x_v, "v")  # (B, N, n*d)
    q_heads, k_heads = q.reshape(B, Nq, H, Dk), k.reshape(B, Nk, Hkv, Dk)
    v_heads = v.reshape(B, Nk, Hkv, Dv)
    q_rotated = _rotate(cfg, q_heads, None if tables is None else tables[:2])  # (B, Nq, H, Dk)
    k_rotated = _rotate(cfg, k_heads, None if tables is None else tables[2:])  # (B, Nk, Hkv, Dk)
    # Heads first for the products (the activations' transposes, O(N D), are all XLA moves), each group's query
    # heads folded into the query rows of their kv head, (B, Hkv, G*Nq, Dk): 4-D products with no unit axis.
    # Tokens first, XLA transposed the scores (B=4, N=512, D=512, 8 heads on 2, float32, CPU time: 130 ms; heads
    # first 104, the jax adapter 111); a unit group axis (G=1) made it copy them.
    q_folded = (q_rotated * cfg.scale).reshape(B, Nq, Hkv, G, Dk).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * Nq, Dk)
    k_first, v_first = k_rotated.transpose(0, 2, 1, 3), v_heads.transpose(0, 2, 1, 3)  # (B, Hkv, Nk, d)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q_folded, k_first)  # (B, Hkv, G*Nq, Nk)
    masked = scores if allowed is None else jnp.where(allowed, scores, -jnp.inf)
    weights = _softmax(masked, allowed)
    context = jnp.einsum("bhqk,bhkd->bhqd", weights, v_first)  # (B, Hkv, G*Nq, Dv)
    context = context.reshape(B, Hkv, G, Nq, Dv).transpose(0, 3, 1, 2, 4).reshape(B, Nq, H, Dv)  # (B, Nq, H, Dv)
    merged = context.reshape(B, Nq, H * Dv)
    output = _linear(p, merged, "o")  # (B, Nq, D)
    if not stages:
        return output
    by_head = (B, H, Nq, Nk)
    return dict(
        q=q, k=k, v=v, q_heads=q_heads, k_heads=k_heads, v_heads=v_heads, q_rotated=q_rotated, k_rotated=k_rotated,
        scores=scores.reshape(by_head), masked_scores=masked.reshape(by_head), weights=weights.reshape(by_head),
        context=context, merged=merged, output=output,
    )  # fmt: skip


def best_step(cfg: MHAConfig, key: tuple, p: dict, x, k_cache, v_cache, index, tables, allowed, stages: bool = False):
    """One decode chunk: ``x`` (B, s, D) written to slots ``index ..`` of the caches (B*Hkv, C, d), then attending
    over every slot; returns (output (B, s, D), k_cache, v_cache); with ``stages`` every stage by name instead
    (in the step's own layouts, the caches as ``k_cache`` and ``v_cache``: what ``bench --breakdown`` cuts).

    ``tables``: (cos, sin) (1|B, s, r/2) or None; ``allowed``: (B*Hkv, C, G*s) bool, each slot's folded query
    rows (`common.folded_allowed`, slots first), or None when every slot is seen.

    The scores are slots first, (B*Hkv, C, G*s): ``K @ q.T``, the cache the rows of the product and the few
    query rows its columns; the context contracts the slots of both. XLA:CPU reads the keys about twice as
    fast that way as ``q @ K.T`` (the query rows first): one token's scores (16 heads over 4 kv heads, d_k
    128, float32, one pinned core, Intel Xeon, jax 0.10.2, `scripts/xla-decode-costs`, two runs) read them
    at 23-26 GB/s against 11-14 at B=1 (1k-32k keys), and at 13 against 7-7.4 at B=4, 32k.
    """
    import jax.numpy as jnp
    from jax import lax

    TRACES[key] += 1  # runs when JAX traces, so it counts compilations
    B, s, _ = x.shape
    H, Hkv, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v
    q_proj, k_proj, v_proj = _linear(p, x, "q"), _linear(p, x, "k"), _linear(p, x, "v")  # (B, s, n*d)
    q_heads, k_heads = q_proj.reshape(B, s, H, Dk), k_proj.reshape(B, s, Hkv, Dk)  # (B, s, n, Dk)
    v = v_proj.reshape(B, s, Hkv, Dv)  # (B, s, Hkv, Dv)
    q, k = _rotate(cfg, q_heads, tables), _rotate(cfg, k_heads, tables)  # (B, s, H, Dk), (B, s, Hkv, Dk)
    zero = jnp.zeros((), index.dtype)
    k_cache = lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3).reshape(B * Hkv, s, Dk), (zero, index, zero))
    v_cache = lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).reshape(B * Hkv, s, Dv), (zero, index, zero))
    q_folded = (q * cfg.scale).reshape(B, s, Hkv, G, Dk).transpose(0, 2, 3, 1, 4).reshape(B * Hkv, G * s, Dk)
    scores = jnp.einsum("ntd,nqd->ntq", k_cache, q_folded)  # (B*Hkv, C, G*s): each kv head read once, slots first
    masked = scores if allowed is None else jnp.where(allowed, scores, -jnp.inf)
    weights = _softmax_over_slots(masked, allowed)
    context = jnp.einsum("ntq,ntd->nqd", weights, v_cache)  # (B*Hkv, G*s, Dv)
    merged = context.reshape(B, Hkv, G, s, Dv).transpose(0, 3, 1, 2, 4).reshape(B, s, H * Dv)  # (B, s, H*Dv)
    output = _linear(p, merged, "o")  # (B, s, D)
    if not stages:
        return output, k_cache, v_cache
    return dict(
        q=q_proj, k=k_proj, v=v_proj, q_heads=q_heads, k_heads=k_heads, v_heads=v, q_rotated=q, k_rotated=k,
        k_cache=k_cache, v_cache=v_cache, scores=scores, masked_scores=masked, weights=weights, context=context,
        merged=merged, output=output,
    )  # fmt: skip


# -- converting once --------------------------------------------------------------------------------------
def weights_in_out(params: MHAParams, dtype: str, target) -> dict:
    """w_q ... w_o transposed to (in, out) (contiguous copies, once), biases as they are: JAX arrays on ``target``."""
    return {
        name: to_jax(None if value is None else (value.T if name.startswith("w_") else value), dtype, target)
        for name, value in params.as_dict().items()
    }


def folded_forward_allowed(cfg: MHAConfig, allowed: np.ndarray | None) -> np.ndarray | None:
    """(1|B, 1|H, Nq, Nk) -> (1|B, Hkv|1, G*Nq, Nk), the folded query rows of `best_forward`'s scores; None stays.

    Head h = g*G + i of a per-head mask is row block i of kv head g (a reshape); a mask shared by the heads
    repeats for each of a group's G heads (`common.folded_allowed`)."""
    if allowed is None:
        return None
    allowed = np.ascontiguousarray(allowed)
    b, h, Nq, Nk = allowed.shape
    if h == 1:
        return np.ascontiguousarray(folded_allowed(allowed, cfg.group_size))  # (1|B, 1, G*Nq, Nk)
    return allowed.reshape(b, cfg.n_kv_heads, cfg.group_size * Nq, Nk)  # (1|B, Hkv, G*Nq, Nk)


def forward_args(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, target) -> tuple:
    """(p, x_q, x_k, x_v, tables, allowed) on ``target``: `best_forward`'s arguments."""
    tables = rotary_tables(cfg, inputs)
    if tables is not None:
        tables = tuple(to_jax(t, dtype, target) for t in (tables.q_cos, tables.q_sin, tables.k_cos, tables.k_sin))
    allowed = to_jax(folded_forward_allowed(cfg, allowed_positions(cfg, inputs)), None, target)
    return (weights_in_out(params, dtype, target), *jax_inputs(inputs, dtype, target), tables, allowed)
