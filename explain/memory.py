"""Memory facts about one array of any library: strides, contiguity, shared storage.

Each question is answered from the array itself (NumPy ``.strides``, torch
``.stride()`` and ``untyped_storage()``); nothing is typed in by hand. JAX arrays are
immutable and XLA chooses their buffers, so for them the answer is "n/a" with that
reason rather than a guess. An array of another library (a backend registered later)
is named by its module and answered where it follows NumPy's protocol (``.strides``,
``.itemsize``, ``.flags``), else "n/a".
"""

from __future__ import annotations

import numpy as np

XLA_MANAGED = "n/a, XLA-managed"
UNKNOWN_LAYOUT = "n/a, not readable from this array type"


def array_library(value) -> str:
    """``"numpy"``, ``"torch"``, ``"jax"``, or the top-level module of any other array type."""
    if isinstance(value, np.ndarray):
        return "numpy"
    module = type(value).__module__.split(".")[0]
    return "jax" if module == "jaxlib" else module


def _numpy_like(value) -> bool:
    return all(hasattr(value, name) for name in ("strides", "itemsize", "flags"))


def strides_in_elements(value) -> tuple[int, ...] | None:
    """Strides counted in elements (not bytes), or None where the library does not expose them (XLA)."""
    library = array_library(value)
    if library == "torch":
        return tuple(value.stride())
    if library != "jax" and _numpy_like(value):
        return tuple(int(stride) // value.itemsize for stride in value.strides)
    return None


def unknown_layout(value) -> str:
    """What to print where strides or contiguity cannot be read: XLA's reason for JAX, else a general one."""
    return XLA_MANAGED if array_library(value) == "jax" else UNKNOWN_LAYOUT


def contiguity(value) -> str:
    """``"C"`` (row-major contiguous), ``"F"`` (column-major only), ``"no"``, or n/a (JAX, unknown types)."""
    library = array_library(value)
    if library == "torch":
        if value.is_contiguous():
            return "C"
        # A tensor whose reversed dims are contiguous is column-major (F order).
        return "F" if value.dim() > 1 and value.permute(*reversed(range(value.dim()))).is_contiguous() else "no"
    if library != "jax" and _numpy_like(value):
        if value.flags.c_contiguous:
            return "C"
        return "F" if value.flags.f_contiguous else "no"
    return unknown_layout(value)


def shares_memory(a, b) -> bool | None:
    """Whether two arrays of the same library use the same memory (None: unknowable, e.g. for JAX)."""
    library = array_library(a)
    if library != array_library(b) or library not in ("numpy", "torch"):
        return None
    from mha_rosetta.backends._recording import shares_memory as same_memory  # the adapters' own test

    return same_memory(a, b)
