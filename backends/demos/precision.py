"""float32 matmul precision on GPU (TF32): each library's defaults, and its float32 product on the GPU.

`float32_matmul_defaults` reads each installed library's default (torch's TF32 switches, JAX's default
matmul precision) and whether it has a GPU here; `float32_matmul_on_gpu` runs one float32 product on each
library's GPU with TF32 allowed and not. Each framework is imported inside its function, behind `needs`.
"""

from __future__ import annotations

import numpy as np

from ._needs import needs, run_installed


@needs("torch")
def _torch_defaults() -> list[tuple[str, str, bool]]:
    import torch

    from ..frameworks.torch import tf32_switches

    switches = tf32_switches()  # the old getters raise once torch >= 2.9's new API turned TF32 on
    words = f"TF32 switches ({switches['api']} API): cuda.matmul {switches['matmul']}, cudnn {switches['cudnn']}"
    return [("torch defaults", words, torch.cuda.is_available())]


def _jax_has_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@needs("jax")
def _jax_defaults() -> list[tuple[str, str, bool]]:
    import jax

    words = f"jax_default_matmul_precision = {jax.config.jax_default_matmul_precision!r} (None: the platform's default precision)"
    return [("jax defaults", words, _jax_has_gpu())]


def float32_matmul_defaults() -> list[tuple[str, str, bool]]:
    """(library's defaults, in words, whether it has a GPU here) for each installed library that has a TF32 default."""
    return run_installed((_torch_defaults, _jax_defaults))


@needs("torch")
def _torch_on_gpu(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray]]:
    import torch

    if not torch.cuda.is_available():
        return []
    from ..torch.common import matmul_precision

    ta, tb = torch.from_numpy(a).float().cuda(), torch.from_numpy(b).float().cuda()
    rows = []
    for allow in (False, True):
        with matmul_precision(allow):  # set, then restored through the API it was read with
            rows.append(
                (f"torch cuda float32 {_size(a, b)} matmul, allow_tf32={allow}", (ta @ tb).cpu().double().numpy())
            )
    return rows


@needs("jax")
def _jax_on_gpu(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray]]:
    if not _jax_has_gpu():
        return []
    import jax
    import jax.numpy as jnp

    device = jax.devices("gpu")[0]
    ja, jb = (
        jax.device_put(jnp.asarray(a, jnp.float32), device),
        jax.device_put(jnp.asarray(b, jnp.float32), device),
    )
    return [
        (
            f"jax gpu float32 {_size(a, b)} dot, precision={precision}",
            np.asarray(jnp.dot(ja, jb, precision=precision), dtype=np.float64),
        )
        for precision in (None, jax.lax.Precision.HIGHEST)
    ]


def _size(a: np.ndarray, b: np.ndarray) -> str:
    return f"{a.shape[0]}x{b.shape[1]}"


def float32_matmul_on_gpu(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """``a @ b`` in float32 on each installed library's GPU, TF32 allowed and not: (the call, the product in
    float64 NumPy). Empty on a machine without a GPU."""
    return run_installed((_torch_on_gpu, _jax_on_gpu), a, b)
