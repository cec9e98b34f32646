"""The PyTorch family: row samples through ``nn.Linear`` (`adapter.TorchBackend`).

The same files as every family (see `mha_rosetta.backends.numpy`). Torch is imported
inside the functions, never when this package is imported.
"""

from __future__ import annotations

from .adapter import TorchBackend

__all__ = ["TorchBackend"]
