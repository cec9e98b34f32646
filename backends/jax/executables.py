"""Compiled JAX programs kept on disk between processes, so a warm check skips tracing, lowering and XLA.

Why not JAX's own persistent compilation cache: its key is the *lowered* program, so a hit
still traces and lowers the Python function first. Measured on the default check's 112 runs of
the ``jax`` adapter in one process (jaxlib 0.10.2, Intel Xeon, the check's fast compile
settings, a warm JAX cache): 130 programs, 8.12 s tracing, 3.94 s lowering and 1.52 s reading
the cache (more than compiling them had taken). With this cache the same 112 runs load their
112 executables in 0.77 s, and the whole run drops from 12.7 s to 2.6 s.

The entry's name is a digest of everything that decides what the program computes:

* the program's key (`common.shared_program`'s: everything its closure captures, built next to
  the closure it names);
* the arguments' tree structure and every leaf's shape, dtype, weak type and sharding;
* the trace-time settings: the matmul precision and ``jax_enable_x64``;
* the source of ``mha_rosetta.core`` and ``mha_rosetta.backends`` (every ``.py`` file: any
  edit to the code that builds programs names every entry afresh), the versions of JAX, jaxlib,
  NumPy, ml_dtypes, Flax, Equinox and einops, Python's, ``XLA_FLAGS`` and the devices' platform
  and kind.

So an entry is reused exactly where `shared_program` would reuse the program inside one
process, and never across an edit or an upgrade. Design rules:

* Off unless ``MHA_ROSETTA_JAX_EXECUTABLES`` names a directory; the check's workers set it
  (`checks.worker.worker_environment`), nothing else does: benchmarks and library use compile as JAX
  does, and `shared_program` hands them the plain `jax.jit`.
* Only the project's own programs: a worker turns the cache off while it runs a user's adapter
  (`allowed`), whose code the digest does not cover.
* Where the cache is on, JAX runs with ``jax_enable_x64`` from its import on (`settle_x64`), not
  from the first float64 case: the switch changes what a program traces to, so it is in the
  digest, and a process that met its first float64 case at a different point would otherwise
  trace the same float32 program under either setting from one check to the next (measured:
  jax-dpa's 55 runs missed 31 entries on a second check; the runs' ``info.jax_enable_x64``
  differed in 31 of 1511 runs between two checks, with the same errors to the bit). The
  adapters give every array its dtype, so float32 programs compute the same either way.
* A key whose text holds an object address (``<... at 0x...>``) is never stored: its text
  changes between processes, so it could not hit, and it names something the digest cannot see.
* A program that closes over arrays (JAX's ``const_args``) cannot be serialized and is compiled
  every time; any entry that fails to load is deleted and compiled again. Entries are written
  whole (a temporary file, then a rename), so two workers never read half an entry.
* An executable that JAX's persistent cache served is never stored: XLA:CPU's executables read
  back from that cache serialize without their kernels (running the stored copy fails with
  "NOT_FOUND: Function transpose_copy_fusion.2 not found"; measured on jaxlib 0.10.2). So a
  program compiled here on a miss is kept out of JAX's cache (its write threshold is lifted for
  the call), which then holds only the programs this cache does not (no key, a user's adapter),
  and a hit of JAX's cache during the call (its ``cache_hits`` event) means: do not store.
* Loading an executable runs code from the file (`jax.experimental.serialize_executable`), like
  JAX's own cache: the directory is the user's own cache directory, never a shared one.

Nothing here imports JAX at module import.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

SWITCH = "MHA_ROSETTA_JAX_EXECUTABLES"  # a directory: this process keeps its compiled programs there
ENTRY_SUFFIX = ".jaxexe"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# What decides a program besides its key and arguments: the libraries that trace or build it.
_LIBRARIES = ("jax", "jaxlib", "numpy", "ml_dtypes", "flax", "equinox", "einops")
_SOURCES = ("mha_rosetta.core", "mha_rosetta.backends")

# Loaded, compiled (and stored), and compiled without an entry (no key, or not serializable), this process.
STATS: Counter = Counter()
_allowed = True


def directory() -> Path | None:
    """The cache directory, or None when the cache is off in this process (or not allowed now)."""
    where = os.environ.get(SWITCH, "").strip()
    return Path(where) if where and _allowed else None


@contextlib.contextmanager
def allowed(flag: bool) -> Iterator[None]:
    """Within the block the cache is on (``True``, where `SWITCH` is set) or off (``False``: a user's adapter)."""
    global _allowed
    before, _allowed = _allowed, bool(flag)
    try:
        yield
    finally:
        _allowed = before


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the relative path and bytes of every ``.py`` file of `_SOURCES`."""
    import importlib

    digest = hashlib.sha256()
    for package in _SOURCES:
        for root in importlib.import_module(package).__path__:
            for path in sorted(Path(root).rglob("*.py")):
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def environment_text() -> str:
    """The versions, flags and devices an entry was compiled under (JAX imported by then)."""
    from importlib import metadata

    import jax

    versions = []
    for name in _LIBRARIES:
        try:
            versions.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name}=-")
    devices = sorted({f"{device.platform}:{device.device_kind}" for device in jax.devices()})
    return "|".join((*versions, f"python={sys.version.split()[0]}", os.environ.get("XLA_FLAGS", ""), *devices))


def settle_x64() -> None:
    """Where the cache is on, turn on ``jax_enable_x64`` now (JAX is imported): one setting for the whole process."""
    if directory() is None:
        return
    import jax

    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def _leaf_text(leaf) -> str | None:
    import jax

    if not isinstance(leaf, jax.Array):
        return None  # a Python scalar or a NumPy array would be traced by value type only: no entry
    aval = leaf.aval
    return f"{aval.shape}:{aval.dtype}:{aval.weak_type}:{leaf.sharding}"


def program_digest(key: tuple | None, args: tuple) -> str | None:
    """The entry's name for program ``key`` on ``args`` under the current trace-time settings, or None."""
    import jax

    if key is None:
        return None
    key_text = repr(key)
    if _ADDRESS.search(key_text):
        return None
    leaves, tree = jax.tree_util.tree_flatten(args)
    texts = [_leaf_text(leaf) for leaf in leaves]
    if any(text is None for text in texts):
        return None
    parts = (
        key_text,
        str(tree),
        *texts,
        f"precision={jax.config.jax_default_matmul_precision}",
        f"x64={jax.config.jax_enable_x64}",
        source_digest(),
        environment_text(),
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _devices_of(compiled) -> list[int]:
    return [device.id for device in compiled.runtime_executable().local_devices()]


def _arguments_tree(args: tuple):
    """The tree `jax.stages.Compiled` keeps of its arguments: ``(args, kwargs)``, no keyword arguments."""
    import jax

    return jax.tree_util.tree_structure((tuple(args), {}))


def load(where: Path, digest: str, args: tuple):
    """The `jax.stages.Compiled` stored under ``digest`` for ``args``, or None (absent; a broken entry is deleted).

    The arguments' tree is rebuilt from ``args`` (the digest holds its text) rather than stored: a
    library's tree nodes need not survive pickling (Equinox's ``Missing`` sentinel does not).
    """
    import jax
    from jax.experimental import serialize_executable

    path = where / f"{digest}{ENTRY_SUFFIX}"
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        serialized, out_tree, device_ids = pickle.loads(blob)
        in_tree = _arguments_tree(args)
        by_id = {device.id: device for device in jax.devices()}
        devices = [by_id[index] for index in device_ids]
        return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)
    except Exception:  # written by another version, truncated by a crash, devices that are not here
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def store(where: Path, digest: str, compiled, args: tuple) -> bool:
    """Write ``compiled`` under ``digest`` whole (temporary file, then rename); False if it cannot be serialized."""
    from jax.experimental import serialize_executable

    try:
        serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = pickle.dumps((serialized, out_tree, _devices_of(compiled)))
        if in_tree != _arguments_tree(args) or pickle.loads(pickle.dumps(out_tree)) != out_tree:
            return False  # a tree that would not be rebuilt or read back the same
    except Exception:  # const_args (a closed-over array), a host callback: not serializable
        return False
    try:
        where.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=where, suffix=".partial")
        with os.fdopen(handle, "wb") as file:
            file.write(blob)
        os.replace(temporary, where / f"{digest}{ENTRY_SUFFIX}")
    except OSError:
        return False
    return True


def _split_static(key: tuple | None, args: tuple, static_argnums: tuple[int, ...]) -> tuple[tuple | None, tuple]:
    """``(key with the static arguments' values, the other arguments)``: what names and what calls the executable."""
    if not static_argnums:
        return key, args
    dynamic = tuple(arg for index, arg in enumerate(args) if index not in static_argnums)
    static = tuple(args[index] for index in static_argnums)
    return (None if key is None else (*key, ("static", static))), dynamic


def compile_program(jitted, args: tuple, key: tuple | None, static_argnums: tuple[int, ...] = ()):
    """``jitted.lower(*args).compile()``, read from the cache when an entry exists and stored when not.

    Call it under the trace-time settings the program is compiled with (the matmul precision).
    ``static_argnums``: the jit's; their values join the key (their text must name them), and the
    executable, like JAX's own, takes the other arguments only.
    """
    key, dynamic = _split_static(key, args, static_argnums)
    where = directory()
    digest = None if where is None else program_digest(key, dynamic)
    if digest is not None:
        compiled = load(where, digest, dynamic)
        if compiled is not None:
            STATS["loaded"] += 1
            return compiled
    if digest is None:
        STATS["uncached"] += 1
        return jitted.lower(*args).compile()
    import jax

    _listen()
    served_before = _JAX_CACHE_HITS[0]
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))  # not into JAX's cache
    try:
        compiled = jitted.lower(*args).compile()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    if _JAX_CACHE_HITS[0] == served_before and store(where, digest, compiled, dynamic):
        STATS["compiled"] += 1
    else:  # served by JAX's cache (it would not run once stored), or not serializable
        STATS["uncached"] += 1
    return compiled


_JAX_CACHE_HITS = [0]  # JAX's persistent-cache hits in this process, counted from its monitoring events
_LISTENING: list[bool] = []


def _listen() -> None:
    if _LISTENING:
        return
    import jax.monitoring

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _JAX_CACHE_HITS[0] += 1

    jax.monitoring.register_event_listener(on_event)
    _LISTENING.append(True)


class CachedJit:
    """A `jax.jit` whose calls run `compile_program`'s executables, one per argument signature.

    For programs called directly (a decode step, a stage dump) rather than compiled ahead of time.
    `shared_program` hands it out only where the cache is on; ``lower`` and the rest are the jit's.
    """

    def __init__(self, jitted: Callable, key: tuple, static_argnums: tuple[int, ...] = ()) -> None:
        self._jitted, self._key, self._static = jitted, key, tuple(static_argnums)
        self._compiled: dict[str, object] = {}

    def __call__(self, *args):
        key, dynamic = _split_static(self._key, args, self._static)
        digest = program_digest(key, dynamic)
        if digest is None or directory() is None:
            return self._jitted(*args)
        if digest not in self._compiled:
            self._compiled[digest] = compile_program(self._jitted, args, self._key, self._static)
        return self._compiled[digest](*dynamic)

    def __getattr__(self, name: str):
        return getattr(self._jitted, name)
