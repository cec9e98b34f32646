"""Backends from outside this project: a class, a module path, or a package's entry points.

Three ways in, none of which needs an edit to this project:

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

A plugin named by a path has ``kind=None`` in its entry until it is first loaded (its class
says its kind), so ``available_backends(kind="oracle")`` lists it only after `get_backend`.

A `BackendEntry.module` without a dot that names a module of this package
(``"numpy_backend"``) is relative to it, as the built-in entries are written; anything
else is an absolute module path.

An instance knows its own ``kind`` and ``requires`` from construction (`registered_entry`):
`Backend.__init__` reads them from the registry entry of its class, so a directly built
``TorchMHAOracle()`` is an oracle too, and a class registered nowhere keeps its class
attributes.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

ENTRY_POINT_GROUP = "mha_rosetta.backends"
_PACKAGE = __name__.rsplit(".", 1)[0]  # mha_rosetta.backends

# Entry points that could not be registered (a name taken, no class named), by name.
PLUGIN_PROBLEMS: dict[str, str] = {}


def module_name(module: str) -> str:
    """The absolute module name of a `BackendEntry.module` (see the module docstring)."""
    if "." not in module and importlib.util.find_spec(f"{_PACKAGE}.{module}") is not None:
        return f"{_PACKAGE}.{module}"
    return module


def parse_target(target: str) -> tuple[str, str]:
    """``"pkg.mod:Class"`` -> ``("pkg.mod", "Class")``, with a clear error for anything else."""
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"expected an import path 'package.module:ClassName', got {target!r}")
    module, attr = target.split(":")
    return module.strip(), attr.strip()


def as_entry(target):
    """A `BackendEntry` from a BackendEntry, a `Backend` subclass or a ``"pkg.mod:Class"`` path."""
    from . import Backend, BackendEntry

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


def load_class(entry) -> type:
    """Import the entry's module and return its `Backend` subclass (errors name the path)."""
    from . import Backend

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


def registered_entry(cls: type, name: str | None):
    """The registry entry of exactly this class, preferring the one registered as ``name``."""
    from . import REGISTRY

    matches = [
        (entry_name, entry)
        for entry_name, entry in REGISTRY.items()
        if entry.cls == cls.__qualname__ and module_name(entry.module) == cls.__module__
    ]
    named = [entry for entry_name, entry in matches if entry_name == name]
    return named[0] if named else (matches[0][1] if matches else None)


def register_path(target: str) -> str:
    """Register the backend at ``"pkg.mod:Class"`` (imported now) and return its registry name.

    The name is the class's ``name`` attribute, or its class name. The same class
    registered earlier (an entry point, a second ``--backend``) is reused under its name.
    """
    from . import REGISTRY, BackendEntry, register

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

    from . import REGISTRY, BackendEntry

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
