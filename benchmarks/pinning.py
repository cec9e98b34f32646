"""Hold every framework to the same number of cores, and check afterwards that it stayed there.

Why three layers and a check (all of them were needed on a shared 2-core machine):

1. Environment variables, set by the parent before the child interpreter starts, because
   OpenBLAS, MKL, OpenMP and XLA size their thread pools once, when they are loaded.
   An OpenBLAS pool of 2 threads on a busy 2-core machine made small NumPy products stall
   for milliseconds each; ``OPENBLAS_NUM_THREADS=1`` removes the pool altogether.
2. CPU affinity (``os.sched_setaffinity``), applied in the child before exec. XLA with its
   Eigen flag alone still used 1.7 cores (process CPU time / wall time); only affinity held
   it to one. Affinity is the one limit no library can talk its way around.
3. Runtime knobs inside the child, after the framework is imported: ``torch.set_num_threads``
   and ``set_num_interop_threads``, and threadpoolctl limits on every BLAS/OpenMP library
   that ended up loaded (torch bundles its own).
4. The check: process CPU time over wall time across the timed region. A value above
   ``threads + 0.25`` means some pool escaped; the cell carries a warning.

The allocator is held to one rule too (`malloc_env`, next to the thread knobs because it
is also environment that must be in place before the child starts): see its docstring.

Every function here is cheap and imports no framework unless asked to configure one.
Variables that are not thread counts (``OPENBLAS_CORETYPE`` and the like) are passed
through untouched.
"""

from __future__ import annotations

import os
import shlex
import time

from .memory import status_mb

# Each library reads its own variable; setting all of them costs nothing. XLA:CPU sizes its
# intra-op thread pool from PJRT_NPROC (then NPROC, the older spelling it still reads; else the
# cores in the affinity mask): measured with jax 0.10.2 on a 1024^3 float32 product, PJRT_NPROC=1
# held the process to 1.0 core and PJRT_NPROC=2 let it use 1.9, whatever XLA_FLAGS said.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
    "BLIS_NUM_THREADS", "PJRT_NPROC", "NPROC",
)  # fmt: skip

# XLA_FLAGS: the one thread flag XLA:CPU still parses is --xla_cpu_multi_thread_eigen (it picks
# single-threaded Eigen kernels for convolutions; the same test above showed it does not limit
# a dot product, so PJRT_NPROC is what limits XLA). XLA aborts on an unknown --flag and takes a
# first token without "--" for a file of flags, so the TensorFlow-era "intra_op_parallelism_threads"
# (which older versions of this module wrote) is removed from any inherited XLA_FLAGS, never written.
_XLA_EIGEN_FLAG = "--xla_cpu_multi_thread_eigen"
_XLA_STALE_INTRA_OP = "intra_op_parallelism_threads"

# How far CPU time / wall time may exceed the thread budget before a cell is flagged:
# interpreter bookkeeping and the kernel's own accounting add a little on top of one core.
CPU_UTIL_SLACK = 0.25
# Below this share of its one core, a single-threaded CPU cell was competing with other processes.
CONTENDED_BELOW = 0.8


def require_positive_int(name: str, value: object) -> int:
    """``value`` when it is a positive int (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def xla_flags(threads: int, existing: str = "") -> str:
    """``XLA_FLAGS`` holding the user's own flags plus the Eigen flag for ``threads``."""
    threads = require_positive_int("threads", threads)
    kept = [
        flag
        for flag in shlex.split(existing or "")
        if not flag.startswith(_XLA_EIGEN_FLAG) and not flag.lstrip("-").startswith(_XLA_STALE_INTRA_OP)
    ]
    if threads == 1:
        # With one thread Eigen's pool is pure overhead; switch it off.
        kept.append(f"{_XLA_EIGEN_FLAG}=false")
    return " ".join(kept)


def device_env(device: str | None) -> dict[str, str]:
    """Variables a measured child gets for its device: a CPU cell keeps JAX on the CPU.

    Without ``JAX_PLATFORMS=cpu`` a CPU cell on a GPU host starts JAX's CUDA client, which
    pre-allocates most of the GPU's memory and runs its own threads on the cell's pinned core.
    """
    return {"JAX_PLATFORMS": "cpu"} if device == "cpu" else {}


def thread_env(threads: int, base_env: dict[str, str] | None = None, device: str | None = None) -> dict[str, str]:
    """A copy of ``base_env`` (default: this process's) with every thread knob set to ``threads``
    and the device variables of ``device`` (`device_env`)."""
    threads = require_positive_int("threads", threads)
    env = dict(os.environ if base_env is None else base_env)
    for name in THREAD_ENV_VARS:
        env[name] = str(threads)
    flags = xla_flags(threads, env.get("XLA_FLAGS", ""))
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(device_env(device))
    # The child's stdout carries its JSON result; keep Python's own output unbuffered and
    # in UTF-8 so that a crash message is never lost or mangled.
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"
    return env


# --malloc: "keep" raises glibc's mmap and trim thresholds in every measured child; "default"
# leaves the environment as it is. 4 GiB: above any buffer a cell here allocates.
MALLOC_MODES = ("keep", "default")
DEFAULT_MALLOC_MODE = "keep"
MALLOC_KEEP_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "4294967296",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_ARENA_MAX": "1",
}


def malloc_env(mode: str = DEFAULT_MALLOC_MODE) -> dict[str, str]:
    """The allocator variables a measured child gets for ``mode`` (to add to `thread_env`'s).

    Why: glibc serves every request of 32 MiB or more (its largest dynamic mmap threshold on
    64-bit) with a fresh ``mmap`` and returns it with ``munmap`` when freed, so each call
    pays for faulting the whole buffer in again. At B=4, H=8, N=512 the float32 score tensor
    is 33.5 MB; faulting it in cost more than the softmax itself (torch softmax: 30 ms, and
    11.5 ms with the threshold raised). An adapter that happens to reuse its buffers escapes
    that cost and one that allocates per call does not, which says nothing about the
    frameworks. With ``"keep"`` every child gets ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` at 4 GiB, so freed memory stays in the heap and is reused,
    the same for every framework.

    The thresholds alone held only for memory the main thread allocates. glibc gives every
    other thread an arena of its own, made of heaps of at most 64 MiB that it maps and unmaps
    whole, whatever the thresholds say; XLA:CPU runs a program on a thread of its pool, so its
    temporaries came from such an arena and were faulted in afresh on every call. Measured at
    the reference size (B=4, N=512, D=512, H=8, float32, one pinned core, Intel Xeon,
    2026-12-03), minor page faults per call without and with ``MALLOC_ARENA_MAX=1``:
    jax-dpa 17409 and 0 (105 -> 76 ms), flax 16400 and 0 (78 -> 62 ms), equinox 8200 and 0
    (76 -> 68 ms); the other implementations faulted at most 1230 times a call (torch-flex; 342
    with it), NumPy, jax and einops-jax none. Equinox's visits also
    split into a fast and a slow mode (60 or 78 ms, each process keeping to one), which no
    paired reference could correct. So ``"keep"`` also sets ``MALLOC_ARENA_MAX=1``: every
    thread allocates from the main arena under the same thresholds (a measured cell runs 1
    thread, or a few that rarely allocate, so the arena's lock is not contended).

    All three are glibc tunables, ignored by other C libraries (macOS, musl, Windows).
    ``"default"`` adds nothing: the environment stays as it is.
    """
    if mode not in MALLOC_MODES:
        raise ValueError(f"malloc must be one of {', '.join(MALLOC_MODES)}, got {mode!r}")
    return dict(MALLOC_KEEP_ENV) if mode == "keep" else {}


def malloc_env_report() -> dict[str, str | None]:
    """The allocator variables this process was started with, for the record (None: unset)."""
    return {name: os.environ.get(name) for name in MALLOC_KEEP_ENV}


def thread_env_report() -> dict[str, str | None]:
    """The thread and device variables this process was started with, for the record (None: unset)."""
    return {name: os.environ.get(name) for name in (*THREAD_ENV_VARS, "XLA_FLAGS", "JAX_PLATFORMS")}


def affinity_supported() -> bool:
    """True where the OS lets a process choose its cores (Linux; not macOS or Windows)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def allowed_cpus() -> list[int]:
    """The cores this process may run on (all of ``os.cpu_count()`` where affinity is unknown)."""
    if affinity_supported():
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def choose_cpus(threads: int, requested: list[int] | None = None, allowed: list[int] | None = None) -> list[int]:
    """The cores a cell is pinned to: ``requested`` if given, else the last ``threads`` allowed ones.

    The last cores are the default because core 0 tends to take more of the machine's
    interrupts and housekeeping.
    """
    threads = require_positive_int("threads", threads)
    allowed = allowed_cpus() if allowed is None else sorted(allowed)
    if requested is not None:
        requested = sorted(set(requested))
        outside = [cpu for cpu in requested if cpu not in allowed]
        if outside:
            raise ValueError(f"cpus {outside} are not available to this process (allowed: {allowed})")
        if len(requested) != threads:
            raise ValueError(
                f"--cpus names {len(requested)} cores ({requested}) but --threads is {threads}; give one core per thread"
            )
        return requested
    if threads > len(allowed):
        raise ValueError(
            f"threads={threads} is more than the {len(allowed)} cores available to this process ({allowed})"
        )
    return allowed[-threads:]


def pin_current_process(cpus: list[int] | None) -> list[int] | None:
    """Restrict this process (and the threads it starts later) to ``cpus``; returns the new set."""
    if cpus is None or not affinity_supported():
        return None
    os.sched_setaffinity(0, set(cpus))
    return sorted(os.sched_getaffinity(0))


def configure_frameworks(threads: int, frameworks: tuple[str, ...] | list[str]) -> dict:
    """Import the named frameworks and set their runtime thread knobs; returns what was set.

    Called inside a measured child only, before anything is computed: torch refuses
    ``set_num_interop_threads`` once inter-op work has started.
    """
    threads = require_positive_int("threads", threads)
    from mha_rosetta.backends.frameworks import in_order  # in the pinned child only: it imports NumPy

    applied: dict = {}
    for framework in in_order(frameworks):
        applied.update(framework.configure_threads(threads))
    return applied


def limit_thread_pools(threads: int):
    """A threadpoolctl context limiting every loaded BLAS/OpenMP pool, or a no-op without it."""
    threads = require_positive_int("threads", threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(limits=threads)


def thread_pool_report() -> list[dict]:
    """The BLAS/OpenMP pools loaded in this process (threadpoolctl), for the record."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keys = ("user_api", "internal_api", "prefix", "version", "num_threads", "architecture", "threading_layer")
    return [{key: pool.get(key) for key in keys if pool.get(key) is not None} for pool in threadpool_info()]


def child_pids(pid: int | None = None) -> list[int]:
    """The live child processes of ``pid`` (this process by default), from /proc (Linux; [] elsewhere)."""
    pid = os.getpid() if pid is None else pid
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as listing:
                children += [int(child) for child in listing.read().split()]
    except OSError:
        return children
    return sorted(set(children))


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far (/proc/PID/stat; None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            # The command name (field 2) may hold spaces: count the fields after its closing parenthesis.
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def family_cpu_seconds() -> float:
    """CPU time of this process and of its live children (the worker processes of a sharded
    backend): the cell's "cores used" must see the ranks that do the work, not only the
    process that waits for them. A child that exits during a span drops out of the sum."""
    own = time.process_time()
    return own + sum(filter(None, (process_cpu_seconds(child) for child in child_pids())))


def worker_report() -> list[dict]:
    """Each live child process: its pid, the cores it may run on, its CPU time so far and its resident set."""
    report = []
    for child in child_pids():
        try:
            cpus = sorted(os.sched_getaffinity(child)) if affinity_supported() else None
        except OSError:
            continue
        report.append(
            {"pid": child, "affinity": cpus, "cpu_s": process_cpu_seconds(child), "rss_mb": status_mb("VmRSS", child)}
        )
    return report


def cpu_utilisation(cpu_seconds: float, wall_seconds: float) -> float | None:
    """Process CPU time over wall time: about 1.0 for one busy core, 2.0 for two."""
    return cpu_seconds / wall_seconds if wall_seconds > 0 else None


def cpu_use_warning(cpu_util: float | None, threads: int) -> str | None:
    """A warning when a cell used more cores than it was allowed, else None."""
    if cpu_util is not None and cpu_util > threads + CPU_UTIL_SLACK:
        return (
            f"used {cpu_util:.2f} cores (CPU time / wall time) with threads={threads}: "
            "some thread pool escaped the limits, so this cell is not comparable"
        )
    return None


def contention_warning(cpu_util: float | None, threads: int) -> str | None:
    """A warning when a CPU cell got well under one core's worth of CPU time per thread.

    A single-threaded CPU computation is never idle: CPU time / wall time well below 1
    means other processes shared its core, and its times are inflated by their load.
    """
    # Only with one thread: with several, idle workers make a low ratio normal.
    if threads == 1 and cpu_util is not None and cpu_util < CONTENDED_BELOW:
        return (
            f"got only {cpu_util:.2f} of its core (CPU time / wall time): other processes shared it, "
            "so this time is inflated; rerun on a quiet machine"
        )
    return None


# A call that faults in this much memory maps its buffers afresh: the allocator rule did not hold for it.
FAULTED_MIB_WARN = 16


def page_fault_warning(faults_per_call: float | None, malloc: str) -> str | None:
    """A warning when a call faulted in `FAULTED_MIB_WARN` MiB or more: it pays for fresh pages every call."""
    if faults_per_call is None:
        return None
    import resource

    mib = faults_per_call * resource.getpagesize() / 2**20
    if mib < FAULTED_MIB_WARN:
        return None
    rule = (
        "although the allocator rule 'keep' was on: some allocation escaped it"
        if malloc == "keep"
        else f"under --malloc {malloc}, where glibc maps large buffers afresh; --malloc keep reuses them"
    )
    return f"each call faulted in {mib:.0f} MiB of fresh pages ({faults_per_call:.0f} page faults), {rule}"


def cpu_warnings(cpu_util: float | None, threads: int, device: str) -> list[str]:
    """The warnings a measurement carries for its CPU use: too many cores, and on a CPU, too little of its own."""
    warnings = [cpu_use_warning(cpu_util, threads)]
    if device == "cpu":
        warnings.append(contention_warning(cpu_util, threads))
    return [warning for warning in warnings if warning]
