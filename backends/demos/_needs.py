"""`needs`: a demonstration runs only where its libraries import, else it raises `LibraryMissing` with the reason."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from .._probe import import_failure
from ..base import BackendNotInstalled

F = TypeVar("F", bound=Callable)


class LibraryMissing(BackendNotInstalled):
    """A demonstration's library does not import here. ``reason`` is `core.probe`'s: not installed, or the
    import error with its remedy (Keras without a backend, say)."""

    def __init__(self, library: str, reason: str):
        super().__init__(reason)
        self.library = library
        self.reason = reason


def needs(*libraries: str) -> Callable[[F], F]:
    """Decorate a demonstration that imports ``libraries``: called where one of them does not import (each is
    imported once to find out, `core.probe`), it raises `LibraryMissing` for the first such library instead."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def guarded(*args, **kwargs):
            for library in libraries:
                reason = import_failure(library)
                if reason:
                    raise LibraryMissing(library, reason)
            return function(*args, **kwargs)

        guarded.libraries = libraries  # type: ignore[attr-defined]
        return guarded  # type: ignore[return-value]

    return decorate


def run_installed(demonstrations, *args) -> list:
    """The rows of each of ``demonstrations`` (`needs`-guarded functions that return lists of rows) whose
    libraries import here, in order; the others add nothing."""
    rows = []
    for demonstration in demonstrations:
        try:
            rows += demonstration(*args)
        except LibraryMissing:
            continue
    return rows
