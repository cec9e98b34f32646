"""Demonstrations about masks and axis order: mask polarity, sequence-first modules, a fully masked row."""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.backends.demos import (
    LibraryMissing,
    equinox_given_a_batch,
    equinox_mha_call,
    flax_mha_call,
    head_projections,
    jax_dpa_call,
    sdpa_and_dpa_axis_order,
    torch_mha_call,
    torch_sdpa_call,
)
from mha_rosetta.core import (
    error_line,
    reference_mha,
)

from ..seed_setup import Setup
from .calls import Difference, _keys_of_query0, _supported, library_rows


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
    inputs = (setup.cfg, setup.params, setup.x)
    runs = [
        ("nn.MultiheadAttention(attn_mask=M)", partial(torch_mha_call, *inputs, mask, need_weights=True)),
        ("nn.MultiheadAttention(attn_mask=~M)", partial(torch_mha_call, *inputs, ~mask, need_weights=True)),
        ("F.scaled_dot_product_attention(attn_mask=M)", partial(torch_sdpa_call, *inputs, mask)),
        ("jax.nn.dot_product_attention(mask=M)", partial(jax_dpa_call, *inputs, mask)),
        ("flax MultiHeadDotProductAttention(mask=M)", partial(flax_mha_call, *inputs, mask)),
        ("equinox MultiheadAttention(mask=M)", partial(equinox_mha_call, *inputs, mask)),
    ]

    def describe(result) -> str:
        output, weights = result
        error = float(np.max(np.abs(output - intended)))
        return f"{_keys_of_query0(weights)}; output vs intended max error {error:.1e}"

    rows += library_rows(runs, describe)
    takeaway = "porting a mask into or out of nn.MultiheadAttention means inverting it (~M); nothing warns you"
    return Difference("mask_polarity", title, "demonstrated", rows, takeaway)


def sequence_first(setup: Setup) -> Difference:
    title = "Axis order: nn.MultiheadAttention is (N, B, E) by default; SDPA wants (B, H, N, d), jax.nn.dot_product_attention (B, N, H, d)"
    rows = []
    B, N = setup.x.shape[:2]
    supported = not _supported(setup)
    from ..claims import claim_10

    result = claim_10(setup) if supported else None  # skipped only without torch (the configuration is expressible)
    if result is not None and not result.verdict.startswith("skipped"):
        rows += [("nn.MultiheadAttention", line) for line in result.evidence]
    else:
        rows.append(("nn.MultiheadAttention", "skipped: torch not installed or configuration not expressible"))
    try:
        orders = sdpa_and_dpa_axis_order(*head_projections(setup.cfg, setup.params, setup.x)) if supported else None
    except LibraryMissing:
        orders = None
    if orders is not None:
        expected, right, wrong = orders  # (B, N, H, d) each; wrong: what JAX raised, if it did
        if isinstance(wrong, Exception):
            wrong_text = f"raised {error_line(wrong)}"
        else:
            wrong_text = f"no error; max diff {float(np.max(np.abs(wrong - expected))):.2f} (JAX took heads for tokens)"
        rows.append(
            (
                "jax.nn.dot_product_attention on (B, N, H, d) vs SDPA on (B, H, N, d)",
                f"max diff {float(np.max(np.abs(right - expected))):.1e}",
            )
        )
        rows.append(("jax.nn.dot_product_attention given SDPA's (B, H, N, d) arrays", wrong_text))
    try:
        error = equinox_given_a_batch(setup.cfg, setup.x)
    except LibraryMissing:
        pass
    else:
        text = "accepted a batch"
        if error is not None:
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
    inputs = (setup.cfg, setup.params, setup.x)
    _, _, v = head_projections(*inputs)
    uniform_context = v.reshape(setup.x.shape[0], N, -1).mean(axis=1)  # (B, H*Dv): mean of all values
    candidates = {
        "zero context (output = b_o), as the spec": setup.params.b_o,
        "uniform average of all values": uniform_context[0] @ setup.params.w_o.T + setup.params.b_o,
    }
    reference = reference_mha(setup.cfg, setup.params, setup.x, mask=allowed)
    rows = [("spec (float64 oracle)", _classify(reference[0, 0], candidates, 1e-10))]
    runs = [  # nn.MultiheadAttention with and without need_weights: two code paths of one module
        (f"nn.MultiheadAttention, need_weights={need}", partial(torch_mha_call, *inputs, ~allowed, need), 1e-10)
        for need in (True, False)
    ]
    runs += [  # (label, call, atol): float64 calls to 1e-10, the float32 JAX ones to 1e-4
        ("F.scaled_dot_product_attention", partial(torch_sdpa_call, *inputs, allowed), 1e-10),
        ("jax.nn.dot_product_attention", partial(jax_dpa_call, *inputs, allowed), 1e-4),
        ("flax MultiHeadDotProductAttention", partial(flax_mha_call, *inputs, allowed), 1e-4),
        ("equinox MultiheadAttention", partial(equinox_mha_call, *inputs, allowed), 1e-4),
    ]
    rows += library_rows(runs, lambda result, atol: _classify(result[0][0, 0], candidates, atol))
    takeaway = "padding-only rows (left padding, empty segments) come out as NaN, zeros or an average depending on the library and even the code path"
    return Difference("fully_masked_row", title, "demonstrated", rows, takeaway)
