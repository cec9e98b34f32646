"""The NumPy family: column samples, ``Y = W @ X + b`` (`adapter.NumpyBackend`).

Every family subpackage has the same files: ``adapter`` (the `Backend` subclass, what the
registry loads), ``layer`` (the forward pass the adapter, ``chunked`` and ``vjp`` share),
``chunked`` (the memory-linear strategy), ``vjp`` (the backward pass) and ``common`` (the
library's conversions, dtypes and precision, also used by the oracles and einops).
"""

from __future__ import annotations

from .adapter import NumpyBackend

__all__ = ["NumpyBackend"]
