"""The framework layer: what the project needs to know about each array library, in one place per library.

In the spirit of einops' ``_backends.py``. Design rules:

1. One class per array library (`numpy.NumpyFramework`, `torch.TorchFramework`,
   `jax.JaxFramework`), each filling in `interface.Framework`: recognising its arrays and
   converting them to NumPy, copies and memory sharing for stage recording, strides and
   contiguity for the explainer, synchronising, probing for a GPU, peak device memory,
   threads in a pinned benchmark child, the GEMM-peak product, the copy-bandwidth program,
   the arrays of a benchmark kernel, precision and TF32 facts, a start-up estimate.
2. A library is imported inside the methods of its class only, when a question about it
   is asked; importing this package imports NumPy and nothing else. An array is
   recognised by its type's module name, so asking about a NumPy array never imports torch.
3. `FRAMEWORKS` is the explicit registry, keyed by library name (the module names that
   `BackendEntry.requires` lists). A new library registers its class with
   `register_framework`; checks, benchmarks, the explainer, diagnose and models ask this
   layer and never branch on a library's name.
4. This layer sits below the adapters: it imports only `core`, `backends._tf32` and itself,
   so every adapter and `backends.base` may import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from .interface import UNKNOWN_LAYOUT, CopyProgram, Framework, GemmProgram, Program, numpy_like, upcast_bfloat16
from .jax import XLA_MANAGED, JaxFramework
from .mlx import MlxFramework
from .numpy import NumpyFramework
from .onnx import OnnxRuntimeFramework
from .torch import TorchFramework

# library name -> its framework; the order is the order of preference where several could answer
# (the GEMM peak's libraries, the device peak memory of a cell that uses two).
FRAMEWORKS: dict[str, Framework] = {
    "numpy": NumpyFramework(),
    "torch": TorchFramework(),
    "jax": JaxFramework(),
    "onnxruntime": OnnxRuntimeFramework(),
    "mlx": MlxFramework(),
}

# Libraries that backends require without arrays of their own (they run on one of the above):
# seconds a fresh child spends importing them, as `Framework.startup_s`.
LIBRARY_STARTUP_S = {"einops": 0.5, "flax": 2.0, "equinox": 2.0, "onnx": 0.5, "onnxscript": 1.0}


def register_framework(framework: Framework) -> Framework:
    """Add an array library to the layer (a plugin's own); its ``name`` must be new."""
    if not isinstance(framework, Framework):
        raise TypeError(f"framework must be a Framework instance; got {type(framework).__name__}")
    if not framework.name or framework.name in FRAMEWORKS:
        raise ValueError(f"framework name must be new and non-empty; got {framework.name!r}")
    FRAMEWORKS[framework.name] = framework
    return framework


def get_framework(name: str) -> Framework:
    """The framework registered as ``name``."""
    if name not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}; got {name!r}")
    return FRAMEWORKS[name]


def framework_of(value) -> Framework | None:
    """The framework whose array ``value`` is, or None for an array of no registered library."""
    return next((framework for framework in FRAMEWORKS.values() if framework.owns(value)), None)


def array_library(value) -> str:
    """The registered library of ``value``, or the top-level module of any other array type."""
    framework = framework_of(value)
    return framework.name if framework else type(value).__module__.split(".")[0]


def to_numpy(value) -> np.ndarray:
    """An array of any registered library (or anything ``np.asarray`` takes) -> NumPy, bfloat16 as float32."""
    import numpy as np

    framework = framework_of(value)
    return framework.to_numpy(value) if framework else upcast_bfloat16(np.asarray(value))


def _answering(value) -> Framework:
    return framework_of(value) or Framework()  # unknown types: NumPy's protocol where they follow it


def snapshot(value):
    """A copy taken now that keeps ``value``'s memory order (stage recording)."""
    return _answering(value).snapshot(value)


def shares_memory(a, b) -> bool | None:
    """Whether two arrays of the same library use the same memory (None: unknowable, or two libraries)."""
    if array_library(a) != array_library(b):
        return None
    return _answering(a).shares_memory(a, b)


def strides_in_elements(value) -> tuple[int, ...] | None:
    """Strides counted in elements (not bytes), or None where the library does not expose them (XLA)."""
    return _answering(value).strides(value)


def unknown_layout(value) -> str:
    """What to print where strides or contiguity cannot be read: the library's own reason."""
    return _answering(value).layout_unknown


def layout_unknown_of(library: str) -> str:
    """`unknown_layout` for a library named in a table row (a library not registered: the general reason)."""
    return FRAMEWORKS[library].layout_unknown if library in FRAMEWORKS else UNKNOWN_LAYOUT


def provenance_unknown(value) -> str | None:
    """Why whether ``value`` is a view, a copy or a new buffer has no answer (JAX), or None."""
    return _answering(value).provenance_unknown


def contiguity(value) -> str:
    """``"C"``, ``"F"``, ``"no"``, or the library's reason why it cannot be read."""
    framework = _answering(value)
    answer = framework.contiguity(value)
    return framework.layout_unknown if answer is None else answer


def gpu_frameworks() -> dict[str, Framework]:
    """The registered libraries that can drive a GPU (their `gpu_probe` says whether they see one)."""
    return {name: framework for name, framework in FRAMEWORKS.items() if framework.drives_gpu}


def startup_s(module: str) -> float:
    """Seconds a fresh child spends importing ``module`` (an entry of `BackendEntry.requires`); 0.5 if unknown."""
    if module in FRAMEWORKS:
        return FRAMEWORKS[module].startup_s
    return LIBRARY_STARTUP_S.get(module, 0.5)


def copy_libraries() -> list[str]:
    """The registered libraries that offer the copy-bandwidth program (`Framework.copy_dtype`), in registry order."""
    return [name for name, framework in FRAMEWORKS.items() if framework.copy_dtype is not None]


def in_order(names) -> list[Framework]:
    """The registered frameworks among ``names``, in registry order (unregistered names are skipped)."""
    return [framework for name, framework in FRAMEWORKS.items() if name in set(names)]


__all__ = [
    "FRAMEWORKS",
    "LIBRARY_STARTUP_S",
    "UNKNOWN_LAYOUT",
    "XLA_MANAGED",
    "CopyProgram",
    "Framework",
    "GemmProgram",
    "Program",
    "array_library",
    "contiguity",
    "copy_libraries",
    "framework_of",
    "get_framework",
    "gpu_frameworks",
    "in_order",
    "layout_unknown_of",
    "numpy_like",
    "provenance_unknown",
    "register_framework",
    "shares_memory",
    "snapshot",
    "startup_s",
    "strides_in_elements",
    "to_numpy",
    "unknown_layout",
]
