"""The JAX family: one token-first pass per batch item, ``vmap``-ed (`adapter.JaxBackend`).

The same files as every family (see `mha_rosetta.backends.numpy`). JAX is imported
inside the functions, never when this package is imported.
"""

from __future__ import annotations

from .adapter import JaxBackend

__all__ = ["JaxBackend"]
