"""The registry's data: `BackendEntry`, the `REGISTRY` dict, and finding a class's entry.

This module sits below `base` and `registry` and imports neither: `Backend.__init__` reads
its instance's ``kind`` and ``requires`` from here (`registered_entry`), and `registry`
fills the dict. A backend's ``kind`` and ``requires`` are stored on its entry only; a
plugin named by a path has ``kind=None`` until its class is first loaded, when
`registry.get_backend` writes the class's own attributes into the entry, once.

A `BackendEntry.module` that starts with a dot (``".numpy"``) is relative to
`mha_rosetta.backends`, as the built-in entries are written; anything else is an absolute
module path (``"mypkg.attention"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PACKAGE = __name__.rsplit(".", 1)[0]  # mha_rosetta.backends


@dataclass(frozen=True)
class BackendEntry:
    module: str  # a module of this package (".numpy") or a fully qualified one ("mypkg.attention")
    cls: str
    requires: tuple[str, ...] = ()  # modules the backend imports; each is probed by importing it once
    extra: str = ""  # the mha-rosetta extra that installs them ("" for a plugin: its own package does)
    kwargs: dict = field(default_factory=dict)
    # "implementation" or "oracle" (a library's own attention, fed our parameters);
    # None for a plugin named by a path: its class says, once loaded.
    kind: str | None = "implementation"


REGISTRY: dict[str, BackendEntry] = {}


def module_name(module: str) -> str:
    """The absolute module name of a `BackendEntry.module` (see the module docstring)."""
    return f"{PACKAGE}{module}" if module.startswith(".") else module


def registered_entry(cls: type, name: str | None) -> BackendEntry | None:
    """The registry entry of exactly this class, preferring the one registered as ``name``."""
    matches = [
        (entry_name, entry)
        for entry_name, entry in REGISTRY.items()
        if entry.cls == cls.__qualname__ and module_name(entry.module) == cls.__module__
    ]
    named = [entry for entry_name, entry in matches if entry_name == name]
    return named[0] if named else (matches[0][1] if matches else None)
