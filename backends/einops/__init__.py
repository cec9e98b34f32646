"""The einops family: one set of einsum plans run on NumPy, torch or JAX arrays (`adapter.EinopsBackend`).

``plans`` holds the einsum plans, ``layer`` the pipeline that runs them, ``adapter`` the
`Backend` subclass, ``vjp`` the backward pass (the array library's own autodiff) and ``mla`` DeepSeek's latent
attention in its two forms (the ``naive`` and ``absorbed`` strategies).
"""

from __future__ import annotations

from .adapter import EinopsBackend

__all__ = ["EinopsBackend"]
