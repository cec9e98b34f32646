"""The GEMM peak: what one square matrix product reaches here, with the cells' dtype, device and threads.

"x GFLOP/s" alone says little; "y % of what this machine's best matrix product reaches
under the same limits" says how much of the hardware an implementation uses. The peak is
measured in the same sweep as the cells, in fresh pinned processes exactly like them,
once per library that can do the product (NumPy, PyTorch, JAX; whichever are installed),
and the best of them is the peak. The record keeps every library's figure and names the
winner, so a slow BLAS in one library does not go unnoticed.

On a CPU each sample is one product (``n`` = 1024 by default; a first product slower than
`SLOW_PRODUCT_S` halves n, for libraries without a fast kernel for the dtype). On a GPU one
product of that size is a few microseconds of work against tens of microseconds of launch
and synchronisation, and the first cuBLAS call is slow by nature, so the GPU peak is
measured differently (`time_back_to_back`): a size that fills the GPU (`GPU_GEMM_SIZES`:
8192 for float16/bfloat16, 4096 for float32/float64), warm-up first, then samples of ``k``
products launched back to back and closed by one synchronisation, the time per product
being the sample over ``k``. float32 states its TF32 state: off, like the cells, unless
``MHA_ROSETTA_TF32=1`` (`backends._tf32`) turns it on for cells and peak alike. JAX float64
turns ``jax_enable_x64`` on first (without it JAX would multiply float32 arrays).

Child usage: ``python -m mha_rosetta.benchmarks.gemm '{"library": "numpy", "dtype": "float32", ...}'``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from .fresh import child_main, run_fresh

if TYPE_CHECKING:
    from mha_rosetta.backends.frameworks import GemmProgram
from .pinning import CONTENDED_BELOW, DEFAULT_MALLOC_MODE, malloc_env

DEFAULT_GEMM_SIZE = 1024
MIN_GEMM_SIZE = 256
SLOW_PRODUCT_S = 0.25  # a first product slower than this halves n on a CPU (see `measure`)
# GPU: sizes whose product keeps the tensor cores busy for about a millisecond or more
# (an H200 does about 790 TFLOP/s in bfloat16 at 8192^3; 1024^3 would be ~3 us of work).
GPU_GEMM_SIZES = {"float16": 8192, "bfloat16": 8192, "float32": 4096, "float64": 4096}
GPU_SAMPLE_S = 0.05  # each GPU sample runs k products for about this long
GPU_MAX_BACK_TO_BACK = 1000


def gemm_size(dtype: str, device: str, requested: int = DEFAULT_GEMM_SIZE) -> int:
    """The product size for a (device, dtype): ``requested`` on a CPU, `GPU_GEMM_SIZES` on a GPU."""
    if device == "gpu":
        if dtype not in GPU_GEMM_SIZES:
            raise ValueError(f"dtype must be one of {', '.join(GPU_GEMM_SIZES)}, got {dtype!r}")
        return GPU_GEMM_SIZES[dtype]
    return requested


def _frameworks() -> dict:
    # The framework layer's libraries, in its order. Imported when asked: a measured child pins
    # itself before anything imports NumPy (`main`), and the layer does.
    from mha_rosetta.backends.frameworks import FRAMEWORKS

    return FRAMEWORKS


def installed_gemm_libraries() -> list[str]:
    """Libraries here that can run the product (checked without importing them)."""
    return [name for name in _frameworks() if importlib.util.find_spec(name) is not None]


def unsupported_reason(library: str, dtype: str, device: str) -> str | None:
    """Why ``library`` cannot give a meaningful peak for this dtype/device, or None (the layer's answer)."""
    return _frameworks()[library].gemm_unsupported(dtype, device)


def _product(library: str, n: int, dtype: str, device: str) -> GemmProgram:
    """(launch, sync, facts) of one library's product (`Framework.gemm_program`), for the peak and the reference."""
    program = _frameworks()[library].gemm_program(n, dtype, device)
    if program is None:
        raise ValueError(f"library {library!r} offers no GEMM product")
    return program


# The reference workload that every cell's samples are paired with (`cell.measure`, issue 28):
# one fixed float32 product, the same for every cell of a device. On a CPU NumPy's, under the
# cell's own pinning and thread limit; on a GPU the device product of a framework the cell
# already uses, with a sync. n=512 on a CPU is ~2.7 ms on one core at ~100 GFLOP/s: a few
# percent of a reference-size cell's 80 ms, long enough to share its slowdowns.
REFERENCE_DTYPE = "float32"
REFERENCE_SIZES = {"cpu": 512, "gpu": 2048}


def reference_library(device: str, frameworks: tuple[str, ...]) -> str | None:
    """The library of the reference product: NumPy on a CPU; on a GPU the first GEMM library among the
    cell's frameworks that can run it there (None without one: the cell is then not paired)."""
    candidates = ("numpy",) if device == "cpu" else frameworks
    usable = (
        lib for lib in _frameworks() if lib in candidates and not unsupported_reason(lib, REFERENCE_DTYPE, device)
    )
    return next(usable, None)


def reference_product(device: str, frameworks: tuple[str, ...]) -> tuple[Callable[[], None] | None, dict | None]:
    """(run_once, workload): one reference product launched and synchronised, and what it is
    (library, device, dtype, n, flops, versions); (None, None) where no library can run it."""
    from .flops import gemm_flops

    library = reference_library(device, frameworks)
    if library is None:
        return None, None
    n = REFERENCE_SIZES[device]
    launch, sync, facts = _product(library, n, REFERENCE_DTYPE, device)  # the same program as the GEMM peak
    one_thread = _one_blas_thread() if device == "cpu" else None
    limit = one_thread or contextlib.nullcontext

    def run_once() -> None:
        with limit():
            launch()
            sync()

    workload = {"library": library, "device": device, "dtype": REFERENCE_DTYPE, "n": n, "flops": gemm_flops(n, n, n)}
    if one_thread is not None:
        workload["blas_threads"] = 1
    return run_once, {**workload, "versions": facts}


def _one_blas_thread() -> Callable | None:
    """A context limiting NumPy's BLAS to one thread, for the CPU reference product; None without threadpoolctl.

    The reference runs between a cell's samples, whatever the cell's framework. With the cell's threads (two),
    OpenBLAS wakes its worker for it, and the worker then spins for its timeout (2**28 cycles by default,
    about 0.1 s) on the other core while the next sample runs: torch-best's reference-size forward at two
    threads took 64-68 ms paired with a two-thread reference against 18.5 with a one-thread one, and 18.7-21.3
    unpaired (Intel Xeon, torch 2.13, OpenBLAS 0.3.31; 20.6 with OPENBLAS_THREAD_TIMEOUT=4, which ends the
    spin; issue 43). At one thread the worker stays asleep. The cells' own products keep their threads; the
    limit costs about 7 us a product (1.3 ms at one thread)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    controller = ThreadpoolController()  # the pools loaded now: NumPy's BLAS among them
    return lambda: controller.limit(limits=1, user_api="blas")


def reference_key(workload: dict) -> str:
    """``"cpu/numpy/float32/512"``: cells whose references share this key share the run's reference time."""
    return "/".join(str(workload[name]) for name in ("device", "library", "dtype", "n"))


def choose_back_to_back(
    launch: Callable[[], None], sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter
) -> int:
    """How many products one GPU sample launches: enough for about `GPU_SAMPLE_S` (call after warm-up)."""
    start = clock()
    for _ in range(3):
        launch()
    sync()
    per_product = (clock() - start) / 3
    if per_product <= 0:
        return GPU_MAX_BACK_TO_BACK
    return max(1, min(GPU_MAX_BACK_TO_BACK, math.ceil(GPU_SAMPLE_S / per_product)))


def time_back_to_back(
    launch: Callable[[], None],
    sync: Callable[[], None],
    policy,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> dict:
    """Warm up, pick ``k`` (`choose_back_to_back`), then time samples of k launches + one sync.

    Returns `timing.time_repeats`' summary per *product* (median, IQR, min divided by k),
    with ``back_to_back`` = k and ``syncs`` = how many synchronisations the timing used.
    """
    from .timing import time_repeats, warm_up

    counted = {"syncs": 0}

    def counted_sync() -> None:
        sync()
        counted["syncs"] += 1

    def one() -> None:
        launch()
        counted_sync()

    warm_up(one, policy, clock)  # the slow first cuBLAS/XLA call and clock ramp-up happen here
    k = choose_back_to_back(launch, counted_sync, clock)
    counted["syncs"] = 0

    def batch() -> None:
        for _ in range(k):
            launch()
        counted_sync()

    timings = time_repeats(batch, policy, clock=clock, cpu_clock=cpu_clock)
    for name in ("median_s", "iqr_s", "min_s", "mean_s"):
        timings[name] /= k
    return {**timings, "back_to_back": k, "syncs": counted["syncs"]}


def time_program(launch: Callable[[], None], sync: Callable[[], None], policy, device: str) -> dict:
    """The timings of a (launch, sync) program (a product here, a copy in `bandwidth`): on a GPU samples of
    back-to-back launches (`time_back_to_back`); on a CPU warm-up, then one launch and sync per sample."""
    from .timing import time_repeats, warm_up

    if device == "gpu":
        return time_back_to_back(launch, sync, policy)

    def run_once() -> None:
        launch()
        sync()

    warm_up(run_once, policy)
    return time_repeats(run_once, policy)


def measure(spec: dict) -> dict:
    """Time one square product in this process (a fresh pinned child)."""
    from . import pinning
    from .flops import gemm_flops
    from .timing import RepeatPolicy

    library, dtype, device = spec["library"], spec["dtype"], spec.get("device", "cpu")
    n = gemm_size(dtype, device, int(spec.get("n", DEFAULT_GEMM_SIZE)))
    reason = unsupported_reason(library, dtype, device)
    if reason:
        return {"status": "unsupported", "error": reason}
    threads = int(spec.get("threads", 1))
    if library not in _frameworks():
        raise ValueError(f"library must be one of {', '.join(_frameworks())}, got {library!r}")
    pinning.configure_frameworks(threads, (library,))  # a no-op for a library without thread knobs (NumPy)
    policy = RepeatPolicy(**spec.get("policy", {}))
    requested_n = n
    with pinning.limit_thread_pools(threads):
        while True:
            launch, sync, facts = _product(library, n, dtype, device)  # rebuilt at the halved n below
            start = time.perf_counter()
            launch()
            sync()
            first = time.perf_counter() - start
            # A CPU library without a fast kernel for this dtype (torch float16 on a CPU takes
            # seconds per product) cannot be the peak; halve n rather than spend minutes on it.
            # On a GPU a slow first call is cuBLAS/XLA starting up: the size stays.
            if device == "gpu" or first <= SLOW_PRODUCT_S or n <= MIN_GEMM_SIZE:
                break
            n //= 2
        pools = pinning.thread_pool_report()
        timings = time_program(launch, sync, policy, device)
    # The median, as for the cells, so that peak_fraction compares like with like.
    flops = gemm_flops(n, n, n)
    return {
        "status": "ok",
        "library": library,
        "versions": facts,
        "n": n,
        "requested_n": requested_n,
        "gflops": flops / timings["median_s"] / 1e9,
        **timing_fields(timings, pools, threads, device),
        "first_call_s": first,
        "malloc_env": pinning.malloc_env_report(),
    }


def timing_fields(timings: dict, pools: list[dict], threads: int, device: str) -> dict:
    """What a measured child reports of `time_program`'s ``timings`` (the GEMM peak's and the copy bandwidth's):
    median, IQR, min and repeats, the programs per sample (``back_to_back``), the CPU use (CPU time / wall time)
    with its warnings, and the thread pools (``pools``, `pinning.thread_pool_report`)."""
    from . import pinning

    cpu_util = pinning.cpu_utilisation(timings["span_cpu_s"], timings["span_wall_s"])
    return {
        **{name: timings[name] for name in ("median_s", "iqr_s", "min_s", "repeats")},
        "back_to_back": timings.get("back_to_back", 1),
        "cpu_util": cpu_util,
        "warnings": pinning.cpu_warnings(cpu_util, threads, device),
        "thread_pools": pools,
    }


def _contended(result: dict, device: str, threads: int) -> bool:
    util = result.get("cpu_util")
    return device == "cpu" and threads == 1 and util is not None and util < CONTENDED_BELOW


def best_uncontended(run: Callable[[dict | None], dict], figure: str, device: str, threads: int, retries: int) -> dict:
    """``run(None)``, then, while the best result so far shared its core (CPU time / wall time under
    `pinning.CONTENDED_BELOW`), up to ``retries`` more runs (``run(best so far)``), the one with the highest
    ``figure`` kept (a shared core only ever lowers it); its ``attempts`` says how many ran. The GEMM peak's
    rule, and the copy bandwidth's (`bandwidth.measure_bandwidth`)."""
    best = run(None)
    attempts = 1
    while attempts <= retries and best.get("status") == "ok" and _contended(best, device, threads):
        again = run(best)
        attempts += 1
        if again.get("status") == "ok" and again[figure] > best[figure]:
            best = again
    best["attempts"] = attempts
    return best


def each_library_best(
    libraries: list[str],
    unsupported: Callable[[str], str | None],
    run: Callable[[str, dict | None], dict],
    figure: str,
    device: str,
    threads: int,
    retries: int,
) -> dict[str, dict]:
    """Every library's result by name: ``{"status": "unsupported", "error": reason}`` where ``unsupported(library)``
    gives a reason, else the best of its runs (`best_uncontended`, ``run(library, best so far)``, a fresh child
    each). The GEMM peak's rule (`measure_gemm_peak`), and the copy bandwidth's (`bandwidth.measure_bandwidth`)."""
    by_library: dict[str, dict] = {}
    for library in libraries:
        reason = unsupported(library)
        if reason:
            by_library[library] = {"status": "unsupported", "error": reason}
        else:
            by_library[library] = best_uncontended(partial(run, library), figure, device, threads, retries)
    return by_library


def measure_gemm_peak(
    dtype: str,
    device: str,
    threads: int,
    cpus: list[int] | None,
    *,
    n: int = DEFAULT_GEMM_SIZE,
    policy: dict | None = None,
    libraries: list[str] | None = None,
    timeout: float = 300.0,
    retries: int = 1,
    malloc: str = DEFAULT_MALLOC_MODE,
) -> dict:
    """The best median GFLOP/s of an (n, n) @ (n, n) product over the installed libraries.

    A measurement that shared its core with other processes (CPU time / wall time under
    `pinning.CONTENDED_BELOW`) underestimates the peak and would make every cell look
    better than it is, so it is repeated up to ``retries`` times and the best kept.
    ``malloc`` is the allocator rule of the children (`pinning.malloc_env`), as for the cells.
    Returns ``{"device", "dtype", "threads", "n", "gflops", "library", "by_library": {...}}``;
    ``gflops`` is None when no library could run the product (every reason is kept).
    """
    extra_env = malloc_env(malloc)  # validates the mode before any child starts
    n = gemm_size(dtype, device, n)  # a GPU has its own sizes (`GPU_GEMM_SIZES`)

    def run(library: str, best: dict | None) -> dict:
        # Again: at the size the child settled on, so no second slow first product.
        size = n if best is None else best["n"]
        spec = dict(
            library=library, dtype=dtype, device=device, n=size, threads=threads, cpus=cpus, policy=policy or {}
        )
        return run_fresh("mha_rosetta.benchmarks.gemm", spec, threads=threads, timeout=timeout, extra_env=extra_env)

    by_library = each_library_best(
        installed_gemm_libraries() if libraries is None else libraries,
        lambda library: unsupported_reason(library, dtype, device), run, "gflops", device, threads, retries,
    )  # fmt: skip
    record = {**summarize_peak(device, dtype, threads, n, by_library), "malloc": malloc}
    if device == "gpu" and dtype == "float32":
        from mha_rosetta.backends import tf32_forced

        record["tf32"] = tf32_forced()  # the children read the same switch (`Framework.gemm_program`)
    return record


def best_library(by_library: dict[str, dict], figure: str) -> str | None:
    """The library with the highest ``figure`` among those measured (status "ok"), None when none was: the GEMM
    peak's rule (`summarize_peak`), and the copy bandwidth's (`bandwidth.summarize_bandwidth`)."""
    measured = [name for name, result in by_library.items() if result.get("status") == "ok"]
    return max(measured, key=lambda name: by_library[name][figure], default=None)


def summarize_peak(device: str, dtype: str, threads: int, n: int, by_library: dict[str, dict]) -> dict:
    """The peak record: the best library's median GFLOP/s, and every library's result."""
    best = best_library(by_library, "gflops")
    return {
        "device": device,
        "dtype": dtype,
        "threads": threads,
        "n": by_library[best].get("n", n) if best else n,  # the size the winning library ran at
        "gflops": by_library[best]["gflops"] if best else None,
        "library": best,
        "by_library": by_library,
    }


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "mha_rosetta.benchmarks.gemm", measure)


if __name__ == "__main__":
    sys.exit(main())
