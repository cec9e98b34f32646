"""What the project needs to know about one array library: the interface every framework class fills in.

A `Framework` answers, for its own arrays and its own runtime, every question that code
outside the adapters would otherwise answer by branching on a library's name: which
arrays are its, how they become NumPy, how they are copied and whether two of them share
memory, their strides and contiguity, how to wait for a device, whether a GPU is seen,
the peak device memory, threads in a benchmark child, the GEMM-peak product, the
bandwidth's copy, the arrays of a benchmark kernel, precision facts and a start-up estimate. The defaults here are those of a library with none of
these facilities (a CPU-only array type following NumPy's protocol), so a new library
overrides only what it has. Nothing here imports a framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from collections.abc import Callable

UNKNOWN_LAYOUT = "n/a, not readable from this array type"

# (launch, sync, facts): ``launch()`` starts one product or copy (asynchronous on a GPU and for JAX),
# ``sync()`` waits for everything launched, ``facts`` says what ran.
Program = tuple[Callable[[], None], Callable[[], None], dict]
GemmProgram = Program  # the GEMM peak's and the paired reference's product (`Framework.gemm_program`)
CopyProgram = Program  # the copy bandwidth's STREAM copy (`Framework.copy_program`)


def numpy_like(value) -> bool:
    """Whether ``value`` follows NumPy's memory protocol (``.strides``, ``.itemsize``, ``.flags``)."""
    return all(hasattr(value, name) for name in ("strides", "itemsize", "flags"))


def upcast_bfloat16(array: np.ndarray) -> np.ndarray:
    """bfloat16 (ml_dtypes) -> float32, exactly (every bfloat16 is a float32); any other dtype unchanged."""
    import numpy as np

    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


class Framework:
    """One array library. Subclasses set the class attributes and override what their library has."""

    name: str = ""
    modules: tuple[str, ...] = ()  # top-level modules whose types are this library's arrays
    drives_gpu = False  # whether the library can run on a GPU (then `gpu_probe` says if it sees one)
    # Seconds a fresh child spends before it times anything (interpreter start, import, client start),
    # roughly as measured on the project's 2-core machine; only for the estimate printed before a sweep.
    startup_s = 0.5
    # Why strides/contiguity/sharing cannot be read where the library does not expose them.
    layout_unknown = UNKNOWN_LAYOUT
    # Why "view, copy or new buffer" has no answer for its arrays (None: the recorded provenance answers).
    provenance_unknown: str | None = None
    # The library's array module, by import name ("numpy", "torch", "jax.numpy"): `namespace` imports it.
    array_module: str | None = None

    def owns(self, value) -> bool:
        """Whether ``value`` is an array of this library (read from its type's module; imports nothing)."""
        return type(value).__module__.split(".")[0] in self.modules

    def namespace(self):
        """The library's array module (``numpy``, ``torch``, ``jax.numpy``: `array_module`), imported now."""
        if self.array_module is None:
            raise NotImplementedError(f"{self.name} names no array module")
        import importlib

        return importlib.import_module(self.array_module)

    # -- arrays ------------------------------------------------------------------------------

    def to_numpy(self, value) -> np.ndarray:
        """One of its arrays -> NumPy, bfloat16 upcast to float32 (exactly)."""
        import numpy as np

        return upcast_bfloat16(np.asarray(value))

    def snapshot(self, value):
        """A copy taken now that keeps the original's memory order (for stage recording)."""
        import numpy as np

        return np.array(value, copy=True, order="K")

    def shares_memory(self, a, b) -> bool | None:
        """Whether two of its arrays use the same memory; None where the library cannot say."""
        import numpy as np

        if numpy_like(a) and numpy_like(b):
            # may_share_memory is a cheap bounds test; shares_memory settles the rare overlap.
            return bool(np.may_share_memory(a, b) and np.shares_memory(a, b))
        return None

    def strides(self, value) -> tuple[int, ...] | None:
        """Strides counted in elements (not bytes), or None where the library does not expose them."""
        if numpy_like(value):
            return tuple(int(stride) // value.itemsize for stride in value.strides)
        return None

    def contiguity(self, value) -> str | None:
        """``"C"`` (row-major contiguous), ``"F"`` (column-major only), ``"no"``, or None where unreadable."""
        if numpy_like(value):
            if value.flags.c_contiguous:
                return "C"
            return "F" if value.flags.f_contiguous else "no"
        return None

    # -- devices -----------------------------------------------------------------------------

    def synchronize(self, value) -> None:
        """Wait until ``value`` (a result of this library) is computed; a no-op where work is synchronous."""

    def gpu_probe(self) -> tuple[bool, str]:
        """(sees a GPU, why not), asked only when `drives_gpu`."""
        return False, f"{self.name} runs on the CPU only"

    def reset_peak_memory(self) -> None:
        """Restart the count of peak device allocation (where the library keeps one)."""

    def peak_memory_mb(self) -> float | None:
        """The library's own peak device allocation so far, in MiB, or None where it keeps none."""
        return None

    def configure_threads(self, threads: int) -> dict:
        """Set the library's runtime thread knobs in a pinned benchmark child; returns what was set."""
        return {}

    # -- the GEMM peak -----------------------------------------------------------------------

    def gemm_unsupported(self, dtype: str, device: str) -> str | None:
        """Why this library cannot give a meaningful GEMM peak for (dtype, device), or None."""
        return None if device == "cpu" else f"{self.name} runs on the CPU only"

    def gemm_program(self, n: int, dtype: str, device: str) -> GemmProgram | None:
        """The square ``n`` x ``n`` product of the GEMM peak and the paired reference; None: not offered."""
        return None

    # -- the copy bandwidth ------------------------------------------------------------------

    copy_dtype: str | None = None  # the dtype of its STREAM copy (`copy_program`); None: it offers no copy

    def copy_unsupported(self, device: str) -> str | None:
        """Why this library cannot time its copy on ``device``, or None."""
        if self.copy_dtype is None:
            return f"{self.name} offers no copy program"
        return None if device == "cpu" or self.drives_gpu else f"{self.name} runs on the CPU only"

    def copy_program(self, array_bytes: int, device: str) -> CopyProgram | None:
        """STREAM's copy ``dst[:] = src`` of a `copy_dtype` array of about ``array_bytes`` bytes on ``device``
        (`benchmarks.bandwidth`); ``facts``: library, version, dtype, itemsize, elements and ``arrays``
        (source, destination), so that a caller can check what was copied; None: not offered."""
        return None

    # -- the arrays of a benchmark kernel ------------------------------------------------------

    def kernel_arrays(self, device: str, dtype: str):
        """(the library's module, ``sync(result)``, ``make(*shape)``) for a benchmark kernel written in the
        library's own idiom (`benchmarks.microbench`): ``sync`` waits for the device and returns the result,
        ``make`` draws standard normals from one generator seeded 0, on ``device``, in ``dtype``."""
        raise NotImplementedError(f"{self.name} has no benchmark kernels")


class OpaqueLayout(Framework):
    """A library whose arrays are immutable values in buffers it places itself (JAX's XLA, MLX): strides,
    contiguity and memory sharing have no answer (its `layout_unknown` says why), never a guess."""

    def shares_memory(self, a, b) -> None:
        return None

    def strides(self, value) -> None:
        return None

    def contiguity(self, value) -> None:
        return None


def env_note(name: str) -> str:
    """`` (NAME='value')`` when the environment variable is set (it may hide a GPU), else empty."""
    import os

    value = os.environ.get(name)
    return "" if value is None else f" ({name}={value!r})"
