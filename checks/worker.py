"""A check's worker process: runs one job at a time (a forward run, a gradient run, a stage dump) for the pool.

The pool (`checks.pool`) starts each worker with the ``spawn`` method: a fresh interpreter
that imports nothing of the parent's frameworks. ``fork`` would copy the parent's JAX and
torch thread pools half-initialised (their threads do not survive a fork) and can deadlock.

Design rules:

* the environment a worker needs (the JAX compilation cache and XLA's compile settings,
  `worker_environment`) is set before anything in the worker imports a framework;
* a worker keeps each backend it was sent, so a framework's import and its compiled programs
  (and a sharded backend's own worker processes and simulated devices) are paid once per
  worker, not once per run; the scheduler keeps a worker on one backend while it has work;
* every answer carries the time spent importing the backend's libraries, compiling (JAX's
  compile events) and running, and how many programs it read from the executable cache and
  how many it compiled into it (`backends.compiling`: JAX's, asked there, never imported here), for
  ``check --timings``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path

CACHE_SWITCH = "MHA_ROSETTA_JAX_CACHE"  # "0": no persistent compilation cache


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mha-rosetta``, or ``~/.cache/mha-rosetta``: every compiled program the check keeps."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mha-rosetta"


def jax_cache_dir() -> Path:
    """JAX's persistent compilation cache: the programs the executable cache does not keep (``<root>/xla``)."""
    return cache_root() / "xla"


def executables_dir() -> Path:
    """The project's own programs, compiled and serialized (`backends.jax.executables`): ``<root>/executables``."""
    return cache_root() / "executables"


def cache_enabled(flag: bool | None = None) -> bool:
    """The cache is on unless ``flag`` is False or ``MHA_ROSETTA_JAX_CACHE=0``."""
    if flag is not None:
        return flag
    return os.environ.get(CACHE_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


FAST_COMPILE_SWITCH = "MHA_ROSETTA_FAST_COMPILE"  # "0": XLA's default compile settings in the workers
# XLA:CPU settings the check's workers compile with: the older loop emitters instead of the fusion
# emitters, and LLVM at -O0. The check's programs are tiny and run once or twice, so compiling is
# nearly all of their cost. Measured on the default check's 35 cases (jax, 32 programs of 8 cases,
# jaxlib 0.10.2, Intel Xeon, 1 worker): 7.67 s of XLA compile with the defaults, 4.46 s with the
# loop emitters, 2.31 s with both; the whole default check 107 s -> 54 s cold (2 workers), with the
# same verdicts field by field (docs/check.md). Neither setting licenses a reordering of floating-point
# arithmetic (no fast-math), so they change compile time, not what is computed up to XLA's own
# choices of order; benchmarks never use them. The third compiles each program as one LLVM module
# instead of splitting it for parallel codegen: on 2 cores the check's workers already keep both busy,
# and each split part took memory mappings of its own (the jax adapter's 112 programs in one process:
# 56 mappings a program, 20 with it; a process that compiled about 1200 programs reached Linux's
# vm.max_map_count of 65530, and XLA then crashed in backend_compile_and_load, as the test suite did
# in one process). The default check, cold, in turn (Intel Xeon, 2 workers, 2026-12-04): 28.4 and
# 25.9 s without it, 22.8 and 22.9 s with it; the same statuses on all 1511 runs and 12401 pairs,
# one run's worst error (equinox, rope_half, float32) 3.5e-7 instead of 2.9e-7.
FAST_COMPILE_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def fast_compile_enabled(flag: bool | None = None) -> bool:
    """Fast compile settings are on unless ``flag`` is False or ``MHA_ROSETTA_FAST_COMPILE=0``."""
    if flag is not None:
        return flag
    return os.environ.get(FAST_COMPILE_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def xla_flags(fast_compile: bool) -> str:
    """The ``XLA_FLAGS`` a worker gets: `FAST_COMPILE_FLAGS` (if on), then the user's own, which win."""
    own = os.environ.get("XLA_FLAGS", "").strip()
    return " ".join((*(FAST_COMPILE_FLAGS if fast_compile else ()), own)).strip()


def worker_environment(cache: bool, fast_compile: bool) -> dict[str, str]:
    """What a worker sets before any framework is imported: the JAX cache and the XLA flags."""
    environment = jax_cache_environment(cache)
    flags = xla_flags(fast_compile)
    if flags:
        environment["XLA_FLAGS"] = flags
    return environment


def jax_cache_environment(enabled: bool) -> dict[str, str]:
    """Environment variables that give the workers their caches of compiled JAX programs.

    Two caches, both under `cache_root`: the project's own programs as executables, keyed by
    what builds them (`backends.jax.executables`: a warm run skips tracing and lowering, which
    JAX's cache cannot), and JAX's persistent compilation cache for every other program (a
    user's adapter, a program without a key). The two never hold the same program (see there).
    ``<root>/jax-cache``, the one cache of earlier versions, is no longer read: it held the
    project's programs, which would keep them from ever reaching the executable cache.

    JAX writes a program to the cache only if compiling it took at least
    ``jax_persistent_cache_min_compile_time_secs`` (default 1 s) and its entry is large enough
    (``jax_persistent_cache_min_entry_size_bytes``); the check's programs are small and compile in
    tens of milliseconds, so both thresholds are lifted (0 s, -1: no size limit). With the cache off
    nothing is set, and a directory the user set themselves is left alone.
    """
    if not enabled:
        return {}
    from mha_rosetta.backends.compiling import EXECUTABLES_SWITCH

    executables = {EXECUTABLES_SWITCH: str(executables_dir())}
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return executables
    return {
        **executables,
        "JAX_COMPILATION_CACHE_DIR": str(jax_cache_dir()),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def _load_backend(blob: bytes, requires: tuple[str, ...]):
    """The backend from its pickle, its libraries imported now (so the import time is measured apart)."""
    from mha_rosetta.backends.compiling import settle_imports

    for module in requires:
        importlib.import_module(module)
    settle_imports()  # one x64 setting for every program this worker traces
    return pickle.loads(blob)


def _error_text(error: BaseException) -> str:
    message = "".join(traceback.format_exception_only(type(error), error)).strip()
    return message.splitlines()[-1] if message else type(error).__name__


def _leave() -> None:
    """End this worker now: its sharded backends' processes stopped side by side, then no interpreter shutdown.

    The interpreter's shutdown with torch and JAX imported takes 1.4 s, and each sharded group's
    processes were stopped one group after the other at exit (about 2.5 s a worker in all, measured
    on an Intel Xeon, 2026-12-02), while the check waits. Nothing is left to write: every answer
    was sent, and the compiled-program caches write their entries when they compile.
    """
    workers = sys.modules.get("mha_rosetta.backends.sharded.workers")
    if workers is not None:
        workers.close_all()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(conn, environment: dict[str, str]) -> None:
    """The worker loop: ``("job", (task, blob, requires))`` in, ``("ok" | "error", answer, timing)`` out;
    ``("probe", modules)`` in, ``("ok", [Probe, ...], (seconds, 0, 0))`` out."""
    os.environ.update(environment)  # before any framework is imported
    # Ctrl-C in a terminal reaches the whole process group: the parent stops the check and the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from mha_rosetta.backends import compiling  # the standard library only

    from .tasks import execute  # NumPy and the spec only, no framework

    backends: dict[str, object] = {}
    oracles: dict = {}
    clock = compiling.CompileClock()  # JAX's compile events, once JAX is imported
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _leave()
        if message[0] == "stop":
            _leave()
        if message[0] == "probe":  # the parent's probe of these libraries (`pool.WorkerPool.probe`): import them here
            from mha_rosetta.core.probe import probe

            started = time.perf_counter()
            answers = [probe(module) for module in message[1]]
            conn.send(("ok", answers, (time.perf_counter() - started, 0.0, 0.0)))
            continue
        task, blob, requires = message[1]
        import_seconds = 0.0
        try:
            if task.backend not in backends:
                started = time.perf_counter()
                backends[task.backend] = _load_backend(blob, requires)
                import_seconds = time.perf_counter() - started
            clock.listen()
            compiled_before = clock.seconds
            stored_before = compiling.cache_counts()
            started = time.perf_counter()
            # The executable cache serves the project's own adapters only: its digest covers their source, not a user's.
            ours = type(backends[task.backend]).__module__.startswith("mha_rosetta.")
            with compiling.cache_allowed(ours):
                answer = execute(task, backends[task.backend], oracles)
            if not task.stages:
                answer = task.job.portable(answer)
            wall = time.perf_counter() - started
            clock.listen()  # the run may have imported JAX itself
            loaded, stored = (now - before for now, before in zip(compiling.cache_counts(), stored_before, strict=True))
            timing = (import_seconds, clock.seconds - compiled_before, wall, loaded, stored)
            reply = ("ok", answer, timing)
        except Exception as error:  # the job itself catches a backend's errors; this is the worker's
            reply = ("error", f"the worker could not run it: {_error_text(error)}", (import_seconds, 0.0, 0.0))
        try:
            conn.send(reply)
        except Exception as error:  # an answer that does not pickle
            conn.send(("error", f"its result could not be sent back: {_error_text(error)}", reply[2]))
