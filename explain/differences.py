"""Framework differences that bite people porting attention code, each shown live.

Every demonstration calls the libraries themselves (not this project's adapters, which
map the differences away) with the same canonical parameters and inputs, and reports
what came out: which keys a query attended to, the error against the float64 oracle,
what a row with nothing to attend to became, which shapes a module created. A library
that is not installed turns its line into a skip with the reason; a demonstration that
needs a GPU is skipped on a machine without one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from mha_rosetta.backends._probe import import_failure
from mha_rosetta.backends._probe import importable as _installed  # imports the library once to be sure it loads
from mha_rosetta.core import (
    error_line,
    reference_mha,
    to_flax_params,
    torch_mha_unsupported_reason,
)

from .seed_setup import Setup, make_setup


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


# --- the demonstrations ----------------------------------------------------------------------


def _keys_of_query0(weights) -> str:
    if weights is None:
        return "(attention weights not returned)"
    row = np.asarray(weights)[0, 0, 0]  # batch 0, head 0, query 0
    if np.isnan(row).any():
        return "query 0 has NaN weights"
    return f"query 0 attends keys {np.flatnonzero(row > 1e-12).tolist()}"


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
        from .claims import claim_10

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


DEMONSTRATIONS: dict[str, Callable[[Setup], Difference]] = {
    "mask_polarity": mask_polarity,
    "sequence_first": sequence_first,
    "fully_masked_row": fully_masked_row,
    "scale_placement": scale_placement,
    "head_size_arguments": head_size_arguments,
    "tf32_default": tf32_default,
}


# The demonstrations whose subject is the device's own precision: everything else is pinned.
ON_THE_DEVICE = ("tf32_default",)


@contextmanager
def jax_on_cpu_at_highest():
    """JAX work inside runs on the CPU with float32 products at full precision ("highest").

    On a machine whose JAX has a GPU, the default device is the GPU and its default float32
    matmul precision may be TF32 (errors ~1e-3): the demonstrations' verdicts (which keys a
    query used, what an empty row became, at atol 1e-4) must not depend on that. Without
    JAX installed it does nothing.
    """
    if not _installed("jax"):
        yield
        return
    import jax

    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        yield


def run_differences(setup: Setup | None = None, keys: list[str] | None = None) -> list[Difference]:
    """Run the demonstrations (all by default) on ``setup`` (default: the article's configuration).

    Every demonstration but `ON_THE_DEVICE` runs its JAX calls on the CPU at "highest"
    precision (`jax_on_cpu_at_highest`), so a CUDA-JAX machine gives the same verdicts.
    """
    setup = make_setup() if setup is None else setup
    keys = list(DEMONSTRATIONS) if keys is None else keys
    unknown = [key for key in keys if key not in DEMONSTRATIONS]
    if unknown:
        raise ValueError(f"unknown demonstration(s) {unknown}; choose from {', '.join(DEMONSTRATIONS)}")
    results = []
    for key in keys:
        if key in ON_THE_DEVICE:
            results.append(DEMONSTRATIONS[key](setup))
            continue
        with jax_on_cpu_at_highest():
            results.append(DEMONSTRATIONS[key](setup))
    return results
