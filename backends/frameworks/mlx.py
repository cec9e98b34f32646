"""MLX in the framework layer: lazy arrays, ``mx.eval`` as the sync point, float64 on the CPU, the GEMM product.

MLX is imported inside each method: importing this module imports nothing heavy.

* Evaluation is lazy: an MLX operation records a graph node and returns at once; ``mx.eval``
  computes what is asked for (and everything it depends on). So `synchronize` is ``mx.eval``,
  and a timed forward ends with it (`Prepared.synchronize`), or it would time the graph's
  construction only.
* Arrays are immutable values whose buffers MLX allocates when they are evaluated; MLX exposes
  no strides, so layout and memory sharing have no answer here (`layout_unknown`), never a guess.
* float64 runs on the CPU stream only (no float64 on Metal GPUs). Two traps, measured here
  (mlx 0.32.4, Linux CPU wheel): ``mx.array(np_float64)`` silently becomes float32 unless
  ``dtype=mx.float64`` is passed (`to_mlx` passes it), and ``mx.exp``/``sin``/``cos`` are only
  float32-accurate in float64, so a float64 softmax is about 4e-8 off the float64 oracle
  (`FLOAT64_LIMIT`): an MLX float64 run is held to float32's tolerance, declared in
  ``Prepared.info["tolerance_dtype"]`` and reported, never passed silently.
* Half precision: the score steps compute in float32 and round once (`ops_mlx`), as
  ``mx.fast.scaled_dot_product_attention`` does its softmax in float32 whatever the inputs.
* Threads: MLX has no thread knob for its CPU stream; a benchmark child is held by CPU affinity
  (the harness pins it) and its BLAS by ``OPENBLAS_NUM_THREADS``. `configure_threads` says so.
* On Metal (Apple GPUs), not runnable here: the fused SDPA kernels apply, float64 is refused,
  and the GEMM peak is the GPU's. `gpu_probe` reports whether MLX sees a GPU (Metal or CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from .interface import GemmProgram, OpaqueLayout

MLX_LAZY = "n/a, MLX exposes no strides (lazy)"  # its buffers are allocated at mx.eval
# dtype -> the level whose tolerance holds an MLX run of it (the checks read it: `info["tolerance_dtype"]`,
# and `tolerance_levels` on the backward); the reason is `FLOAT64_LIMIT`.
TOLERANCE_LEVELS = {"float64": "float32"}
FLOAT64_LIMIT = (
    "MLX float64 (CPU only): mx.exp, mx.sin and mx.cos are float32-accurate (exp: 2.9e-7 relative on [-5, 5]), so a "
    "float64 attention output is about 4e-8 off (3e-8 to 7e-8 on the check's cases, mlx 0.32.4); the run is held to "
    "float32's tolerance (info['tolerance_dtype']) and reported as a known difference"
)


def mlx_dtype(name: str):
    """One of core.DTYPE_NAMES -> the mlx.core dtype of the same name (MLX has all four; float64 on the CPU)."""
    import mlx.core as mx

    return getattr(mx, name)


def to_mlx(array, dtype: str | None):
    """A NumPy array -> an MLX array of ``dtype`` (None: keep its dtype, e.g. a bool mask or int indices).

    The rounding happens in NumPy from float64 (bfloat16 through ml_dtypes), as every adapter rounds
    the canonical data; the value then goes to MLX exactly (a bfloat16 through float32, which holds
    it). float64 needs ``dtype=mx.float64``: without it ``mx.array`` silently makes float32.
    """
    if array is None:
        return None
    import mlx.core as mx
    import numpy as np

    from mha_rosetta.core import numpy_dtype

    array = np.asarray(array)
    if dtype is None:
        return mx.array(np.ascontiguousarray(array))
    rounded = array.astype(numpy_dtype(dtype))
    if dtype == "bfloat16":
        return mx.array(rounded.astype(np.float32)).astype(mx.bfloat16)  # exact: every bfloat16 is a float32
    return mx.array(np.ascontiguousarray(rounded), dtype=mlx_dtype(dtype))


def mlx_devices() -> tuple[str, ...]:
    """("cpu",) plus "gpu" when MLX sees a GPU (Metal, or the CUDA build)."""
    import mlx.core as mx

    return ("cpu", "gpu") if mx.is_available(mx.gpu) else ("cpu",)


def mlx_stream(device: str):
    """The MLX device a computation runs on (`mx.stream` takes it): the CPU, or the GPU."""
    import mlx.core as mx

    return mx.gpu if device == "gpu" else mx.cpu


def precision_info(dtype: str) -> dict:
    """What `Prepared.info` records about an MLX run's numerics (float64's declared limit included)."""
    import mlx.core as mx

    info = {"mlx": mx.__version__, "half_precision": "score steps and softmax in float32, rounded once"}
    if dtype in TOLERANCE_LEVELS:
        info.update(tolerance_dtype=TOLERANCE_LEVELS[dtype], precision_limit=FLOAT64_LIMIT)
    return info


class MlxFramework(OpaqueLayout):
    name = "mlx"
    modules = ("mlx",)
    drives_gpu = True
    startup_s = 1.0
    layout_unknown = MLX_LAZY
    provenance_unknown = "n/a (immutable, lazy)"
    array_module = "mlx.core"

    def to_numpy(self, value) -> np.ndarray:
        import mlx.core as mx
        import numpy as np

        if value.dtype == mx.bfloat16:
            value = value.astype(mx.float32)  # exact: every bfloat16 is a float32
        return np.array(value)  # evaluates the graph, then copies

    def snapshot(self, value):
        return value  # immutable

    def synchronize(self, value) -> None:
        import mlx.core as mx

        mx.eval(value)

    def gpu_probe(self) -> tuple[bool, str]:
        import mlx.core as mx

        if "gpu" in mlx_devices():
            return True, ""
        return False, (
            f"mlx {mx.__version__} sees no GPU (mx.is_available(mx.gpu) is False): the mlx[cpu] wheel runs on the "
            "CPU; Metal needs Apple silicon, CUDA the mlx[cuda] build"
        )

    def reset_peak_memory(self) -> None:
        import mlx.core as mx

        mx.reset_peak_memory()

    def peak_memory_mb(self) -> float | None:
        import mlx.core as mx

        return mx.get_peak_memory() / 2**20

    def configure_threads(self, threads: int) -> dict:
        import mlx.core as mx

        return {"mlx_threads": "no MLX thread setting: held by CPU affinity", "mlx_device": str(mx.default_device())}

    def gemm_unsupported(self, dtype: str, device: str) -> str | None:
        if device == "gpu" and dtype == "float64":
            return "MLX has no float64 on the GPU"
        return None if device == "cpu" or "gpu" in mlx_devices() else "MLX sees no GPU here"

    def gemm_program(self, n: int, dtype: str, device: str) -> GemmProgram:
        import mlx.core as mx
        import numpy as np

        rng = np.random.default_rng(0)
        with mx.stream(mlx_stream(device)):
            a, b = (to_mlx(rng.standard_normal((n, n)), dtype) for _ in range(2))  # (n, n) each
            mx.eval(a, b)
        last = [a]

        def launch() -> None:
            with mx.stream(mlx_stream(device)):
                last[0] = mx.matmul(a, b)
                mx.async_eval(last[0])  # lazy: without an eval nothing would run

        facts = {"mlx": mx.__version__, "operand_dtype": str(a.dtype).removeprefix("mlx.core."), "device": device}
        return launch, lambda: mx.eval(last[0]), facts

    def kernel_arrays(self, device: str, dtype: str):
        import mlx.core as mx
        import numpy as np

        rng = np.random.default_rng(0)

        def sync(result):
            mx.eval(result)
            return result

        def make(*shape):
            return to_mlx(rng.standard_normal(shape), dtype)

        return mx, sync, make
