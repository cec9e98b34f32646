"""MLX's conventions side by side with the spec's and torch's, each shown by a real call (`backends.demos.mlx`).

The section a porter to MLX (mlx-lm) reads: ``mask="causal"`` aligned bottom-right against torch's
top-left ``is_causal``; ``nn.RoPE``'s ``traditional`` flag against the spec's rotary styles; a fully
masked row; ``nn.Linear``'s ``(out, in)``; float64 on the CPU. What this machine cannot show (Metal)
is said in docs/backends.md.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.backends import demos

from ..seed_setup import Setup
from .calls import Difference, library_rows

Q_TOKENS, K_TOKENS = 2, 5  # a decode-like call: 2 new queries over 5 keys


def _keys_per_query(weights: np.ndarray) -> str:
    return "; ".join(f"query {i} sees keys {np.flatnonzero(row > 1e-12).tolist()}" for i, row in enumerate(weights))


def _rope(errors: dict) -> str:
    parts = [
        f"traditional={traditional} vs spec {style!r}: max error {error:.1e}"
        for (traditional, style), error in errors.items()
    ]
    return "; ".join(parts)


def _empty_row(result) -> str:
    row, mean_of_v = result
    if np.isnan(row).any():
        return "NaN"
    if np.allclose(row, mean_of_v, atol=1e-5):
        return f"the mean of V (max |row - mean(V)| {np.abs(row - mean_of_v).max():.1e}); the spec gives zeros"
    return f"other values (max |row| {np.abs(row).max():.3g})"


def mlx_conventions(setup: Setup) -> Difference:
    title = 'MLX (mlx-lm): mask="causal" is bottom-right, nn.RoPE(traditional=True) is interleaved, weights (out, in)'
    cfg = setup.cfg
    runs = [
        (
            f'mx.fast.scaled_dot_product_attention(mask="causal"), {Q_TOKENS} queries over {K_TOKENS} keys',
            lambda: demos.mlx_causal_weights(Q_TOKENS, K_TOKENS),
            _keys_per_query,
        ),
        (
            f"F.scaled_dot_product_attention(is_causal=True), the same {Q_TOKENS} x {K_TOKENS}",
            lambda: demos.torch_causal_weights(Q_TOKENS, K_TOKENS),
            _keys_per_query,
        ),
        ("nn.RoPE(d_k, traditional=...) against the spec's rotary styles", demos.mlx_rope_errors, _rope),
        ("mx.fast.scaled_dot_product_attention, a query with no allowed key", demos.mlx_fully_masked_row, _empty_row),
        (
            f"nn.Linear({cfg.d_model}, {cfg.n_heads * cfg.d_k}).weight.shape",
            lambda: demos.mlx_linear_weight_shape(cfg.d_model, cfg.n_heads * cfg.d_k),
            lambda shape: f"{shape}: (out, in), the canonical layout and torch's; x @ W.T + b (mx.addmm)",
        ),
        (
            "float64 on the CPU",
            demos.mlx_float64_facts,
            lambda facts: ", ".join(f"{k}: {v:.1e}" if isinstance(v, float) else f"{k}: {v}" for k, v in facts.items()),
        ),
    ]
    rows = library_rows(runs, lambda result, describe: describe(result))
    demonstrated = any(not out.startswith("skipped") for _, out in rows)
    status = "demonstrated" if demonstrated else "skipped: mlx is not installed: pip install 'mha-rosetta[mlx]'"
    takeaway = (
        'MLX aligns mask="causal" bottom-right (the last query sees the last key; torch\'s is_causal is top-left), '
        "which is the spec's rule for a decode step's queries after cached keys and differs from torch whenever "
        "Nq != Nk with default positions; nn.RoPE(traditional=True) rotates interleaved pairs (the spec's "
        '"interleaved"), traditional=False halves ("half"): the wrong flag is an O(1) error, not a rounding; '
        "a fully masked row gives the mean of V (spec: zeros, torch SDPA: NaN); mx.array of float64 NumPy data "
        "silently becomes float32 unless dtype=mx.float64, and float64 exp/sin/cos are float32-accurate; "
        "evaluation is lazy, mx.eval is the synchronisation point a timing must end with"
    )
    return Difference("mlx_conventions", title, status, rows, takeaway)
