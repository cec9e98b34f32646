"""The result of a demonstration (`Difference`) and each library's attention called the way its users call it.

Not this project's adapters, which map the differences away: the library's own module or function,
fed the seed setup's parameters and inputs. Each framework is imported inside its function.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from mha_rosetta.core import (
    to_flax_params,
    torch_mha_unsupported_reason,
)

from ..seed_setup import Setup


@dataclass
class Difference:
    key: str
    title: str
    status: str  # "demonstrated" or "skipped: <reason>"
    rows: list[tuple[str, str]] = field(default_factory=list)  # (what was run, what came out)
    takeaway: str = ""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rows"] = [{"run": run, "result": result} for run, result in self.rows]
        return data


# --- the projections every hand-built call shares (float64, NumPy) ------------------------------


def _projections(setup: Setup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as (B, N, H, d): tokens first, heads next, the layout JAX and Flax take."""
    cfg, p, x = setup.cfg, setup.params, setup.x
    B, N = x.shape[:2]
    q = (x @ p.w_q.T + p.b_q).reshape(B, N, cfg.n_heads, cfg.d_k)  # (B, N, H, Dk)
    k = (x @ p.w_k.T + p.b_k).reshape(B, N, cfg.n_kv_heads, cfg.d_k)  # (B, N, Hkv, Dk)
    v = (x @ p.w_v.T + p.b_v).reshape(B, N, cfg.n_kv_heads, cfg.d_v)  # (B, N, Hkv, Dv)
    return q, k, v


def _output_from_context(setup: Setup, context_bnhd: np.ndarray) -> np.ndarray:
    """(B, N, H, Dv) context -> (B, N, D) output through w_o."""
    B, N = context_bnhd.shape[:2]
    merged = np.asarray(context_bnhd, dtype=np.float64).reshape(B, N, -1)  # (B, N, H*Dv)
    return merged @ setup.params.w_o.T + setup.params.b_o


def _supported(setup: Setup) -> str | None:
    cfg = setup.cfg
    if not cfg.bias:
        return "the demonstrations use the biased layer; this configuration has bias=False"
    return torch_mha_unsupported_reason(cfg)


# --- each library's attention, called the way its users call it ---------------------------------


def _torch_mha(setup: Setup, torch_mask: np.ndarray, need_weights: bool):
    """nn.MultiheadAttention (float64, default sequence-first). Returns (output (B, N, D), weights (B, H, N, N) | None)."""
    import torch

    from mha_rosetta.backends.oracles.torch import loaded_torch_mha

    module = loaded_torch_mha(setup.cfg, setup.params, "float64", "cpu", batch_first=False)  # sequence first
    x = torch.from_numpy(setup.x).transpose(0, 1)  # (N, B, E): sequence first, as the default expects
    with torch.no_grad():
        out, weights = module(
            x, x, x, attn_mask=torch.from_numpy(torch_mask), need_weights=need_weights, average_attn_weights=False
        )
    return out.transpose(0, 1).numpy(), None if weights is None else weights.numpy()


def _torch_sdpa(setup: Setup, mask: np.ndarray):
    """F.scaled_dot_product_attention (float64) on the canonical projections; weights via an identity value."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(t).permute(0, 2, 1, 3) for t in _projections(setup))  # (B, H, N, d) each
    attn_mask = torch.from_numpy(mask)
    with torch.no_grad():
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, N, Dv)
        # With the identity matrix as values, the "context" is the attention-weight matrix itself.
        eye = torch.eye(k.shape[2], dtype=q.dtype).expand(q.shape[0], q.shape[1], -1, -1)  # (B, H, N, N)
        weights = F.scaled_dot_product_attention(q, k, eye, attn_mask=attn_mask)
    return _output_from_context(setup, context.permute(0, 2, 1, 3).numpy()), weights.numpy()


def _jax_dpa(setup: Setup, mask: np.ndarray):
    """jax.nn.dot_product_attention (float32, layout (B, N, H, d)); weights via an identity value."""
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(t, dtype=jnp.float32) for t in _projections(setup))  # (B, N, H, d)
    jmask = jnp.asarray(mask)[None, None]  # (1, 1, N, N)
    scale = setup.cfg.scale
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
    return _output_from_context(setup, np.asarray(context)), weights


def _flax_module(setup: Setup, mask: np.ndarray):
    """flax.linen.MultiHeadDotProductAttention (float32) loaded through the converter."""
    import flax.linen as fnn
    import jax.numpy as jnp

    cfg = setup.cfg
    module = fnn.MultiHeadDotProductAttention(num_heads=cfg.n_heads, qkv_features=cfg.q_width, out_features=cfg.d_model)
    variables = {"params": to_flax_params(cfg, setup.params.astype(np.float32))}
    x = jnp.asarray(setup.x, dtype=jnp.float32)
    out = module.apply(variables, x, x, x, mask=jnp.asarray(mask)[None, None])  # (B, N, D)
    import flax.linen.attention as fattention

    q, k, _ = (jnp.asarray(t, dtype=jnp.float32) for t in _projections(setup))
    weights = fattention.dot_product_attention_weights(q, k, mask=jnp.asarray(mask)[None, None])  # (B, H, N, N)
    return np.asarray(out, dtype=np.float64), np.asarray(weights)


def _equinox_module(setup: Setup, mask: np.ndarray):
    """equinox.nn.MultiheadAttention (float32, unbatched by design: vmap over the batch)."""
    import jax
    import jax.numpy as jnp

    from mha_rosetta.backends.oracles.equinox import loaded_equinox_mha

    module = loaded_equinox_mha(setup.cfg, setup.params.astype(np.float32), "float32", None)  # as the oracle does
    x = jnp.asarray(setup.x, dtype=jnp.float32)
    out = jax.vmap(lambda xb: module(xb, xb, xb, mask=jnp.asarray(mask)))(x)  # (B, N, D)
    return np.asarray(out, dtype=np.float64), None


def _keys_of_query0(weights) -> str:
    if weights is None:
        return "(attention weights not returned)"
    row = np.asarray(weights)[0, 0, 0]  # batch 0, head 0, query 0
    if np.isnan(row).any():
        return "query 0 has NaN weights"
    return f"query 0 attends keys {np.flatnonzero(row > 1e-12).tolist()}"
