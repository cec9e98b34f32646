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

import importlib.util
import math
import sys
import time
from collections.abc import Callable

from .fresh import child_main, run_fresh
from .pinning import CONTENDED_BELOW, DEFAULT_MALLOC_MODE, malloc_env

GEMM_LIBRARIES = ("numpy", "torch", "jax")
DEFAULT_GEMM_SIZE = 1024
MIN_GEMM_SIZE = 256
SLOW_PRODUCT_S = 0.25  # a first product slower than this halves n on a CPU (see `measure`)
# NumPy has BLAS only for float32/float64; its float16/bfloat16 products are plain loops,
# minutes at n=1024 and no measure of the machine.
_NUMPY_BLAS_DTYPES = ("float32", "float64")
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


def installed_gemm_libraries() -> list[str]:
    """Libraries here that can run the product (checked without importing them)."""
    return [name for name in GEMM_LIBRARIES if importlib.util.find_spec(name) is not None]


def unsupported_reason(library: str, dtype: str, device: str) -> str | None:
    """Why ``library`` cannot give a meaningful peak for this dtype/device, or None."""
    if library == "numpy" and device != "cpu":
        return "NumPy runs on the CPU only"
    if library == "numpy" and dtype not in _NUMPY_BLAS_DTYPES:
        return f"NumPy has no BLAS product for {dtype}"
    return None


# Each builder returns (launch, sync, facts): ``launch()`` starts one product (asynchronous
# on a GPU and for JAX), ``sync()`` waits for everything launched, ``facts`` says what ran.


def _numpy_product(n: int, dtype: str):
    import numpy as np

    from mha_rosetta.core import numpy_dtype

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(numpy_dtype(dtype))  # (n, n), C-contiguous
    b = rng.standard_normal((n, n)).astype(numpy_dtype(dtype))
    out = np.empty_like(a)

    def launch() -> None:
        np.matmul(a, b, out=out)

    return launch, lambda: None, {"numpy": np.__version__, "operand_dtype": str(a.dtype)}


def _torch_product(n: int, dtype: str, device: str):
    import torch

    from mha_rosetta.backends._tf32 import tf32_forced
    from mha_rosetta.backends.torch.common import set_tf32_switches, tf32_state, tf32_switches

    target = "cuda" if device == "gpu" else "cpu"
    facts: dict = {"torch": torch.__version__}
    if target == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        # The cells compare float32 with TF32 off (unless MHA_ROSETTA_TF32=1): the peak must be the
        # same arithmetic. A fresh child process: the switches are set once, for its whole life.
        allow = tf32_forced()
        set_tf32_switches(tf32_state(allow, tf32_switches()["api"]))
        facts.update(
            gpu=torch.cuda.get_device_name(0), tf32=allow and dtype == "float32", tf32_switches=tf32_switches()
        )
    else:
        # torch's own BLAS is linked in and invisible to threadpoolctl: record what it says it has.
        facts.update(mkl=torch.backends.mkl.is_available(), mkldnn=torch.backends.mkldnn.is_available())
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator, dtype=torch.float64).to(device=target, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, generator=generator, dtype=torch.float64).to(device=target, dtype=getattr(torch, dtype))
    out = torch.empty_like(a)
    facts["operand_dtype"] = str(a.dtype).removeprefix("torch.")

    def launch() -> None:
        torch.matmul(a, b, out=out)

    sync = torch.cuda.synchronize if target == "cuda" else (lambda: None)
    return launch, sync, facts


def _jax_product(n: int, dtype: str, device: str):
    import jax
    import jax.numpy as jnp

    from mha_rosetta.backends.jax.common import effective_precision, enable_float64_if_needed, jax_device

    enable_float64_if_needed(dtype)  # without jax_enable_x64, float64 arrays silently become float32
    target = jax_device(device)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.device_put(jax.random.normal(key_a, (n, n), dtype=jnp.dtype(dtype)), target)
    b = jax.device_put(jax.random.normal(key_b, (n, n), dtype=jnp.dtype(dtype)), target)
    # "highest": no reduced-precision passes for float32 on GPU, as in the cells (TF32 only when forced).
    precision = effective_precision("highest")
    product = jax.jit(lambda x, y: jnp.matmul(x, y, precision=precision))
    last = [product(a, b)]  # compile outside the timing
    last[0].block_until_ready()

    def launch() -> None:
        last[0] = product(a, b)

    facts = {"jax": jax.__version__, "operand_dtype": str(a.dtype), "matmul_precision": precision}
    if device == "gpu":
        facts["tf32"] = precision != "highest" and dtype == "float32"
    return launch, lambda: last[0].block_until_ready(), facts


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
        lib for lib in GEMM_LIBRARIES if lib in candidates and not unsupported_reason(lib, REFERENCE_DTYPE, device)
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
    builders = {
        "numpy": lambda: _numpy_product(n, REFERENCE_DTYPE),
        "torch": lambda: _torch_product(n, REFERENCE_DTYPE, device),
        "jax": lambda: _jax_product(n, REFERENCE_DTYPE, device),
    }  # the same builders as the GEMM peak (`measure`)
    launch, sync, facts = builders[library]()

    def run_once() -> None:
        launch()
        sync()

    workload = {"library": library, "device": device, "dtype": REFERENCE_DTYPE, "n": n, "flops": gemm_flops(n, n, n)}
    return run_once, {**workload, "versions": facts}


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


def measure(spec: dict) -> dict:
    """Time one square product in this process (a fresh pinned child)."""
    from . import pinning
    from .flops import gemm_flops
    from .timing import RepeatPolicy, time_repeats, warm_up

    library, dtype, device = spec["library"], spec["dtype"], spec.get("device", "cpu")
    n = gemm_size(dtype, device, int(spec.get("n", DEFAULT_GEMM_SIZE)))
    reason = unsupported_reason(library, dtype, device)
    if reason:
        return {"status": "unsupported", "error": reason}
    threads = int(spec.get("threads", 1))
    if library in ("torch", "jax"):
        pinning.configure_frameworks(threads, (library,))
    builders = {
        "numpy": lambda: _numpy_product(n, dtype),
        "torch": lambda: _torch_product(n, dtype, device),
        "jax": lambda: _jax_product(n, dtype, device),
    }  # the lambdas read n when called, so halving n below rebuilds at the new size
    if library not in builders:
        raise ValueError(f"library must be one of {', '.join(builders)}, got {library!r}")
    policy = RepeatPolicy(**spec.get("policy", {}))
    requested_n = n
    with pinning.limit_thread_pools(threads):
        while True:
            launch, sync, facts = builders[library]()
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
        if device == "gpu":
            timings = time_back_to_back(launch, sync, policy)
        else:

            def run_once() -> None:
                launch()
                sync()

            warm_up(run_once, policy)
            timings = time_repeats(run_once, policy)
    # The median, as for the cells, so that peak_fraction compares like with like.
    flops = gemm_flops(n, n, n)
    cpu_util = pinning.cpu_utilisation(timings["span_cpu_s"], timings["span_wall_s"])
    return {
        "status": "ok",
        "library": library,
        "versions": facts,
        "n": n,
        "requested_n": requested_n,
        "gflops": flops / timings["median_s"] / 1e9,
        **{name: timings[name] for name in ("median_s", "iqr_s", "min_s", "repeats")},
        "back_to_back": timings.get("back_to_back", 1),
        "first_call_s": first,
        "cpu_util": cpu_util,
        "warnings": pinning.cpu_warnings(cpu_util, threads, device),
        "thread_pools": pools,
        "malloc_env": pinning.malloc_env_report(),
    }


def _contended(result: dict, device: str, threads: int) -> bool:
    util = result.get("cpu_util")
    return device == "cpu" and threads == 1 and util is not None and util < CONTENDED_BELOW


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
    by_library: dict[str, dict] = {}

    def run_child(spec: dict) -> dict:
        return run_fresh("mha_rosetta.benchmarks.gemm", spec, threads=threads, timeout=timeout, extra_env=extra_env)

    for library in installed_gemm_libraries() if libraries is None else libraries:
        reason = unsupported_reason(library, dtype, device)
        if reason:
            by_library[library] = {"status": "unsupported", "error": reason}
            continue
        spec = dict(library=library, dtype=dtype, device=device, n=n, threads=threads, cpus=cpus, policy=policy or {})
        best_result = run_child(spec)
        attempts = 1
        while attempts <= retries and best_result.get("status") == "ok" and _contended(best_result, device, threads):
            spec["n"] = best_result["n"]  # the size the child settled on: no second slow first product
            again = run_child(spec)
            attempts += 1
            if again.get("status") == "ok" and again["gflops"] > best_result["gflops"]:
                best_result = again
        best_result["attempts"] = attempts
        by_library[library] = best_result
    record = {**summarize_peak(device, dtype, threads, n, by_library), "malloc": malloc}
    if device == "gpu" and dtype == "float32":
        from mha_rosetta.backends._tf32 import tf32_forced

        record["tf32"] = tf32_forced()  # the children read the same switch (`_torch_product`, `_jax_product`)
    return record


def summarize_peak(device: str, dtype: str, threads: int, n: int, by_library: dict[str, dict]) -> dict:
    """The peak record: the best library's median GFLOP/s, and every library's result."""
    measured = {name: result for name, result in by_library.items() if result.get("status") == "ok"}
    best = max(measured, key=lambda name: measured[name]["gflops"], default=None)
    return {
        "device": device,
        "dtype": dtype,
        "threads": threads,
        "n": measured[best].get("n", n) if best else n,  # the size the winning library ran at
        "gflops": measured[best]["gflops"] if best else None,
        "library": best,
        "by_library": by_library,
    }


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "mha_rosetta.benchmarks.gemm", measure)


if __name__ == "__main__":
    sys.exit(main())
