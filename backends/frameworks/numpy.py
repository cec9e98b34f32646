"""NumPy in the framework layer: the canonical arrays every other library converts to.

CPU only and synchronous; strides and sharing come from NumPy's own protocol (the
interface's defaults). Its BLAS covers float32/float64 only: float16/bfloat16 products are
plain loops, minutes at n=1024 and no measure of the machine, so they give no GEMM peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from .interface import Framework, GemmProgram

_BLAS_DTYPES = ("float32", "float64")


class NumpyFramework(Framework):
    name = "numpy"
    modules = ("numpy",)
    startup_s = 0.5

    def owns(self, value) -> bool:
        import numpy as np

        return isinstance(value, (np.ndarray, np.generic))

    def namespace(self):
        import numpy as np

        return np

    def gemm_unsupported(self, dtype: str, device: str) -> str | None:
        if device != "cpu":
            return "NumPy runs on the CPU only"
        if dtype not in _BLAS_DTYPES:
            return f"NumPy has no BLAS product for {dtype}"
        return None

    def gemm_program(self, n: int, dtype: str, device: str) -> GemmProgram:
        import numpy as np

        from mha_rosetta.core import numpy_dtype

        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n)).astype(numpy_dtype(dtype))  # (n, n), C-contiguous
        b = rng.standard_normal((n, n)).astype(numpy_dtype(dtype))
        out = np.empty_like(a)

        def launch() -> None:
            np.matmul(a, b, out=out)

        return launch, lambda: None, {"numpy": np.__version__, "operand_dtype": str(a.dtype)}
