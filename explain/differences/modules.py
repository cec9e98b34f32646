"""Demonstrations about what modules are built with: where the scale goes, head-size arguments, TF32."""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.backends.demos import (
    LibraryMissing,
    equinox_query_weight_shape,
    flax_kernel_shapes,
    float16_attention,
    float32_matmul_defaults,
    float32_matmul_on_gpu,
    keras_query_kernel_shape,
    torch_mha_head_size,
)

from ..seed_setup import Setup
from .calls import (
    Difference,
)


def scale_placement(setup: Setup) -> Difference:
    title = "Where 1/sqrt(d_k) goes: scaling the logits after Q @ K.T overflows float16 where scaling first does not"
    d_k, n = 64, 4
    rng = np.random.default_rng(3)
    q = (40.0 + 0.01 * rng.standard_normal((n, d_k))).astype(np.float16)  # q . k = 64 * 40 * 40 = 102400 > 65504
    scale = 1.0 / np.sqrt(d_k)
    with np.errstate(over="ignore"):  # the overflow is the point being shown
        after = (q @ q.T) * np.float16(scale)  # (n, n): overflows before the scale can help
    before = (q * np.float16(scale)) @ q.T  # (n, n): the scaled product fits

    def finite(values) -> str:
        return f"finite: {bool(np.isfinite(np.asarray(values)).all())}"

    rows = [
        (
            "numpy float16, (Q @ K.T) * scale",
            f"max logit {float(np.max(after))} (overflow: {bool(np.isinf(after).any())})",
        ),
        ("numpy float16, (Q * scale) @ K.T", f"max logit {float(np.max(before)):.0f} ({finite(before)})"),
    ]
    rows += [(label, finite(values)) for label, values in float16_attention(q)]  # each installed library's own
    takeaway = "a hand-written port that scales after the product can overflow in float16; scale q (or accumulate in float32) first"
    return Difference("scale_placement", title, "demonstrated", rows, takeaway)


def head_size_arguments(setup: Setup) -> Difference:
    title = "Head size arguments: torch embed_dim and Flax qkv_features are totals; Equinox qk_size and Keras key_dim are per head"
    cfg = setup.cfg
    total, per_head = cfg.q_width, cfg.d_k
    rows = []

    def read(label: str, shape_of, words) -> None:
        """A row for the real module ``label`` whose parameters ``shape_of()`` reads, worded by ``words``."""
        try:
            rows.append((label, words(shape_of())))
        except LibraryMissing:
            pass

    read(
        f"nn.MultiheadAttention(embed_dim={total}, num_heads={cfg.n_heads})",
        lambda: torch_mha_head_size(total, cfg.n_heads),
        lambda facts: f"in_proj_weight {facts[0]}: head size {facts[1]}",
    )
    read(
        f"flax MultiHeadDotProductAttention(num_heads={cfg.n_heads}, qkv_features={total})",
        lambda: flax_kernel_shapes(cfg.n_heads, total, total)["query"],
        lambda kernel: f"query.kernel {kernel}: head size {kernel[-1]}",
    )
    for qk_size in (per_head, total):
        read(
            f"equinox MultiheadAttention(num_heads={cfg.n_heads}, qk_size={qk_size})",
            partial(equinox_query_weight_shape, cfg.n_heads, cfg.d_model, qk_size=qk_size),
            lambda weight, size=qk_size: f"query_proj.weight {weight}: head size {size}",
        )
    try:
        kernel = keras_query_kernel_shape(cfg.n_heads, per_head, cfg.d_model)
        rows.append(
            (f"keras MultiHeadAttention(num_heads={cfg.n_heads}, key_dim={per_head})", f"query kernel {kernel}")
        )
    except LibraryMissing as missing:
        rows.append(
            (
                "keras MultiHeadAttention(key_dim=...)",
                f"skipped: {missing.reason} (its key_dim is per head, like Equinox's qk_size)",
            )
        )
    if len(rows) <= 1:
        return Difference("head_size_arguments", title, "skipped: torch, flax and equinox not installed", rows)
    takeaway = f"passing torch's embed_dim={total} as a per-head size makes every head {cfg.n_heads}x wider"
    return Difference("head_size_arguments", title, "demonstrated", rows, takeaway)


def tf32_default(setup: Setup) -> Difference:
    title = "float32 matmul precision on GPU (TF32): what torch and JAX do by default"
    defaults = float32_matmul_defaults()  # (library's defaults, in words, whether it has a GPU here)
    rows = [(label, words) for label, words, _ in defaults]
    takeaway = "compare float32 across frameworks on GPU only with TF32 off on both sides"
    if not any(gpu for _, _, gpu in defaults):
        skipped = "skipped: no GPU on this machine (the defaults are listed; the effect needs a GPU)"
        return Difference("tf32_default", title, skipped, rows, takeaway)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1024, 1024)), rng.standard_normal((1024, 1024))
    exact = a @ b
    for label, product in float32_matmul_on_gpu(a, b):
        rows.append((label, f"max error vs float64 {float(np.max(np.abs(product - exact))):.2e}"))
    return Difference("tf32_default", title, "demonstrated", rows, takeaway)
