"""What a check's worker asks about compiling: the seconds spent, and the project's compiled-program cache.

JAX is the library whose compilation dominates the check, and its ``jax.monitoring`` events
are how it reports it (`CompileClock`); eager libraries compile nothing. The project's cache
of compiled programs is JAX's too (`backends.jax.executables`): a worker switches it on with
the environment variable `EXECUTABLES_SWITCH`, settles one x64 setting once the backend's
libraries are imported (`settle_imports`), allows it for the project's own adapters only
(`cache_allowed`) and counts what it loaded and stored (`cache_counts`).

Design rule: `checks.worker` asks here instead of importing JAX or the JAX adapter's helpers.
Importing this module imports the standard library only; JAX is imported by `CompileClock.listen`
and `settle_imports` when the worker has imported it already, never by them first.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager

from .jax import executables

EXECUTABLES_SWITCH = executables.SWITCH  # environment variable: the folder of the project's compiled programs


class CompileClock:
    """Seconds spent compiling, summed from JAX's compile events once JAX is imported."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.listening = False

    def listen(self) -> None:
        if self.listening or "jax" not in sys.modules:
            return
        import jax.monitoring

        def on_event(event: str, duration: float, **_) -> None:
            if event.startswith("/jax/core/compile/"):  # tracing, lowering and the backend compile
                self.seconds += duration

        jax.monitoring.register_event_duration_secs_listener(on_event)
        self.listening = True


def settle_imports() -> None:
    """After a backend's libraries are imported: one x64 setting for every program this process traces
    (`executables.settle_x64`), where JAX is among them."""
    if "jax" in sys.modules:
        executables.settle_x64()


def cache_allowed(flag: bool) -> AbstractContextManager[None]:
    """Within the block the compiled-program cache serves (``True``) or is off (``False``: a user's adapter,
    whose source its digest does not cover)."""
    return executables.allowed(flag)


def cache_counts() -> tuple[int, int]:
    """(programs loaded from the cache, programs compiled into it) in this process so far."""
    return executables.STATS["loaded"], executables.STATS["compiled"]
