"""JAX in the framework layer: arrays, devices, float64, matmul precision, threads and the GEMM product.

Nothing here imports JAX at module import; every method imports it when called.

* float64 needs ``jax_enable_x64`` (`enable_float64_if_needed`; why it is lazy: `backends.jax.common`).
* Six precision names select three lowered programs (`LOWERED_PRECISION`); only HIGHEST keeps
  float32 throughout, the others may use TF32 on a GPU (`allows_tf32`).
* JAX arrays are immutable and XLA chooses their buffers: strides, contiguity and memory
  sharing have no answer (`layout_unknown`), never a guess.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from .._tf32 import forced_note, tf32_forced
from .interface import GemmProgram, OpaqueLayout, env_note, upcast_bfloat16

XLA_MANAGED = "n/a, XLA-managed"

MATMUL_PRECISIONS = ("highest", "high", "default", "bfloat16", "tensorfloat32", "float32")
# What each name of ``jax.default_matmul_precision`` puts into the lowered program (the
# ``precision = [X, X]`` of every float32 ``dot_general``; a test lowers each name and reads
# it): "highest", "high" and "default" lower to their upper-case selves (``jax.lax.Precision``),
# each alias to the name it stands for. Names that lower alike run alike.
PRECISION_ALIASES = {"float32": "highest", "tensorfloat32": "high", "bfloat16": "default"}
LOWERED_PRECISION = {name: PRECISION_ALIASES.get(name, name).upper() for name in MATMUL_PRECISIONS}


def allows_tf32(matmul_precision: str) -> bool:
    """Whether a float32 product at this precision name may use TF32 on a GPU: every name but full float32.

    On NVIDIA GPUs XLA runs DEFAULT and HIGH float32 products with TF32 where the hardware
    has it; only HIGHEST keeps float32 arithmetic. Torch adapters given a JAX precision name
    (einops on torch arrays) turn TF32 on by the same rule.
    """
    return LOWERED_PRECISION[check_matmul_precision(matmul_precision)] != "HIGHEST"


def check_matmul_precision(precision: object) -> str:
    if not isinstance(precision, str) or precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}; got {precision!r}")
    return precision


def enable_float64_if_needed(dtype: str) -> None:
    """Turn on ``jax_enable_x64`` when float64 is asked for (process-global; see module docstring)."""
    if dtype != "float64":
        return
    import jax

    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def jax_devices() -> tuple[str, ...]:
    """("cpu",) plus "gpu" when JAX sees a GPU platform."""
    import jax

    try:
        has_gpu = len(jax.devices("gpu")) > 0
    except RuntimeError:  # "Unknown backend: 'gpu' requested ..." on CPU-only installs
        has_gpu = False
    return ("cpu", "gpu") if has_gpu else ("cpu",)


def jax_device(device: str):
    import jax

    return jax.devices(device)[0]


def effective_precision(matmul_precision: str) -> str:
    """The precision name a program is lowered at: ``matmul_precision``, or "tensorfloat32" in its
    place when `_tf32.tf32_forced` asks for TF32 and it would otherwise be full float32."""
    if tf32_forced() and not allows_tf32(matmul_precision):
        return "tensorfloat32"
    return matmul_precision


def precision_info(*, device: str, dtype: str, matmul_precision: str) -> dict:
    """What Prepared.info records about numerics, so reports can say what was compared."""
    import jax

    matmul_precision = effective_precision(matmul_precision)
    info = {
        "matmul_precision": matmul_precision,
        "lowered_precision": LOWERED_PRECISION[matmul_precision],
        "jax_enable_x64": bool(jax.config.jax_enable_x64),
        **forced_note(),
    }
    if device == "gpu" and dtype == "float32":
        info["tf32"] = allows_tf32(matmul_precision)
    return info


class JaxFramework(OpaqueLayout):
    name = "jax"
    modules = ("jax", "jaxlib")
    drives_gpu = True
    startup_s = 1.5
    layout_unknown = XLA_MANAGED
    provenance_unknown = "n/a (immutable; XLA places buffers)"
    array_module = "jax.numpy"

    def to_numpy(self, value) -> np.ndarray:
        import numpy as np

        return upcast_bfloat16(np.asarray(value))

    def synchronize(self, value) -> None:
        block = getattr(value, "block_until_ready", None)
        if block is not None:
            block()

    def gpu_probe(self) -> tuple[bool, str]:
        import jax

        if "gpu" in jax_devices():
            return True, ""
        platforms = sorted({device.platform for device in jax.devices()})
        return False, (
            f"jax {jax.__version__} sees no GPU (its devices: {', '.join(platforms)})"
            f"{env_note('JAX_PLATFORMS')}{env_note('CUDA_VISIBLE_DEVICES')}; plain jax is CPU-only: "
            "install its CUDA plugin, pip install 'jax[cuda13]' (or 'jax[cuda12]')"
        )

    def peak_memory_mb(self) -> float | None:
        # JAX keeps no resettable peak: it is read as it stands.
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None

    def configure_threads(self, threads: int) -> dict:
        import jax

        # XLA's CPU threads are fixed when its client starts; creating the client here keeps its
        # start-up out of prepare() and the memory baseline.
        return {"jax_devices": [str(device) for device in jax.devices()]}

    def gemm_unsupported(self, dtype: str, device: str) -> str | None:
        return None

    def gemm_program(self, n: int, dtype: str, device: str) -> GemmProgram:
        import jax
        import jax.numpy as jnp

        enable_float64_if_needed(dtype)  # without jax_enable_x64, float64 arrays silently become float32
        target = jax_device(device)
        key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
        a = jax.device_put(jax.random.normal(key_a, (n, n), dtype=jnp.dtype(dtype)), target)
        b = jax.device_put(jax.random.normal(key_b, (n, n), dtype=jnp.dtype(dtype)), target)
        # "highest": no reduced-precision passes for float32 on GPU, as in the cells (TF32 only when forced).
        precision = effective_precision("highest")
        product = jax.jit(lambda x, y: jnp.matmul(x, y, precision=precision))
        last = [product(a, b)]  # compile outside the timing
        last[0].block_until_ready()

        def launch() -> None:
            last[0] = product(a, b)

        facts = {"jax": jax.__version__, "operand_dtype": str(a.dtype), "matmul_precision": precision}
        if device == "gpu":
            facts["tf32"] = precision != "highest" and dtype == "float32"
        return launch, lambda: last[0].block_until_ready(), facts
