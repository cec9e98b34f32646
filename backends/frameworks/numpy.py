"""NumPy in the framework layer: the canonical arrays every other library converts to.

CPU only and synchronous; strides and sharing come from NumPy's own protocol (the
interface's defaults). Its copy (the bandwidth's) is float64, 8 bytes an element. Its BLAS covers float32/float64 only: float16/bfloat16 products are
plain loops, minutes at n=1024 and no measure of the machine, so they give no GEMM peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from .interface import CopyProgram, Framework, GemmProgram

_BLAS_DTYPES = ("float32", "float64")


class NumpyFramework(Framework):
    name = "numpy"
    modules = ("numpy",)
    startup_s = 0.5
    copy_dtype = "float64"
    array_module = "numpy"

    def owns(self, value) -> bool:
        import numpy as np

        return isinstance(value, (np.ndarray, np.generic))

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

    def copy_unsupported(self, device: str) -> str | None:
        return None if device == "cpu" else "NumPy has no GPU: the device copy is PyTorch's"

    def copy_program(self, array_bytes: int, device: str) -> CopyProgram:
        import numpy as np

        elements = max(1, array_bytes // 8)
        src = np.arange(elements, dtype=np.float64)  # (elements,) written here: its pages are faulted in
        dst = np.zeros_like(src)  # np.zeros may map untouched pages: the first copy faults them in

        def launch() -> None:
            np.copyto(dst, src)

        facts = {"library": "numpy", "version": np.__version__, "dtype": "float64", "itemsize": 8}
        return launch, lambda: None, {**facts, "elements": elements, "arrays": (src, dst)}
