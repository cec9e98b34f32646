"""Float32 precision, measured in each library: the framework side of `checks.precision`.

`precision_runs` runs every float32 matmul-precision setting the adapters offer, in every
installed library of `PRECISION_RUNS`, on one square product and through the whole attention
layer (the library's adapter), and hands back the raw results; `checks.precision` turns them
into the TF32 table (errors against float64). `gpu_questions` asks torch what its attention
kernels do on a device (`empty_row_answers`, `sdpa_float32_error`, the TF32 switches after).

- torch with TF32 off and on (`backends.torch.common.matmul_precision`, cuBLAS and cuDNN switches);
- JAX at every name of ``jax.default_matmul_precision`` (`backends.jax.common.MATMUL_PRECISIONS`),
  with the precision each name lowers to (`backends.jax.common.LOWERED_PRECISION`).

Design rule: the libraries are imported inside the functions only, so importing this module
imports NumPy and nothing else; code outside `backends` asks here instead of importing torch or
JAX or an adapter's helpers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import error_line


@dataclass
class PrecisionRun:
    """One float32 precision setting of one library, run: its product and its attention layer's output."""

    library: str
    version: str
    setting: str  # how the setting is spelled in the library ("allow_tf32=True", ...)
    lowered: str  # what it lowers to (the switches read back, or the XLA precision)
    tf32: bool  # whether the setting allows TF32 (on a GPU that has it)
    product: np.ndarray  # (n, n) float64: the float32 product a @ b under the setting
    output: np.ndarray  # (B, N, D): the adapter's float32 attention under the setting


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported)."""
    return importlib.util.find_spec(module) is not None


def torch_precision_runs(device: str, a: np.ndarray, b: np.ndarray, cfg, params, x) -> list[PrecisionRun]:
    """torch with TF32 off, then on: ``a @ b`` and `TorchBackend` on ``x``, float32 on ``device``."""
    import torch

    from mha_rosetta.backends.torch.adapter import TorchBackend
    from mha_rosetta.backends.torch.common import matmul_precision, tf32_switches, to_tensor

    ta, tb = to_tensor(a, "float32", device), to_tensor(b, "float32", device)
    runs = []
    for allow in (False, True):
        with matmul_precision(allow):
            switches = tf32_switches()
            product = (ta @ tb).double().cpu().numpy()
        output = TorchBackend(allow_tf32=allow).run(cfg, params, x, dtype="float32", device=device)
        lowered = f"{switches['api']}: matmul {switches['matmul']}, cudnn {switches['cudnn']}"
        runs.append(PrecisionRun("torch", torch.__version__, f"allow_tf32={allow}", lowered, allow, product, output))
    return runs


def jax_precision_runs(device: str, a: np.ndarray, b: np.ndarray, cfg, params, x) -> list[PrecisionRun]:
    """JAX at every ``default_matmul_precision`` name: ``a @ b`` and `JaxBackend` on ``x``, float32 on ``device``."""
    import jax
    import jax.numpy as jnp

    from mha_rosetta.backends.jax.adapter import JaxBackend
    from mha_rosetta.backends.jax.common import LOWERED_PRECISION, MATMUL_PRECISIONS, allows_tf32, jax_device

    target = jax_device(device)
    ja = jax.device_put(np.asarray(a, dtype=np.float32), target)
    jb = jax.device_put(np.asarray(b, dtype=np.float32), target)
    runs = []
    for name in MATMUL_PRECISIONS:
        with jax.default_matmul_precision(name):  # a tracing-time setting: jit inside it
            product = np.asarray(jax.jit(jnp.matmul)(ja, jb), dtype=np.float64)
        output = JaxBackend(matmul_precision=name).run(cfg, params, x, dtype="float32", device=device)
        setting, lowered = f"default_matmul_precision={name!r}", LOWERED_PRECISION[name]
        runs.append(PrecisionRun("jax", jax.__version__, setting, lowered, allows_tf32(name), product, output))
    return runs


# library -> its settings' runs, in the order of the table; a library that is not installed gives none.
PRECISION_RUNS: dict[str, Callable[..., list[PrecisionRun]]] = {
    "torch": torch_precision_runs,
    "jax": jax_precision_runs,
}


def precision_runs(device: str, a: np.ndarray, b: np.ndarray, cfg, params, x) -> list[PrecisionRun]:
    """Every installed library's float32 settings (`PRECISION_RUNS`), in order; a library without ``device`` raises."""
    return [
        run
        for library, runs in PRECISION_RUNS.items()
        if _installed(library)
        for run in runs(device, a, b, cfg, params, x)
    ]


def empty_row_answers(device: str = "cpu") -> dict[str, str]:
    """What torch's attention returns on ``device`` for a query row that may attend to no key.

    float32, 4 tokens, query 0 fully masked. Each answer is "NaN", "zeros" (the spec's
    zero context), "mean of values" or "other"; a call that raises gives its error.
    """
    import torch
    import torch.nn.functional as F

    from mha_rosetta.backends.torch.common import torch_device

    target = torch_device(device)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=generator).to(target) for _ in range(3))  # (B, H, N, d)
    allowed = torch.ones(4, 4, dtype=torch.bool, device=target)
    allowed[0] = False  # query 0 may attend to nothing

    def classify(row: torch.Tensor, values: torch.Tensor) -> str:
        row = row.double().cpu()
        if torch.isnan(row).any():
            return "NaN"
        if torch.all(row == 0):
            return "zeros"
        if torch.allclose(row, values.double().cpu().mean(dim=0), atol=1e-5):
            return "mean of values"
        return f"other ({row.tolist()[:3]}...)"

    answers: dict[str, str] = {}
    calls = {
        "F.scaled_dot_product_attention(attn_mask)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)[
            0, 0, 0
        ],
    }
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(target).eval()
    x = torch.randn(1, 4, 8, generator=generator).to(target)  # (B, N, E)
    for need_weights in (False, True):
        calls[f"nn.MultiheadAttention(need_weights={need_weights})"] = lambda need_weights=need_weights: mha(
            x, x, x, attn_mask=~allowed, need_weights=need_weights
        )[0][0, 0]
    for label, call in calls.items():
        try:
            with torch.no_grad():
                row = call()
            # SDPA's row 0 against the mean of v; nn.MHA's output row against its output bias alone
            # would need the layer's internals, so NaN/zeros/other is what it reports.
            answers[label] = classify(row, v[0, 0])
        except Exception as error:  # a kernel refusing the case is the answer
            answers[label] = f"raised {error_line(error)}"
    return answers


def sdpa_float32_error(device: str = "cpu", tokens: int = 1024, width: int = 64) -> dict[str, float]:
    """Max abs error against float64 of float32 SDPA and of the same attention by hand, TF32 off.

    If SDPA's error is far above the by-hand error (order 1e-3 against 1e-6), its float32
    kernels use tensor cores whatever ``allow_tf32`` says.
    """
    import torch
    import torch.nn.functional as F

    from mha_rosetta.backends.torch.common import matmul_precision, torch_device

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, tokens, width, generator=generator, dtype=torch.float64) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)  # float64 on the CPU: the reference
    target = torch_device(device)
    q32, k32, v32 = (t.to(target, torch.float32) for t in (q, k, v))
    with matmul_precision(False), torch.no_grad():
        sdpa = F.scaled_dot_product_attention(q32, k32, v32).double().cpu()
        weights = torch.softmax(q32 @ k32.transpose(-1, -2) / width**0.5, dim=-1)  # (1, 8, N, N)
        by_hand = (weights @ v32).double().cpu()
    return {
        "sdpa_float32_max_abs": float((sdpa - exact).abs().max()),
        "by_hand_float32_max_abs": float((by_hand - exact).abs().max()),
    }


def gpu_questions(device: str) -> dict:
    """The answers a first GPU run must record (`checks.precision`'s docstring); torch only."""
    if not _installed("torch"):
        return {"skipped": "torch is not installed"}
    from mha_rosetta.backends.torch.common import tf32_switches

    return {
        "device": device,
        "empty_row": empty_row_answers(device),
        "sdpa_float32": sdpa_float32_error(device),
        "tf32_switches_after": tf32_switches(),
    }
