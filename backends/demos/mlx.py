"""MLX's conventions, called for real: the calls behind the explainer's MLX section (`explain.differences.mlx`).

Each function calls MLX (and torch, for the side-by-side causal rule) the way their users do and returns
plain values; the explainer words them.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, apply_rotary, prepare_inputs, rotary_tables

from ._needs import needs


def _identity_values(k_tokens: int, seed: int):
    """q (1, 1, Nq-agnostic) draws and the identity as values: the kernel's output is then its weights."""
    rng = np.random.default_rng(seed)
    return rng, np.eye(k_tokens, dtype=np.float32)[None, None]  # (1, 1, Nk, Nk)


@needs("mlx")
def mlx_causal_weights(q_tokens: int, k_tokens: int, seed: int = 0) -> np.ndarray:
    """``mx.fast.scaled_dot_product_attention(..., mask="causal")``'s weights (Nq, Nk) for Nq queries over Nk keys."""
    import mlx.core as mx

    rng, eye = _identity_values(k_tokens, seed)
    q = rng.standard_normal((1, 1, q_tokens, k_tokens)).astype(np.float32)  # width Nk: the identity's
    k = rng.standard_normal((1, 1, k_tokens, k_tokens)).astype(np.float32)
    out = mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(eye), scale=0.5, mask="causal")
    return np.array(out)[0, 0]


@needs("torch")
def torch_causal_weights(q_tokens: int, k_tokens: int, seed: int = 0) -> np.ndarray:
    """``F.scaled_dot_product_attention(..., is_causal=True)``'s weights (Nq, Nk), the same draws as `mlx_causal_weights`."""
    import torch
    import torch.nn.functional as F

    rng, eye = _identity_values(k_tokens, seed)
    q = torch.from_numpy(rng.standard_normal((1, 1, q_tokens, k_tokens)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((1, 1, k_tokens, k_tokens)).astype(np.float32))
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, torch.from_numpy(eye), is_causal=True, scale=0.5)[0, 0].numpy()


@needs("mlx")
def mlx_rope_errors(d_k: int = 8, tokens: int = 6, seed: int = 0) -> dict[tuple[bool, str], float]:
    """Max error of ``nn.RoPE(d_k, traditional=t)`` against the spec's rotation of each style, positions 0 .. N-1."""
    import mlx.core as mx
    import mlx.nn as nn

    x = np.random.default_rng(seed).standard_normal((1, 1, tokens, d_k))  # (B, H, N, Dk)
    errors = {}
    for style in ("interleaved", "half"):
        cfg = MHAConfig(d_model=2 * d_k, n_heads=2, rope=style)
        tables = rotary_tables(cfg, prepare_inputs(cfg, np.zeros((1, tokens, 2 * d_k))))
        spec = apply_rotary(x, tables.q_cos[:, None], tables.q_sin[:, None], style)
        for traditional in (True, False):
            ours = np.array(nn.RoPE(d_k, traditional=traditional, base=cfg.rope_base)(mx.array(x, dtype=mx.float32)))
            errors[(traditional, style)] = float(np.abs(ours - spec).max())
    return errors


@needs("mlx")
def mlx_fully_masked_row(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the kernel's row for a query that may attend to nothing, the mean of V), each (H, Dv)."""
    import mlx.core as mx

    q, k, v = (np.random.default_rng(seed + i).standard_normal((1, 2, 4, 8)).astype(np.float32) for i in range(3))
    allowed = np.ones((4, 4), dtype=bool)
    allowed[0] = False  # query 0 may attend to nothing
    out = mx.fast.scaled_dot_product_attention(
        mx.array(q), mx.array(k), mx.array(v), scale=8**-0.5, mask=mx.array(allowed)
    )
    return np.array(out)[0, :, 0], v[0].mean(axis=1)


@needs("mlx")
def mlx_linear_weight_shape(d_in: int, d_out: int) -> tuple[int, ...]:
    """``nn.Linear(d_in, d_out).weight.shape``: (out, in), as torch's."""
    import mlx.nn as nn

    return tuple(nn.Linear(d_in, d_out).weight.shape)


@needs("mlx")
def mlx_float64_facts() -> dict:
    """What float64 does in MLX on the CPU: ``mx.array`` of float64 data without and with ``dtype=``, and how far
    its ``exp`` is from NumPy's float64 ``exp``."""
    import mlx.core as mx

    data = np.linspace(-5, 5, 101)
    exact = mx.exp(mx.array(data, dtype=mx.float64))
    return {
        "mx.array(np_float64)": str(mx.array(data).dtype).removeprefix("mlx.core."),
        "mx.array(np_float64, dtype=mx.float64)": str(exact.dtype).removeprefix("mlx.core."),
        "exp max relative error": float(np.max(np.abs(np.array(exact) - np.exp(data)) / np.exp(data))),
    }
