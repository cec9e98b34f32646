"""Is an optional library usable here? Import it once, remember the answer, and say why not.

Standard library only, so that `mha_rosetta.models` (which imports only `core`) can ask it;
`mha_rosetta.backends._probe` re-exports it for the backends.

``importlib.util.find_spec`` only says that a module is on the path, not that it
imports: Keras 3 installed next to JAX and torch, without TensorFlow and without
``KERAS_BACKEND``, is found, then fails to import (``No module named 'tensorflow'``).
So a library counts as available only after it has really been imported, and an import
that fails becomes a reason (the library, the error and, where there is one, the remedy)
that callers turn into a skip instead of a crash. Each library is imported the first time
someone asks about it, and the answer is cached for the life of the process.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from .errors import error_line

# What to do about a library that is installed but does not import, where it is known.
REMEDIES = {
    "keras": (
        "Keras 3 needs a backend: set KERAS_BACKEND=jax or KERAS_BACKEND=torch "
        "(without it Keras defaults to TensorFlow)"
    ),
}


@dataclass(frozen=True)
class Probe:
    """The outcome of importing one optional library."""

    module: str
    installed: bool  # found on the path
    error: str = ""  # "Type: message" of a failed import; empty when it imported

    @property
    def ok(self) -> bool:
        return self.installed and not self.error

    @property
    def reason(self) -> str | None:
        """None when usable; otherwise why not, with the remedy where one is known."""
        if not self.installed:
            return f"{self.module} is not installed"
        if not self.error:
            return None
        remedy = REMEDIES.get(self.module.split(".")[0])
        reason = f"{self.module} is installed but failed to import: {self.error}"
        return f"{reason}; {remedy}" if remedy else reason


# module -> its answer, for the life of the process (`probe`); `remember` adds answers found elsewhere.
_ANSWERS: dict[str, Probe] = {}


def probe(module: str) -> Probe:
    """Import ``module`` once (cached) and report whether that worked."""
    if module not in _ANSWERS:
        _ANSWERS[module] = _import(module)
    return _ANSWERS[module]


def _forget() -> None:
    _ANSWERS.clear()


probe.cache_clear = _forget  # type: ignore[attr-defined]  # forget every answer (tests pretend a library is absent)


def remember(answers) -> None:
    """Take ``answers`` (Probes) found by another process of this same interpreter, environment and path as
    this process's own, without importing anything: a check's worker imports the frameworks to run them anyway,
    so it probes them and its parent, which only plans and compares, stays free of them. An answer already
    known here is kept."""
    for answer in answers:
        _ANSWERS.setdefault(answer.module, answer)


def _import(module: str) -> Probe:
    try:
        if importlib.util.find_spec(module) is None:
            return Probe(module, installed=False)
        importlib.import_module(module)
    except Exception as error:  # any error: a library that cannot import is unusable, whatever the cause
        return Probe(module, installed=True, error=error_line(error))
    return Probe(module, installed=True)


def import_failure(module: str) -> str | None:
    """None when ``module`` imports; otherwise why it cannot be used (not installed, or the import error)."""
    return probe(module).reason


def importable(module: str) -> bool:
    """True when ``module`` imports (it is imported, once, to find out)."""
    return probe(module).ok
