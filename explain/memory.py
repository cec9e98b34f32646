"""Memory facts about one array of any library: strides, contiguity, shared storage.

Each question is answered from the array itself (NumPy ``.strides``, torch
``.stride()`` and ``untyped_storage()``); nothing is typed in by hand. JAX arrays are
immutable and XLA chooses their buffers, so for them the answer is "n/a" with that
reason rather than a guess.
"""

from __future__ import annotations

import numpy as np

XLA_MANAGED = "n/a, XLA-managed"


def array_library(value) -> str:
    """``"numpy"``, ``"torch"`` or ``"jax"``: which library holds ``value``."""
    if isinstance(value, np.ndarray):
        return "numpy"
    module = type(value).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    raise TypeError(f"expected a NumPy array, torch tensor or JAX array, got {type(value).__name__}")


def strides_in_elements(value) -> tuple[int, ...] | None:
    """Strides counted in elements (not bytes), or None where XLA manages the layout."""
    library = array_library(value)
    if library == "numpy":
        return tuple(stride // value.itemsize for stride in value.strides)
    if library == "torch":
        return tuple(value.stride())
    return None


def contiguity(value) -> str:
    """``"C"`` (row-major contiguous), ``"F"`` (column-major only), ``"no"``, or n/a for JAX."""
    library = array_library(value)
    if library == "numpy":
        if value.flags.c_contiguous:
            return "C"
        return "F" if value.flags.f_contiguous else "no"
    if library == "torch":
        if value.is_contiguous():
            return "C"
        # A tensor whose reversed dims are contiguous is column-major (F order).
        return "F" if value.dim() > 1 and value.permute(*reversed(range(value.dim()))).is_contiguous() else "no"
    return XLA_MANAGED


def shares_memory(a, b) -> bool | None:
    """Whether two arrays of the same library use the same memory (None: unknowable for JAX)."""
    library_a, library_b = array_library(a), array_library(b)
    if library_a != library_b or library_a == "jax":
        return None
    if library_a == "numpy":
        # may_share_memory is a cheap bounds test; shares_memory settles the rare overlap.
        return bool(np.may_share_memory(a, b) and np.shares_memory(a, b))
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
