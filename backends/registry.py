"""The backend registry: `register`, `get_backend`, `available_backends`, plugins.

The registry is an explicit dict (`entries.REGISTRY`): adding a backend is one line at the
bottom of this module plus its subpackage. Registering imports nothing; `available_backends`
imports each framework once to see that it really loads (`_probe.import_failure`: a library
that is installed but fails to import is a skip with the error, not a crash), and
`get_backend` imports an adapter's module only when that backend is asked for.

Backends from outside this project come in three ways, none of which needs an edit here:

- ``register("mine", MyBackend)``: a `Backend` subclass; its ``kind`` and ``requires``
  class attributes become the registry entry's.
- ``register("mine", "mypkg.attention:MyBackend")`` or ``register("mine",
  BackendEntry("mypkg.attention", "MyBackend"))``: a fully qualified module path. Nothing
  is imported until the backend is first asked for; the class then says its own kind.
- An entry point in the group ``mha_rosetta.backends`` of an installed distribution
  (``[project.entry-points."mha_rosetta.backends"] mine = "mypkg.attention:MyBackend"``).
  Discovery reads the distributions' metadata when `mha_rosetta.backends` is imported
  (importlib.metadata: no plugin module is imported, so no framework either); the module
  is imported when the backend is first used.

A plugin named by a path has ``kind=None`` in its entry until it is first loaded, so
``available_backends(kind="oracle")`` lists it only after `get_backend`. An instance knows
its own ``kind`` and ``requires`` from construction: `Backend.__init__` reads them from the
registry entry of its class (`entries.registered_entry`), so a directly built
``TorchMHAOracle()`` is an oracle too, and a class registered nowhere keeps its class
attributes.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import replace

from ._probe import import_failure, probe
from .base import Backend, BackendNotInstalled
from .entries import REGISTRY, BackendEntry, module_name, registered_entry

ENTRY_POINT_GROUP = "mha_rosetta.backends"

# Entry points that could not be registered (a name taken, no class named), by name.
PLUGIN_PROBLEMS: dict[str, str] = {}


def parse_target(target: str) -> tuple[str, str]:
    """``"pkg.mod:Class"`` -> ``("pkg.mod", "Class")``, with a clear error for anything else."""
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"expected an import path 'package.module:ClassName', got {target!r}")
    module, attr = target.split(":")
    return module.strip(), attr.strip()


def as_entry(target) -> BackendEntry:
    """A `BackendEntry` from a BackendEntry, a `Backend` subclass or a ``"pkg.mod:Class"`` path."""
    if isinstance(target, BackendEntry):
        return target
    if isinstance(target, type) and issubclass(target, Backend):
        return BackendEntry(target.__module__, target.__qualname__, tuple(target.requires), "", kind=target.kind)
    if isinstance(target, str):
        module, attr = parse_target(target)
        return BackendEntry(module, attr, (), "", kind=None)
    raise TypeError(
        "register: entry must be a BackendEntry, a Backend subclass or a 'package.module:ClassName' path, "
        f"got {type(target).__name__}"
    )


def register(name: str, entry) -> None:
    """Add a backend: a `BackendEntry`, a `Backend` subclass or a ``"package.module:Class"`` path."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    if name in REGISTRY:
        raise ValueError(f"a backend named {name!r} is already registered")
    REGISTRY[name] = as_entry(entry)


def load_class(entry: BackendEntry) -> type[Backend]:
    """Import the entry's module and return its `Backend` subclass (errors name the path)."""
    path = f"{module_name(entry.module)}:{entry.cls}"
    try:
        obj = importlib.import_module(module_name(entry.module))
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"cannot import {path}: {error}", name=error.name) from error
    for part in entry.cls.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"cannot import {path}: module {module_name(entry.module)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise TypeError(f"{path} is not a subclass of mha_rosetta.backends.Backend (it is {obj!r})")
    return obj


def registered_classes(kind: str | None = None) -> dict[str, type[Backend] | str]:
    """name -> class of every registered backend of ``kind`` (None: every kind), loaded without its framework
    (adapters import theirs lazily, so class attributes are readable whether or not it is installed here), or
    the reason its module does not load. A plugin named by a path says its kind only once loaded: it counts
    as any kind."""
    out: dict[str, type[Backend] | str] = {}
    for name, entry in REGISTRY.items():
        if kind is not None and entry.kind not in (kind, None):
            continue
        try:
            out[name] = load_class(entry)
        except (ImportError, TypeError) as error:  # a plugin whose module does not load: the reason
            out[name] = str(error)
    return out


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
    broken = [str(probe(module).reason) for module in missing if probe(module).installed]  # installed: a reason
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
        cls = load_class(entry)
        if entry.kind is None:  # a plugin named by a path: now its class says, and its entry keeps it
            entry = REGISTRY[name] = replace(entry, kind=cls.kind, requires=tuple(cls.requires))
            if _missing_modules(entry):
                raise BackendNotInstalled(_not_installed_message(name, entry))
        # The instance reads its kind and requires from this entry (Backend.__init__).
        _INSTANCES[name] = cls(name=name, **entry.kwargs)
    return _INSTANCES[name]


def register_path(target: str) -> str:
    """Register the backend at ``"pkg.mod:Class"`` (imported now) and return its registry name.

    The name is the class's ``name`` attribute, or its class name. The same class
    registered earlier (an entry point, a second ``--backend``) is reused under its name.
    """
    module, attr = parse_target(target)
    cls = load_class(BackendEntry(module, attr, (), ""))
    existing = registered_entry(cls, None)
    if existing is not None:
        return next(name for name, entry in REGISTRY.items() if entry is existing)
    name = getattr(cls, "name", "") or cls.__name__
    if name in REGISTRY:
        raise ValueError(
            f"{target}: a different backend is already registered as {name!r}; set another `name` on the class"
        )
    register(name, cls)
    return name


def discover_entry_points() -> None:
    """Register every entry point of the group ``mha_rosetta.backends`` (none is imported)."""
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} = {point.value!r}"
        if point.name in REGISTRY:
            problem = f"{where}: the name {point.name!r} is already registered; not loaded"
        elif not point.attr:
            problem = f"{where}: it names no class (expected 'package.module:ClassName'); not loaded"
        else:
            REGISTRY[point.name] = BackendEntry(point.module, point.attr, (), "", kind=None)
            continue
        PLUGIN_PROBLEMS[point.name] = problem
        warnings.warn(f"mha_rosetta.backends: {problem}", stacklevel=2)


# Implementations: the same MHA, each in the convention its library's users write.
register("numpy", BackendEntry(".numpy.adapter", "NumpyBackend", ("numpy",), "test"))
register("torch", BackendEntry(".torch.adapter", "TorchBackend", ("torch",), "torch"))
register("jax", BackendEntry(".jax.adapter", "JaxBackend", ("jax",), "jax"))
EINOPS = (".einops.adapter", "EinopsBackend")
register("mlx", BackendEntry(".mlx.adapter", "MlxBackend", ("mlx",), "mlx"))
register("einops-numpy", BackendEntry(*EINOPS, ("einops",), "einops", {"array_library": "numpy"}))
register("einops-torch", BackendEntry(*EINOPS, ("einops", "torch"), "einops,torch", {"array_library": "torch"}))
register("einops-jax", BackendEntry(*EINOPS, ("einops", "jax"), "einops,jax", {"array_library": "jax"}))
# Each framework at its best (issue 43): the paths a comparison of frameworks times, beside the conventions.
register("numpy-best", BackendEntry(".best.numpy", "NumpyBestBackend", ("numpy",), "test"))
register("torch-best", BackendEntry(".best.torch", "TorchBestBackend", ("torch",), "torch"))
register("jax-best", BackendEntry(".best.jax", "JaxBestBackend", ("jax",), "jax"))
register("mlx-best", BackendEntry(".best.mlx", "MlxBestBackend", ("mlx",), "mlx"))
# The same layer split over several devices or processes by heads (tensor parallelism).
register("jax-sharded", BackendEntry(".sharded.jax", "JaxShardedBackend", ("jax",), "jax"))
register("torch-tp", BackendEntry(".sharded.torch", "TorchTPBackend", ("torch",), "torch"))
# Third-party oracles: the libraries' own attention, fed the canonical parameters.
TORCH_MHA = (".oracles.torch", "TorchMHAOracle", ("torch",), "torch")
register("torch-mha", BackendEntry(*TORCH_MHA, {"batch_first": True}, kind="oracle"))
# Sequence first (the module's default layout): its own class, whose gap cause is the layout's.
register("torch-mha-seqfirst", BackendEntry(TORCH_MHA[0], "TorchMHASeqFirstOracle", *TORCH_MHA[2:], kind="oracle"))
register("torch-sdpa", BackendEntry(".oracles.torch", "TorchSDPAOracle", ("torch",), "torch", kind="oracle"))
register("torch-flex", BackendEntry(".oracles.flex", "TorchFlexOracle", ("torch",), "torch", kind="oracle"))
register("jax-dpa", BackendEntry(".oracles.jax_dpa", "JaxDotProductAttentionOracle", ("jax",), "jax", kind="oracle"))
register("flax", BackendEntry(".oracles.flax", "FlaxMHAOracle", ("flax", "jax"), "flax", kind="oracle"))
register("equinox", BackendEntry(".oracles.equinox", "EquinoxMHAOracle", ("equinox", "jax"), "equinox", kind="oracle"))
register("mlx-sdpa", BackendEntry(".oracles.mlx", "MlxSDPAOracle", ("mlx",), "mlx", kind="oracle"))
register("mlx-mha", BackendEntry(".oracles.mlx", "MlxMHAOracle", ("mlx",), "mlx", kind="oracle"))
# A decode oracle: Hugging Face's LlamaAttention / MistralAttention through their own KV caches.
HF_ATTENTION = (".oracles.hf_cache", "HFAttentionOracle", ("torch", "transformers"), "torch,models")
register("hf-attention", BackendEntry(*HF_ATTENTION, kind="oracle"))
# ONNX (issue 44): the spec's layer around the standard Attention op, in ONNX Runtime and onnx's reference.
register("onnx", BackendEntry(".onnx.adapter", "OnnxBackend", ("onnx", "onnxruntime"), "onnx", kind="oracle"))
ONNX_REF = (".onnx.adapter", "OnnxReferenceBackend", ("onnx",), "onnx")
register("onnx-reference", BackendEntry(*ONNX_REF, kind="oracle"))
TORCH_ONNX = (".oracles.torch_onnx", "TorchOnnxOracle", ("torch", "onnx", "onnxruntime", "onnxscript"), "onnx,torch")
register("torch-onnx", BackendEntry(*TORCH_ONNX, kind="oracle"))
# Third-party packages' backends (entry-point group "mha_rosetta.backends"), none imported.
discover_entry_points()
