"""Each library's attention called the way its users call it, on the canonical parameters and inputs.

Not this project's adapters, which map the differences away: the library's own module or function, fed
canonical parameters (`MHAParams`, biased) and row-sample inputs ``x (B, N, D)``, with a boolean mask of
the polarity that call takes. Each returns NumPy: ``(output (B, N, D) float64, weights (B, H, N, N) or
None)``; the explainer compares them with the spec. Each framework is imported inside its function.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, to_flax_params

from .._probe import importable
from ._needs import needs

# --- the projections every hand-built call shares (float64, NumPy) ------------------------------


def head_projections(cfg: MHAConfig, params: MHAParams, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as (B, N, H, d): tokens first, heads next, the layout JAX and Flax take."""
    p = params
    B, N = x.shape[:2]
    q = (x @ p.w_q.T + p.b_q).reshape(B, N, cfg.n_heads, cfg.d_k)  # (B, N, H, Dk)
    k = (x @ p.w_k.T + p.b_k).reshape(B, N, cfg.n_kv_heads, cfg.d_k)  # (B, N, Hkv, Dk)
    v = (x @ p.w_v.T + p.b_v).reshape(B, N, cfg.n_kv_heads, cfg.d_v)  # (B, N, Hkv, Dv)
    return q, k, v


def output_from_context(params: MHAParams, context_bnhd: np.ndarray) -> np.ndarray:
    """(B, N, H, Dv) context -> (B, N, D) output through w_o."""
    B, N = context_bnhd.shape[:2]
    merged = np.asarray(context_bnhd, dtype=np.float64).reshape(B, N, -1)  # (B, N, H*Dv)
    return merged @ params.w_o.T + params.b_o


@contextmanager
def jax_on_cpu_at_highest():
    """JAX work inside runs on the CPU with float32 products at full precision ("highest").

    On a machine whose JAX has a GPU, the default device is the GPU and its default float32
    matmul precision may be TF32 (errors ~1e-3): the demonstrations' verdicts (which keys a
    query used, what an empty row became, at atol 1e-4) must not depend on that. Without
    JAX installed it does nothing.
    """
    if not importable("jax"):
        yield
        return
    import jax

    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        yield


# --- each library's attention, called the way its users call it ---------------------------------


@needs("torch")
def torch_mha_call(cfg: MHAConfig, params: MHAParams, x: np.ndarray, blocked: np.ndarray, need_weights: bool):
    """nn.MultiheadAttention (float64, default sequence-first), ``blocked`` its (N, N) attn_mask (True = blocked).
    Returns (output (B, N, D), weights (B, H, N, N) | None)."""
    import torch

    from ..oracles.torch import loaded_torch_mha

    module = loaded_torch_mha(cfg, params, "float64", "cpu", batch_first=False)  # sequence first
    xt = torch.from_numpy(x).transpose(0, 1)  # (N, B, E): sequence first, as the default expects
    with torch.no_grad():
        out, weights = module(
            xt, xt, xt, attn_mask=torch.from_numpy(blocked), need_weights=need_weights, average_attn_weights=False
        )
    return out.transpose(0, 1).numpy(), None if weights is None else weights.numpy()


@needs("torch")
def torch_sdpa_call(cfg: MHAConfig, params: MHAParams, x: np.ndarray, allowed: np.ndarray):
    """F.scaled_dot_product_attention (float64) on the canonical projections; weights via an identity value."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(t).permute(0, 2, 1, 3) for t in head_projections(cfg, params, x))  # (B, H, N, d)
    attn_mask = torch.from_numpy(allowed)
    with torch.no_grad():
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, N, Dv)
        # With the identity matrix as values, the "context" is the attention-weight matrix itself.
        eye = torch.eye(k.shape[2], dtype=q.dtype).expand(q.shape[0], q.shape[1], -1, -1)  # (B, H, N, N)
        weights = F.scaled_dot_product_attention(q, k, eye, attn_mask=attn_mask)
    return output_from_context(params, context.permute(0, 2, 1, 3).numpy()), weights.numpy()


@needs("jax")
def jax_dpa_call(cfg: MHAConfig, params: MHAParams, x: np.ndarray, allowed: np.ndarray):
    """jax.nn.dot_product_attention (float32, layout (B, N, H, d)); weights via an identity value."""
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(t, dtype=jnp.float32) for t in head_projections(cfg, params, x))  # (B, N, H, d)
    jmask = jnp.asarray(allowed)[None, None]  # (1, 1, N, N)
    scale = cfg.scale
    context = jax.nn.dot_product_attention(q, k, v, mask=jmask, scale=scale)  # (B, N, H, Dv)
    # JAX wants values as wide as the queries, so q and k get zero columns (dot products
    # unchanged, scale passed explicitly) and the one-hot values are padded to the same width.
    B, N, H, Dk = q.shape
    width = max(Dk, N)
    pad = [(0, 0), (0, 0), (0, 0), (0, width - Dk)]
    eye = jnp.zeros((N, width), dtype=q.dtype).at[:, :N].set(jnp.eye(N, dtype=q.dtype))  # (N, width)
    values = jnp.broadcast_to(eye[None, :, None, :], (B, N, H, width))  # key j carries one-hot j
    weights = jax.nn.dot_product_attention(
        jnp.pad(q, pad), jnp.pad(k, pad), values, mask=jmask, scale=scale
    )  # (B, N, H, width)
    weights = np.asarray(weights)[..., :N].transpose(0, 2, 1, 3)  # (B, H, N, N)
    return output_from_context(params, np.asarray(context)), weights


@needs("flax")
def flax_mha_call(cfg: MHAConfig, params: MHAParams, x: np.ndarray, allowed: np.ndarray):
    """flax.linen.MultiHeadDotProductAttention (float32) loaded through the converter."""
    import flax.linen as fnn
    import jax.numpy as jnp

    module = fnn.MultiHeadDotProductAttention(num_heads=cfg.n_heads, qkv_features=cfg.q_width, out_features=cfg.d_model)
    variables = {"params": to_flax_params(cfg, params.astype(np.float32))}
    xj = jnp.asarray(x, dtype=jnp.float32)
    out = module.apply(variables, xj, xj, xj, mask=jnp.asarray(allowed)[None, None])  # (B, N, D)
    import flax.linen.attention as fattention

    q, k, _ = (jnp.asarray(t, dtype=jnp.float32) for t in head_projections(cfg, params, x))
    weights = fattention.dot_product_attention_weights(q, k, mask=jnp.asarray(allowed)[None, None])  # (B, H, N, N)
    return np.asarray(out, dtype=np.float64), np.asarray(weights)


@needs("equinox")
def equinox_mha_call(cfg: MHAConfig, params: MHAParams, x: np.ndarray, allowed: np.ndarray):
    """equinox.nn.MultiheadAttention (float32, unbatched by design: vmap over the batch)."""
    import jax
    import jax.numpy as jnp

    from ..oracles.equinox import loaded_equinox_mha

    module = loaded_equinox_mha(cfg, params.astype(np.float32), "float32", None)  # as the oracle does
    xj = jnp.asarray(x, dtype=jnp.float32)
    out = jax.vmap(lambda xb: module(xb, xb, xb, mask=jnp.asarray(allowed)))(xj)  # (B, N, D)
    return np.asarray(out, dtype=np.float64), None


# --- axis order ---------------------------------------------------------------------------------


@needs("jax", "torch")
def sdpa_and_dpa_axis_order(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, object]:
    """SDPA on (B, H, N, d) and jax.nn.dot_product_attention on (B, N, H, d), from ``q, k, v`` (B, N, H, d).

    Returns (SDPA's context, JAX's on its own layout, JAX's given SDPA's arrays read back as (B, N, H, d) or
    the exception it raised), every array (B, N, H, d) NumPy.
    """
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    torch_layout = [torch.from_numpy(t).permute(0, 2, 1, 3) for t in (q, k, v)]  # (B, H, N, d)
    expected = F.scaled_dot_product_attention(*torch_layout).permute(0, 2, 1, 3).numpy()  # back to (B, N, H, d)
    right = np.asarray(jax.nn.dot_product_attention(*(jnp.asarray(t, dtype=jnp.float32) for t in (q, k, v))))
    misfed = [jnp.asarray(t.numpy(), dtype=jnp.float32) for t in torch_layout]  # torch's (B, H, N, d) given to JAX
    try:
        wrong = np.asarray(jax.nn.dot_product_attention(*misfed)).transpose(0, 2, 1, 3)  # read back as (B, N, H, d)
    except Exception as error:  # a library refusing the call is itself the evidence
        return expected, right, error
    return expected, right, wrong


@needs("equinox")
def equinox_given_a_batch(cfg: MHAConfig, x: np.ndarray) -> Exception | None:
    """Call a fresh equinox.nn.MultiheadAttention on (B, N, D): None if it accepted, else what it raised."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    module = eqx.nn.MultiheadAttention(num_heads=cfg.n_heads, query_size=cfg.d_model, key=jax.random.PRNGKey(0))
    xj = jnp.asarray(x, dtype=jnp.float32)
    try:
        module(xj, xj, xj)
    except Exception as error:
        return error
    return None
