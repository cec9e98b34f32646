"""The memory-bandwidth limit: what a STREAM-like copy moves per second here, and what a decode step must read.

A decode step does almost no arithmetic per byte: one new query per head against every cached
key and value. Its physical limit is not the GEMM peak but the memory bandwidth, so ``bench
--mode decode`` measures that in the same run as its cells, the same way as the GEMM peak
(`gemm`): in fresh pinned processes, with the cells' threads and allocator rule, warm-up, then
adaptive repeats (`timing.time_repeats`), the median kept with the IQR and the round spread;
once per library of the framework layer that offers the copy (`Framework.copy_program`: NumPy on a
CPU, PyTorch on a CPU and a GPU), the best named.

The workload is STREAM's *copy* (``dst[:] = src``), counted as STREAM counts it: 2 x the array's
bytes per copy (one read, one write; the write-allocate read a CPU may add is not counted, as in
STREAM). STREAM's *triad* (``a = b + s * c``) is not offered: NumPy has no one-pass triad, and
``np.multiply(c, s, out=a); np.add(a, b, out=a)`` moves five arrays' worth of bytes for the three
counted, which would understate the bandwidth by up to 40%.

On a CPU each array is `DEFAULT_ARRAY_MB` MiB (float64), far larger than the caches a core can
use, and at least `LLC_FACTOR` x the last-level cache where `last_level_cache_bytes` can read it,
unless the memory budget forbids (the record then says so: a copy that partly runs from cache
overstates the bandwidth). Both arrays are written once before timing, so page faults are not
timed. On a GPU (PyTorch's ``copy_`` on the device, float32) the samples are back-to-back copies
closed by one synchronisation (`gemm.time_program`), as for the GPU GEMM peak.

The limit of one decode step (`kv_read_bytes`, `limit_seconds`): the bytes of K and V it must
read, ``B x slots x Hkv x (Dk + Dv) x itemsize`` with ``slots`` the context (with a window at most
the ring's `core.decode.ring_capacity` slots), over the bandwidth. `weight_bytes` gives the
projection weights a step also reads, for the second, stricter limit the decode table shows.

Child usage: ``python -m mha_rosetta.benchmarks.bandwidth '{"library": "numpy", "device": "cpu", ...}'``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .fresh import child_main, run_fresh
from .gemm import best_library, each_library_best
from .limits import limit_seconds
from .pinning import DEFAULT_MALLOC_MODE, malloc_env

if TYPE_CHECKING:
    from mha_rosetta.backends.frameworks import CopyProgram

DEFAULT_ARRAY_MB = 512  # per array on a CPU: two of them are live (1 GiB in all)
GPU_ARRAY_MB = 1024  # per array on a GPU: far beyond any GPU's L2 (an H200's is 60 MiB)
LLC_FACTOR = 4  # an array at least this many times the last-level cache
COPY_ARRAYS = 2  # STREAM's copy counts one read and one write per element


def copy_bytes(elements: int, itemsize: int) -> int:
    """The bytes one copy of ``elements`` elements moves, counted as STREAM counts them: read + write."""
    return COPY_ARRAYS * elements * itemsize


def last_level_cache_bytes(root: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the last-level cache of cpu0 as Linux's sysfs reports it, or None where it cannot be read."""
    best: tuple[int, int] | None = None
    for index in sorted(Path(root).glob("index*")):
        try:
            level = int((index / "level").read_text().strip())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        units = {"K": 1024, "M": 1024**2, "G": 1024**3}
        number = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if best is None or level > best[0]:
            best = (level, number)
    return None if best is None else best[1]


def _frameworks() -> dict:
    # The framework layer's libraries, in its order; imported when asked (a measured child pins itself first).
    from mha_rosetta.backends.frameworks import FRAMEWORKS

    return FRAMEWORKS


def bandwidth_libraries() -> list[str]:
    """The libraries offered, in the order they are measured: the framework layer's with a copy program."""
    from mha_rosetta.backends.frameworks import copy_libraries

    return copy_libraries()


def unsupported_reason(library: str, device: str) -> str | None:
    """Why ``library`` cannot measure a copy on ``device`` here, or None (then `Framework.copy_unsupported`)."""
    offered = bandwidth_libraries()
    if library not in offered:
        return f"library must be one of {', '.join(offered)}, got {library!r}"
    if device not in ("cpu", "gpu"):
        return f"device must be 'cpu' or 'gpu', got {device!r}"
    if importlib.util.find_spec(library) is None:
        return f"{library} is not installed"
    return _frameworks()[library].copy_unsupported(device)


def copy_program(library: str, array_bytes: int, device: str) -> CopyProgram:
    """(launch, sync, facts) of one copy of an ``array_bytes`` array (`Framework.copy_program`), its destination
    touched once, untimed; facts: elements, itemsize, moved_bytes, and ``arrays`` (source, destination) so that
    a caller can check what was copied."""
    offered = bandwidth_libraries()
    program = _frameworks()[library].copy_program(array_bytes, device) if library in offered else None
    if program is None:
        raise ValueError(f"library must be one of {', '.join(offered)}, got {library!r}")
    launch, sync, facts = program
    launch()  # the first touch of the destination, untimed
    sync()
    facts["moved_bytes"] = copy_bytes(facts["elements"], facts["itemsize"])
    return launch, sync, facts


def measure(spec: dict) -> dict:
    """Time the copy in this process (a fresh pinned child); with ``spec["kernel"] == "read"``, the decode
    limit's side of the machine instead: the last-level cache measured and a read stream over arrays larger
    than it (`limits.measure_read_limit`)."""
    from . import pinning
    from .gemm import time_program, timing_fields
    from .timing import RepeatPolicy

    if spec.get("kernel") == "read":
        from .limits import READ_KERNEL, measure_read_limit

        pinning.configure_frameworks(int(spec.get("threads", 1)), ("numpy",))
        with pinning.limit_thread_pools(int(spec.get("threads", 1))):
            result = measure_read_limit(spec.get("cpus"))
        return {"status": "ok", "kernel": READ_KERNEL, **result}
    library, device = spec["library"], spec.get("device", "cpu")
    reason = unsupported_reason(library, device)
    if reason:
        return {"status": "unsupported", "error": reason}
    threads = int(spec.get("threads", 1))
    pinning.configure_frameworks(threads, (library,))
    policy = RepeatPolicy(**spec.get("policy", {}))
    array_bytes = int(spec["array_mb"] * 1024 * 1024)
    with pinning.limit_thread_pools(threads):
        launch, sync, facts = copy_program(library, array_bytes, device)
        facts.pop("arrays")
        pools = pinning.thread_pool_report()
        timings = time_program(launch, sync, policy, device)
    moved = facts["moved_bytes"]
    return {
        "status": "ok",
        "library": library,
        "versions": {key: facts[key] for key in ("library", "version")},
        "dtype": facts["dtype"],
        "array_bytes": facts["elements"] * facts["itemsize"],
        "moved_bytes": moved,
        "gbps": moved / timings["median_s"] / 1e9,  # the median, like the GEMM peak
        "best_gbps": moved / timings["min_s"] / 1e9,
        **timing_fields(timings, pools, threads, device),
        "samples_s": timings.get("samples_s"),
    }


def array_mb_for(
    device: str, requested: float | None, llc: int | None, available_mb: float | None
) -> tuple[float, str]:
    """(MiB per array, why): ``requested``, or the default raised to `LLC_FACTOR` x the last-level cache,
    held to a quarter of the available memory (two arrays live)."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"array_mb must be a positive number of MiB, got {requested!r}")
        return float(requested), "as requested"
    if device == "gpu":
        return float(GPU_ARRAY_MB), "the GPU default"
    size, why = float(DEFAULT_ARRAY_MB), "the default"
    if llc is not None and LLC_FACTOR * llc / 2**20 > size:
        size, why = LLC_FACTOR * llc / 2**20, f"{LLC_FACTOR} x the last-level cache"
    if available_mb is not None and size > available_mb / 4:
        size, why = available_mb / 4, "held to a quarter of the available memory"
    return size, why


def cache_warning(array_bytes: int, llc: int | None) -> str | None:
    """A warning when the copied array is not well beyond the last-level cache (the figure then runs high)."""
    if llc is None or array_bytes >= LLC_FACTOR * llc:
        return None
    return (
        f"the array ({array_bytes / 2**20:.0f} MiB) is under {LLC_FACTOR} x the last-level cache "
        f"({llc / 2**20:.0f} MiB): part of the copy may run from cache, so the bandwidth may be overstated"
    )


def _available_mb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def measure_bandwidth(
    device: str,
    threads: int,
    cpus: list[int] | None,
    *,
    array_mb: float | None = None,
    policy: dict | None = None,
    libraries: list[str] | None = None,
    timeout: float = 300.0,
    retries: int = 1,
    malloc: str = DEFAULT_MALLOC_MODE,
) -> dict:
    """The best median copy bandwidth (GB/s, 1e9 bytes) over the libraries, each in a fresh pinned child.

    A measurement whose core was shared (CPU time / wall time under `pinning.CONTENDED_BELOW`)
    is repeated up to ``retries`` times and the best kept, as for the GEMM peak. Returns
    ``{"device", "threads", "gbps", "library", "by_library", "array_bytes", "llc_bytes", "rule", ...}``;
    ``gbps`` is None when no library could copy.
    """
    extra_env = malloc_env(malloc)
    llc = last_level_cache_bytes() if device == "cpu" else None
    size_mb, why = array_mb_for(device, array_mb, llc, _available_mb() if device == "cpu" else None)

    def run(library: str, _best: dict | None) -> dict:
        spec = dict(library=library, device=device, array_mb=size_mb, threads=threads, cpus=cpus, policy=policy or {})
        return run_fresh(
            "mha_rosetta.benchmarks.bandwidth", spec, threads=threads, timeout=timeout, extra_env=extra_env
        )

    by_library = each_library_best(
        bandwidth_libraries() if libraries is None else libraries,
        lambda library: unsupported_reason(library, device), run, "gbps", device, threads, retries,
    )  # fmt: skip
    record = summarize_bandwidth(device, threads, by_library)
    record.update(array_mb=size_mb, array_rule=why, llc_bytes=llc, malloc=malloc)
    if device == "cpu":
        # The decode limit's own figures (issue 43): a read stream, the way a step reads its cache and weights,
        # over arrays larger than the last-level cache as measured (sysfs's figure is not what reads see).
        spec = dict(kernel="read", library="numpy", device=device, threads=threads, cpus=cpus)
        read = run_fresh(
            "mha_rosetta.benchmarks.bandwidth", spec, threads=threads, timeout=timeout, extra_env=extra_env
        )
        record.update(
            read_gbps=read.get("read_gbps"),
            measured_llc_bytes=(read.get("llc") or {}).get("llc_bytes"),
            read=read,
        )
    warning = cache_warning(int(size_mb * 2**20), llc)
    record["warnings"] = [warning] if warning else []
    return record


def summarize_bandwidth(device: str, threads: int, by_library: dict[str, dict]) -> dict:
    """The bandwidth record: the best library's median GB/s, and every library's result."""
    best = best_library(by_library, "gbps")
    return {
        "device": device,
        "threads": threads,
        "workload": "copy",
        "rule": "STREAM copy dst[:] = src, counted as 2 x the array's bytes (one read, one write) over the median time",
        "gbps": by_library[best]["gbps"] if best else None,
        "library": best,
        "by_library": by_library,
    }


def merge_bandwidths(records: list[dict | None]) -> dict | None:
    """One device's bandwidth over the rounds: the median of the round figures, each round's kept."""
    import statistics

    present = [record for record in records if record is not None]
    if not present:
        return None
    merged = dict(present[0])
    rounds = [None if record is None else record.get("gbps") for record in records]
    measured = [value for value in rounds if value is not None]
    merged["round_gbps"] = rounds
    merged["gbps"] = statistics.median(measured) if measured else None
    merged["spread_gbps"] = [min(measured), max(measured)] if measured else None
    reads = [record.get("read_gbps") for record in present if record.get("read_gbps")]
    caches = [record.get("measured_llc_bytes") for record in present if record.get("measured_llc_bytes")]
    merged["round_read_gbps"] = [None if record is None else record.get("read_gbps") for record in records]
    merged["read_gbps"] = statistics.median(reads) if reads else None
    merged["measured_llc_bytes"] = min(caches) if caches else None  # the smallest: the cells that fit fit every round
    return merged


# -- the limit of one decode step -----------------------------------------------------------------
def kv_read_bytes(
    batch: int, context: int, kv_heads: int, d_k: int, d_v: int, itemsize: int, ring: int | None = None
) -> int:
    """Bytes of K and V one decode step reads: ``B x slots x Hkv x (Dk + Dv) x itemsize``, ``slots`` the context,
    at most ``ring`` (a window's ring buffer, `core.decode.ring_capacity`)."""
    slots = context if ring is None else min(context, ring)
    return batch * slots * kv_heads * (d_k + d_v) * itemsize


def weight_bytes(d_model: int, heads: int, kv_heads: int, d_k: int, d_v: int, itemsize: int) -> int:
    """Bytes of the four projection matrices a step reads once: W_q (D, H Dk), W_k (D, Hkv Dk), W_v (D, Hkv Dv),
    W_o (H Dv, D) (biases, a few KiB, left out)."""
    return d_model * (heads * d_k + kv_heads * d_k + kv_heads * d_v + heads * d_v) * itemsize


def limit_fraction(limit_s: float | None, step_s: float | None) -> float | None:
    """The share of the bandwidth limit a step reaches: limit / measured time (1.0 = at the limit)."""
    if limit_s is None or not step_s or step_s <= 0:
        return None
    return limit_s / step_s


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "mha_rosetta.benchmarks.bandwidth", measure)


if __name__ == "__main__":
    sys.exit(main())


# -- a decode cell against the limit (here, not in `decode`, so that `report` can re-derive a loaded decode report) --
def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def enrich_decode_cell(
    cell: dict,
    bandwidth_gbps: float | None,
    llc_bytes: int | None = None,
    *,
    read_gbps: float | None = None,
    measured_llc_bytes: int | None = None,
) -> dict:
    """Add the limit and what the step reaches of it, tokens per second, the prefill/step ratio and the cache's MiB.

    The figure used is `rounds.cell_time` (drift-corrected where the cell has it); the limit is the
    K and V bytes the step reads (`bandwidth.kv_read_bytes`) over ``bandwidth_gbps``. Where the step's
    bytes (K, V and the weights) fit in the last-level cache (``llc_bytes``), the timed steps, which
    read the same bytes again and again, may read them from the cache rather than from memory, while
    the bandwidth is memory's: ``fits_last_level_cache`` says so, and % of the limit may pass 100%.
    (In a real model the other layers' weights would flush the cache between two steps of a layer.)

    The headline limit (issue 43) counts every byte a step reads, K, V and the weights, over the read
    bandwidth (``read_gbps``, `limits.read_bandwidth`) measured in the same run over arrays larger than
    the last-level cache as measured (``measured_llc_bytes``): ``read_limit_s`` and ``read_limit_fraction``,
    with ``fits_measured_cache`` where those bytes fit in the measured cache. The K+V limit over the copy
    bandwidth stays as ``limit_s`` / ``limit_fraction`` (the old column).
    """
    from .rounds import cell_interval, cell_time

    cell = dict(cell)
    itemsize = _itemsize(cell["dtype"])
    ring = None if cell.get("window") is None else cell["window"] - 1 + cell["step"]
    if cell.get("mla"):  # the MLA row: the latent cache and the weights each form reads (`decode_mla`)
        from .decode_mla import mla_read_bytes

        cell.update(mla_read_bytes(cell, itemsize))
        kv, weights = cell["kv_read_bytes"], cell["weight_bytes"]
    else:
        kv = kv_read_bytes(cell["batch"], cell["context"], cell["kv_heads"], cell["d_k"], cell["d_k"], itemsize, ring)
        weights = weight_bytes(cell["d_model"], cell["heads"], cell["kv_heads"], cell["d_k"], cell["d_k"], itemsize)
    cell.update(
        kv_read_bytes=kv, weight_bytes=weights, bandwidth_gbps=bandwidth_gbps,
        limit_s=limit_seconds(kv, bandwidth_gbps), limit_with_weights_s=limit_seconds(kv + weights, bandwidth_gbps),
    )  # fmt: skip
    if llc_bytes:
        cell["fits_last_level_cache"] = kv + weights <= llc_bytes
    cell.update(read_gbps=read_gbps, read_limit_s=limit_seconds(kv + weights, read_gbps))
    if measured_llc_bytes:
        cell["measured_llc_bytes"] = measured_llc_bytes
        cell["fits_measured_cache"] = kv + weights <= measured_llc_bytes
    cache = cell.get("cache_info")
    if isinstance(cache, dict) and isinstance(cache.get("bytes"), (int, float)):
        cell["cache_mb"] = cache["bytes"] / 2**20
    if cell.get("status") != "ok":
        return cell
    step_s = cell_time(cell)
    low, high = cell_interval(cell)
    cell.update(
        step_s=step_s,
        step_spread_s=[low, high],
        limit_fraction=limit_fraction(cell["limit_s"], step_s),
        limit_fraction_with_weights=limit_fraction(cell["limit_with_weights_s"], step_s),
        read_limit_fraction=limit_fraction(cell["read_limit_s"], step_s),
        tokens_per_s=cell["batch"] * cell["step"] / step_s if step_s > 0 else None,
    )
    if cell.get("prefill_median_s") is not None and step_s > 0:
        cell["prefill_over_step"] = cell["prefill_median_s"] / step_s
    return cell
