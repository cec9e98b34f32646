"""mha_rosetta.backends: one adapter per framework convention, registered by name.

Importing this package imports no framework. `available_backends` imports each
framework once to see that it really loads (`_probe.import_failure`: a library that is
installed but fails to import is a skip with the error, not a crash), and `get_backend`
imports an adapter's module only when that backend is asked for.
The registry is an explicit dict: adding a backend is one line here plus its module.
Backends from other packages come in through `register` (a class or a module path) or
the entry-point group ``mha_rosetta.backends`` (`backends.plugins`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import plugins
from ._chunking import CHUNKED, DEFAULT_CHUNK
from ._probe import import_failure, probe
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
    check_device_name,
)


@dataclass(frozen=True)
class BackendEntry:
    module: str  # a module of this package ("numpy_backend") or a fully qualified one ("mypkg.attention")
    cls: str
    requires: tuple[str, ...] = ()  # modules the backend imports; each is probed by importing it once
    extra: str = ""  # the mha-rosetta extra that installs them ("" for a plugin: its own package does)
    kwargs: dict = field(default_factory=dict)
    # "implementation" or "oracle" (a library's own attention, fed our parameters);
    # None for a plugin named by a path: its class says, once loaded.
    kind: str | None = "implementation"


REGISTRY: dict[str, BackendEntry] = {}


def register(name: str, entry) -> None:
    """Add a backend: a `BackendEntry`, a `Backend` subclass or a ``"package.module:Class"`` path."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    if name in REGISTRY:
        raise ValueError(f"a backend named {name!r} is already registered")
    REGISTRY[name] = plugins.as_entry(entry)


def _missing_modules(entry: BackendEntry) -> list[str]:
    return [module for module in entry.requires if import_failure(module)]


def available_backends(kind: str | None = None) -> list[str]:
    """Names of the registered backends whose frameworks import here (each imported once to check)."""
    return [name for name, entry in REGISTRY.items() if not _missing_modules(entry) and kind in (None, entry.kind)]


def missing_backends() -> dict[str, str]:
    """Registered backends that cannot load here, each with the reason and install command."""
    return {name: _not_installed_message(name, entry) for name, entry in REGISTRY.items() if _missing_modules(entry)}


def _not_installed_message(name: str, entry: BackendEntry) -> str:
    missing = _missing_modules(entry)
    broken = [probe(module).reason for module in missing if probe(module).installed]
    if broken:
        return f"backend {name!r} cannot load: {'; '.join(broken)}"
    how = f"pip install 'mha-rosetta[{entry.extra}]'" if entry.extra else f"install {', '.join(missing)}"
    return f"backend {name!r} needs {', '.join(missing)}, which is not installed: {how}"


_INSTANCES: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The adapter registered as ``name``; its framework is imported when it first runs."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered backends: {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    if _missing_modules(entry):
        raise BackendNotInstalled(_not_installed_message(name, entry))
    if name not in _INSTANCES:
        # The instance reads its kind and requires from this entry (Backend.__init__).
        backend = plugins.load_class(entry)(name=name, **entry.kwargs)
        if entry.kind is None:  # a plugin named by a path: now its class has said
            REGISTRY[name] = replace(entry, kind=backend.kind, requires=tuple(backend.requires))
            if _missing_modules(REGISTRY[name]):
                raise BackendNotInstalled(_not_installed_message(name, REGISTRY[name]))
        _INSTANCES[name] = backend
    return _INSTANCES[name]


# Implementations: the same MHA, each in the convention its library's users write.
register("numpy", BackendEntry("numpy_backend", "NumpyBackend", ("numpy",), "test"))
register("torch", BackendEntry("torch_backend", "TorchBackend", ("torch",), "torch"))
register("jax", BackendEntry("jax_backend", "JaxBackend", ("jax",), "jax"))
register(
    "einops-numpy", BackendEntry("einops_backend", "EinopsBackend", ("einops",), "einops", {"array_library": "numpy"})
)
register(
    "einops-torch",
    BackendEntry("einops_backend", "EinopsBackend", ("einops", "torch"), "einops,torch", {"array_library": "torch"}),
)
register(
    "einops-jax",
    BackendEntry("einops_backend", "EinopsBackend", ("einops", "jax"), "einops,jax", {"array_library": "jax"}),
)
# The same layer split over several devices or processes by heads (tensor parallelism).
register("jax-sharded", BackendEntry("jax_sharded", "JaxShardedBackend", ("jax",), "jax"))
register("torch-tp", BackendEntry("torch_tp", "TorchTPBackend", ("torch",), "torch"))
# Third-party oracles: the libraries' own attention, fed the canonical parameters.
register(
    "torch-mha",
    BackendEntry("torch_oracles", "TorchMHAOracle", ("torch",), "torch", {"batch_first": True}, kind="oracle"),
)
register(
    "torch-mha-seqfirst",
    BackendEntry("torch_oracles", "TorchMHAOracle", ("torch",), "torch", {"batch_first": False}, kind="oracle"),
)
register("torch-sdpa", BackendEntry("torch_oracles", "TorchSDPAOracle", ("torch",), "torch", kind="oracle"))
register("jax-dpa", BackendEntry("jax_oracles", "JaxDotProductAttentionOracle", ("jax",), "jax", kind="oracle"))
register("flax", BackendEntry("jax_oracles", "FlaxMHAOracle", ("flax", "jax"), "flax", kind="oracle"))
register("equinox", BackendEntry("jax_oracles", "EquinoxMHAOracle", ("equinox", "jax"), "equinox", kind="oracle"))
# Third-party packages' backends (entry-point group "mha_rosetta.backends"), none imported.
plugins.discover_entry_points()

__all__ = [
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
    "check_device_name",
    "get_backend",
    "missing_backends",
    "register",
]
