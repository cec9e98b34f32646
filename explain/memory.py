"""Memory facts about one array of any library: strides, contiguity, shared storage.

Each question is answered from the array itself by the framework layer
(`mha_rosetta.backends.frameworks`: NumPy ``.strides``, torch ``.stride()`` and
``untyped_storage()``); nothing is typed in by hand. JAX arrays are immutable and XLA
chooses their buffers, so for them the answer is "n/a" with that reason rather than a
guess. An array of another library (a backend registered later) is named by its module
and answered where it follows NumPy's protocol (``.strides``, ``.itemsize``, ``.flags``),
else "n/a". This module names those answers for the explainer; it holds none itself.
"""

from __future__ import annotations

from mha_rosetta.backends.frameworks import (
    UNKNOWN_LAYOUT,
    XLA_MANAGED,
    array_library,
    contiguity,
    layout_unknown_of,
    provenance_unknown,
    shares_memory,
    strides_in_elements,
    unknown_layout,
)

__all__ = [
    "UNKNOWN_LAYOUT",
    "XLA_MANAGED",
    "array_library",
    "contiguity",
    "layout_unknown_of",
    "provenance_unknown",
    "shares_memory",
    "strides_in_elements",
    "unknown_layout",
]
