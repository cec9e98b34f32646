"""Demonstrations about masks and axis order: mask polarity, sequence-first modules, a fully masked row."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from mha_rosetta.backends._probe import import_failure
from mha_rosetta.backends._probe import importable as _installed  # imports the library once to be sure it loads
from mha_rosetta.core import (
    error_line,
    reference_mha,
)

from ..seed_setup import Setup
from .calls import (
    Difference,
    _equinox_module,
    _flax_module,
    _jax_dpa,
    _keys_of_query0,
    _projections,
    _supported,
    _torch_mha,
    _torch_sdpa,
)


def mask_polarity(setup: Setup) -> Difference:
    title = (
        "Mask polarity: nn.MultiheadAttention's True means blocked; SDPA, JAX, Flax and Equinox's True means may attend"
    )
    reason = _supported(setup)
    if reason:
        return Difference("mask_polarity", title, f"skipped: {reason}")
    N = setup.tokens
    mask = (
        np.add.outer(np.arange(N), np.arange(N)) % 2
    ) == 0  # (N, N) checkerboard: every row keeps some keys either way
    intended = reference_mha(setup.cfg, setup.params, setup.x, mask=mask)
    rows = [
        (
            "the same boolean mask M, query 0",
            f"M[0] = {mask[0].astype(int).tolist()}; the spec (True = may attend) uses keys {np.flatnonzero(mask[0]).tolist()}",
        )
    ]
    runs: list[tuple[str, str, Callable]] = [
        ("nn.MultiheadAttention(attn_mask=M)", "torch", lambda: _torch_mha(setup, mask, need_weights=True)),
        ("nn.MultiheadAttention(attn_mask=~M)", "torch", lambda: _torch_mha(setup, ~mask, need_weights=True)),
        ("F.scaled_dot_product_attention(attn_mask=M)", "torch", lambda: _torch_sdpa(setup, mask)),
        ("jax.nn.dot_product_attention(mask=M)", "jax", lambda: _jax_dpa(setup, mask)),
        ("flax MultiHeadDotProductAttention(mask=M)", "flax", lambda: _flax_module(setup, mask)),
        ("equinox MultiheadAttention(mask=M)", "equinox", lambda: _equinox_module(setup, mask)),
    ]
    for label, module, run in runs:
        if not _installed(module):
            rows.append((label, f"skipped: {import_failure(module)}"))
            continue
        try:
            output, weights = run()
        except Exception as error:  # a library refusing the call is itself the evidence
            rows.append((label, f"raised {error_line(error)}"))
            continue
        error = float(np.max(np.abs(output - intended)))
        rows.append((label, f"{_keys_of_query0(weights)}; output vs intended max error {error:.1e}"))
    takeaway = "porting a mask into or out of nn.MultiheadAttention means inverting it (~M); nothing warns you"
    return Difference("mask_polarity", title, "demonstrated", rows, takeaway)


def sequence_first(setup: Setup) -> Difference:
    title = "Axis order: nn.MultiheadAttention is (N, B, E) by default; SDPA wants (B, H, N, d), jax.nn.dot_product_attention (B, N, H, d)"
    rows = []
    B, N = setup.x.shape[:2]
    if _installed("torch") and not _supported(setup):
        from ..claims import claim_10

        result = claim_10(setup)
        rows += [("nn.MultiheadAttention", line) for line in result.evidence]
    else:
        rows.append(("nn.MultiheadAttention", "skipped: torch not installed or configuration not expressible"))
    if _installed("jax") and _installed("torch") and not _supported(setup):
        import jax
        import jax.numpy as jnp
        import torch
        import torch.nn.functional as F

        q, k, v = _projections(setup)  # (B, N, H, d)
        torch_layout = [torch.from_numpy(t).permute(0, 2, 1, 3) for t in (q, k, v)]  # (B, H, N, d)
        expected = F.scaled_dot_product_attention(*torch_layout).permute(0, 2, 1, 3).numpy()  # back to (B, N, H, d)
        right = np.asarray(jax.nn.dot_product_attention(*(jnp.asarray(t, dtype=jnp.float32) for t in (q, k, v))))
        misfed = [jnp.asarray(t.numpy(), dtype=jnp.float32) for t in torch_layout]  # torch's (B, H, N, d) given to JAX
        try:
            wrong = np.asarray(jax.nn.dot_product_attention(*misfed)).transpose(0, 2, 1, 3)  # read back as (B, N, H, d)
            wrong_text = f"no error; max diff {float(np.max(np.abs(wrong - expected))):.2f} (JAX took heads for tokens)"
        except Exception as error:
            wrong_text = f"raised {error_line(error)}"
        rows.append(
            (
                "jax.nn.dot_product_attention on (B, N, H, d) vs SDPA on (B, H, N, d)",
                f"max diff {float(np.max(np.abs(right - expected))):.1e}",
            )
        )
        rows.append(("jax.nn.dot_product_attention given SDPA's (B, H, N, d) arrays", wrong_text))
    if _installed("equinox"):
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        module = eqx.nn.MultiheadAttention(
            num_heads=setup.cfg.n_heads, query_size=setup.cfg.d_model, key=jax.random.PRNGKey(0)
        )
        x = jnp.asarray(setup.x, dtype=jnp.float32)
        try:
            module(x, x, x)
            text = "accepted a batch"
        except Exception as error:
            text = f"raised {error_line(error)}; it is unbatched by design, use jax.vmap over the batch"
        rows.append((f"equinox MultiheadAttention given (B, N, D) = {(B, N, setup.cfg.d_model)}", text))
    if not rows:
        return Difference("sequence_first", title, "skipped: torch, jax and equinox not installed")
    takeaway = "state the axis order at every boundary; a wrong order with compatible sizes runs silently"
    return Difference("sequence_first", title, "demonstrated", rows, takeaway)


def _classify(row: np.ndarray, candidates: dict[str, np.ndarray], atol: float) -> str:
    if np.isnan(row).any():
        return "NaN"
    for name, candidate in candidates.items():
        if np.allclose(row, candidate, atol=atol, rtol=0):
            return name
    return f"something else (max |row| = {float(np.max(np.abs(row))):.3g})"


def fully_masked_row(setup: Setup) -> Difference:
    title = "A query row with nothing to attend to: the spec gives zero weights (output = b_o); libraries differ"
    reason = _supported(setup)
    if reason:
        return Difference("fully_masked_row", title, f"skipped: {reason}")
    N = setup.tokens
    allowed = np.ones((N, N), dtype=bool)
    allowed[0] = False  # query 0 may attend to no key
    _, _, v = _projections(setup)
    uniform_context = v.reshape(setup.x.shape[0], N, -1).mean(axis=1)  # (B, H*Dv): mean of all values
    candidates = {
        "zero context (output = b_o), as the spec": setup.params.b_o,
        "uniform average of all values": uniform_context[0] @ setup.params.w_o.T + setup.params.b_o,
    }
    reference = reference_mha(setup.cfg, setup.params, setup.x, mask=allowed)
    rows = [("spec (float64 oracle)", _classify(reference[0, 0], candidates, 1e-10))]
    runs = [  # nn.MultiheadAttention with and without need_weights: two code paths of one module
        (f"nn.MultiheadAttention, need_weights={need}", "torch", partial(_torch_mha, setup, ~allowed, need), 1e-10)
        for need in (True, False)
    ]
    runs += [
        ("F.scaled_dot_product_attention", "torch", lambda: _torch_sdpa(setup, allowed), 1e-10),
        ("jax.nn.dot_product_attention", "jax", lambda: _jax_dpa(setup, allowed), 1e-4),
        ("flax MultiHeadDotProductAttention", "flax", lambda: _flax_module(setup, allowed), 1e-4),
        ("equinox MultiheadAttention", "equinox", lambda: _equinox_module(setup, allowed), 1e-4),
    ]
    for label, module, run, atol in runs:
        if not _installed(module):
            rows.append((label, f"skipped: {import_failure(module)}"))
            continue
        try:
            output, _ = run()
            rows.append((label, _classify(output[0, 0], candidates, atol)))
        except Exception as error:
            rows.append((label, f"raised {error_line(error)}"))
    takeaway = "padding-only rows (left padding, empty segments) come out as NaN, zeros or an average depending on the library and even the code path"
    return Difference("fully_masked_row", title, "demonstrated", rows, takeaway)
