"""The GEMM peak: what one square matrix product reaches here, with the cells' dtype, device and threads.

"x GFLOP/s" alone says little; "y % of what this machine's best matrix product reaches
under the same limits" says how much of the hardware an implementation uses. The peak is
measured in the same sweep as the cells, in fresh pinned processes exactly like them,
once per library that can do the product (NumPy, PyTorch, JAX; whichever are installed),
and the best of them is the peak. The record keeps every library's figure and names the
winner, so a slow BLAS in one library does not go unnoticed.

Child usage: ``python -m mha_rosetta.benchmarks.gemm '{"library": "numpy", "dtype": "float32", ...}'``.
"""

from __future__ import annotations

import importlib.util
import sys
import time

from .fresh import child_main, run_fresh
from .pinning import CONTENDED_BELOW, DEFAULT_MALLOC_MODE, malloc_env

GEMM_LIBRARIES = ("numpy", "torch", "jax")
DEFAULT_GEMM_SIZE = 1024
MIN_GEMM_SIZE = 256
SLOW_PRODUCT_S = 0.25  # a first product slower than this halves n (see `measure`)
# NumPy has BLAS only for float32/float64; its float16/bfloat16 products are plain loops,
# minutes at n=1024 and no measure of the machine.
_NUMPY_BLAS_DTYPES = ("float32", "float64")


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


def _numpy_product(n: int, dtype: str):
    import numpy as np

    from mha_rosetta.core import numpy_dtype

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(numpy_dtype(dtype))  # (n, n), C-contiguous
    b = rng.standard_normal((n, n)).astype(numpy_dtype(dtype))
    out = np.empty_like(a)

    def run_once() -> None:
        np.matmul(a, b, out=out)

    return run_once, {"numpy": np.__version__}


def _torch_product(n: int, dtype: str, device: str):
    import torch

    target = "cuda" if device == "gpu" else "cpu"
    if target == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        # The cells compare float32 with TF32 off; the peak must be the same arithmetic.
        torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator, dtype=torch.float64).to(device=target, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, generator=generator, dtype=torch.float64).to(device=target, dtype=getattr(torch, dtype))
    out = torch.empty_like(a)

    def run_once() -> None:
        torch.matmul(a, b, out=out)
        if target == "cuda":
            torch.cuda.synchronize()

    # torch's own BLAS is linked in and invisible to threadpoolctl: record what it says it has.
    return run_once, {
        "torch": torch.__version__,
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
    }


def _jax_product(n: int, dtype: str, device: str):
    import jax
    import jax.numpy as jnp

    platform = "gpu" if device == "gpu" else "cpu"
    target = jax.devices(platform)[0]
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.device_put(jax.random.normal(key_a, (n, n), dtype=jnp.dtype(dtype)), target)
    b = jax.device_put(jax.random.normal(key_b, (n, n), dtype=jnp.dtype(dtype)), target)
    # "highest": no reduced-precision passes for float32 on GPU, as in the cells.
    product = jax.jit(lambda x, y: jnp.matmul(x, y, precision="highest"))
    product(a, b).block_until_ready()  # compile outside the timing

    def run_once() -> None:
        product(a, b).block_until_ready()

    return run_once, {"jax": jax.__version__}


def measure(spec: dict) -> dict:
    """Time one square product in this process (a fresh pinned child)."""
    from . import pinning
    from .flops import gemm_flops
    from .timing import RepeatPolicy, time_repeats, warm_up

    library, dtype, device, n = (
        spec["library"],
        spec["dtype"],
        spec.get("device", "cpu"),
        int(spec.get("n", DEFAULT_GEMM_SIZE)),
    )
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
            run_once, versions = builders[library]()
            start = time.perf_counter()
            run_once()
            first = time.perf_counter() - start
            # A library without a fast kernel for this dtype (torch float16 on a CPU takes
            # seconds per product) cannot be the peak; halve n rather than spend minutes on it.
            if first <= SLOW_PRODUCT_S or n <= MIN_GEMM_SIZE:
                break
            n //= 2
        pools = pinning.thread_pool_report()
        warm_up(run_once, policy)
        timings = time_repeats(run_once, policy)
    # The median, as for the cells, so that peak_fraction compares like with like.
    flops = gemm_flops(n, n, n)
    cpu_util = pinning.cpu_utilisation(timings["span_cpu_s"], timings["span_wall_s"])
    warnings = [pinning.cpu_use_warning(cpu_util, threads)]
    if device == "cpu":
        warnings.append(pinning.contention_warning(cpu_util, threads))
    return {
        "status": "ok",
        "library": library,
        "versions": versions,
        "n": n,
        "requested_n": requested_n,
        "gflops": flops / timings["median_s"] / 1e9,
        "median_s": timings["median_s"],
        "iqr_s": timings["iqr_s"],
        "min_s": timings["min_s"],
        "repeats": timings["repeats"],
        "first_call_s": first,
        "cpu_util": cpu_util,
        "warnings": [warning for warning in warnings if warning],
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
    by_library: dict[str, dict] = {}
    for library in installed_gemm_libraries() if libraries is None else libraries:
        reason = unsupported_reason(library, dtype, device)
        if reason:
            by_library[library] = {"status": "unsupported", "error": reason}
            continue
        spec = {
            "library": library,
            "dtype": dtype,
            "device": device,
            "n": n,
            "threads": threads,
            "cpus": cpus,
            "policy": policy or {},
        }
        best_result = run_fresh(
            "mha_rosetta.benchmarks.gemm", spec, threads=threads, timeout=timeout, extra_env=extra_env
        )
        attempts = 1
        while attempts <= retries and best_result.get("status") == "ok" and _contended(best_result, device, threads):
            spec["n"] = best_result["n"]  # the size the child settled on: no second slow first product
            again = run_fresh(
                "mha_rosetta.benchmarks.gemm", spec, threads=threads, timeout=timeout, extra_env=extra_env
            )
            attempts += 1
            if again.get("status") == "ok" and again["gflops"] > best_result["gflops"]:
                best_result = again
        best_result["attempts"] = attempts
        by_library[library] = best_result
    return {**summarize_peak(device, dtype, threads, n, by_library), "malloc": malloc}


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


def best_of(first: dict, second: dict) -> dict:
    """Two peak records of the same (device, dtype, threads) merged: the better result per library.

    The sweep measures the peak before and after its cells; a peak taken while the machine
    was busy would flatter every cell, so the higher figure is the fairer one. Every
    figure measured is kept in ``measured_gflops``.
    """
    history = [*first.get("measured_gflops", [first.get("gflops")]), second.get("gflops")]
    libraries = {**first.get("by_library", {}), **second.get("by_library", {})}
    if not libraries:
        merged = dict(max((first, second), key=lambda peak: peak.get("gflops") or 0.0))
    else:
        by_library = {}
        for library in libraries:
            results = [peak.get("by_library", {}).get(library) for peak in (first, second)]
            measured = [result for result in results if result and result.get("status") == "ok"]
            by_library[library] = (
                max(measured, key=lambda r: r["gflops"]) if measured else next(r for r in results if r)
            )
        merged = summarize_peak(first["device"], first["dtype"], first["threads"], first["n"], by_library)
    merged["measured_gflops"] = history
    malloc = first.get("malloc", second.get("malloc"))
    if malloc is not None:  # both runs of one sweep share the allocator rule
        merged["malloc"] = malloc
    return merged


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "mha_rosetta.benchmarks.gemm", measure)


if __name__ == "__main__":
    sys.exit(main())
