"""Demonstrations about what modules are built with: where the scale goes, head-size arguments, TF32."""

from __future__ import annotations

import numpy as np

from mha_rosetta.backends._probe import import_failure
from mha_rosetta.backends._probe import importable as _installed  # imports the library once to be sure it loads

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
    if _installed("torch"):
        import torch
        import torch.nn.functional as F

        qt = torch.from_numpy(q)[None, None]  # (1, 1, n, d_k)
        rows.append(("torch float16 Q @ K.T by hand", finite(qt @ qt.transpose(-1, -2))))
        rows.append(("F.scaled_dot_product_attention float16", finite(F.scaled_dot_product_attention(qt, qt, qt))))
    if _installed("jax"):
        import jax
        import jax.numpy as jnp

        qj = jnp.asarray(q)[None, :, None, :]  # (1, n, 1, d_k): JAX's (B, N, H, d)
        rows.append(("jax.nn.dot_product_attention float16", finite(jax.nn.dot_product_attention(qj, qj, qj))))
    if _installed("flax"):
        import flax.linen as fnn
        import jax.numpy as jnp

        qj = jnp.asarray(q)[None, :, None, :]
        label = "flax dot_product_attention float16 (divides the query by sqrt(depth) first)"
        rows.append((label, finite(fnn.dot_product_attention(qj, qj, qj))))
    takeaway = "a hand-written port that scales after the product can overflow in float16; scale q (or accumulate in float32) first"
    return Difference("scale_placement", title, "demonstrated", rows, takeaway)


def head_size_arguments(setup: Setup) -> Difference:
    title = "Head size arguments: torch embed_dim and Flax qkv_features are totals; Equinox qk_size and Keras key_dim are per head"
    cfg = setup.cfg
    total, per_head = cfg.q_width, cfg.d_k
    rows = []
    if _installed("torch"):
        import torch

        module = torch.nn.MultiheadAttention(total, cfg.n_heads)
        rows.append(
            (
                f"nn.MultiheadAttention(embed_dim={total}, num_heads={cfg.n_heads})",
                f"in_proj_weight {tuple(module.in_proj_weight.shape)}: head size {module.head_dim}",
            )
        )
    if _installed("flax"):
        import flax.linen as fnn
        import jax
        import jax.numpy as jnp

        module = fnn.MultiHeadDotProductAttention(num_heads=cfg.n_heads, qkv_features=total)
        shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 2, total)))["params"]
        rows.append(
            (
                f"flax MultiHeadDotProductAttention(num_heads={cfg.n_heads}, qkv_features={total})",
                f"query.kernel {tuple(shapes['query']['kernel'].shape)}: head size {shapes['query']['kernel'].shape[-1]}",
            )
        )
    if _installed("equinox"):
        import equinox as eqx
        import jax

        for qk_size in (per_head, total):
            module = eqx.nn.MultiheadAttention(
                num_heads=cfg.n_heads, query_size=cfg.d_model, qk_size=qk_size, key=jax.random.PRNGKey(0)
            )
            rows.append(
                (
                    f"equinox MultiheadAttention(num_heads={cfg.n_heads}, qk_size={qk_size})",
                    f"query_proj.weight {tuple(module.query_proj.weight.shape)}: head size {qk_size}",
                )
            )
    if _installed("keras"):
        import keras

        layer = keras.layers.MultiHeadAttention(num_heads=cfg.n_heads, key_dim=per_head)
        x = np.zeros((1, 2, cfg.d_model), dtype=np.float32)
        layer(x, x)
        rows.append(
            (
                f"keras MultiHeadAttention(num_heads={cfg.n_heads}, key_dim={per_head})",
                f"query kernel {tuple(layer._query_dense.kernel.shape)}",
            )
        )
    else:
        rows.append(
            (
                "keras MultiHeadAttention(key_dim=...)",
                f"skipped: {import_failure('keras')} (its key_dim is per head, like Equinox's qk_size)",
            )
        )
    if len(rows) <= 1:
        return Difference("head_size_arguments", title, "skipped: torch, flax and equinox not installed", rows)
    takeaway = f"passing torch's embed_dim={total} as a per-head size makes every head {cfg.n_heads}x wider"
    return Difference("head_size_arguments", title, "demonstrated", rows, takeaway)


def tf32_default(setup: Setup) -> Difference:
    title = "float32 matmul precision on GPU (TF32): what torch and JAX do by default"
    rows = []
    gpu_torch = gpu_jax = False
    if _installed("torch"):
        import torch

        from mha_rosetta.backends.torch.common import tf32_switches

        switches = tf32_switches()  # the old getters raise once torch >= 2.9's new API turned TF32 on
        rows.append(
            (
                "torch defaults",
                f"TF32 switches ({switches['api']} API): cuda.matmul {switches['matmul']}, cudnn {switches['cudnn']}",
            )
        )
        gpu_torch = torch.cuda.is_available()
    if _installed("jax"):
        import jax

        rows.append(
            (
                "jax defaults",
                f"jax_default_matmul_precision = {jax.config.jax_default_matmul_precision!r} (None: the platform's default precision)",
            )
        )
        try:
            gpu_jax = bool(jax.devices("gpu"))
        except RuntimeError:
            gpu_jax = False
    takeaway = "compare float32 across frameworks on GPU only with TF32 off on both sides"
    if not (gpu_torch or gpu_jax):
        skipped = "skipped: no GPU on this machine (the defaults are listed; the effect needs a GPU)"
        return Difference("tf32_default", title, skipped, rows, takeaway)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1024, 1024)), rng.standard_normal((1024, 1024))
    exact = a @ b
    if gpu_torch:
        import torch

        from mha_rosetta.backends.torch.common import matmul_precision

        ta, tb = torch.from_numpy(a).float().cuda(), torch.from_numpy(b).float().cuda()
        for allow in (False, True):
            with matmul_precision(allow):  # set, then restored through the API it was read with
                error = float(np.max(np.abs((ta @ tb).cpu().double().numpy() - exact)))
            rows.append(
                (f"torch cuda float32 1024x1024 matmul, allow_tf32={allow}", f"max error vs float64 {error:.2e}")
            )
    if gpu_jax:
        import jax
        import jax.numpy as jnp

        device = jax.devices("gpu")[0]
        ja, jb = (
            jax.device_put(jnp.asarray(a, jnp.float32), device),
            jax.device_put(jnp.asarray(b, jnp.float32), device),
        )
        for precision in (None, jax.lax.Precision.HIGHEST):
            error = float(np.max(np.abs(np.asarray(jnp.dot(ja, jb, precision=precision), dtype=np.float64) - exact)))
            rows.append((f"jax gpu float32 1024x1024 dot, precision={precision}", f"max error vs float64 {error:.2e}"))
    return Difference("tf32_default", title, "demonstrated", rows, takeaway)
