"""mha_rosetta.backends: one adapter per framework convention, registered by name.

Importing this package imports no framework. The registry (`registry`: the built-in
backends, `register`, `get_backend`, plugin discovery through the entry-point group
``mha_rosetta.backends``) says when each framework is imported.
"""

from __future__ import annotations

from ._chunking import CHECK_CHUNK, CHUNKED, DEFAULT_CHUNK
from ._probe import import_failure, installed
from ._tf32 import tf32_forced
from .base import (
    DIRECT_RESHAPE,
    KNOWN_WRONG_STRATEGIES,
    PER_HEAD,
    SLICING,
    STANDARD,
    Backend,
    BackendNotInstalled,
    Prepared,
    PreparedVJP,
    StageTensor,
    UnsupportedCase,
    canonical_stage,
    check_device_name,
)
from .registry import (
    REGISTRY,
    BackendEntry,
    available_backends,
    get_backend,
    missing_backends,
    register,
    registered_classes,
)

__all__ = [
    "CHECK_CHUNK",
    "CHUNKED",
    "DEFAULT_CHUNK",
    "DIRECT_RESHAPE",
    "KNOWN_WRONG_STRATEGIES",
    "PER_HEAD",
    "REGISTRY",
    "SLICING",
    "STANDARD",
    "Backend",
    "BackendEntry",
    "BackendNotInstalled",
    "Prepared",
    "PreparedVJP",
    "StageTensor",
    "UnsupportedCase",
    "available_backends",
    "canonical_stage",
    "check_device_name",
    "get_backend",
    "import_failure",
    "installed",
    "missing_backends",
    "register",
    "registered_classes",
    "tf32_forced",
]
