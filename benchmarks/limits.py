"""The decode limit that counts every byte: what a step reads, how fast one core reads, where the cache ends.

A decode step does almost no arithmetic per byte, so its limit is the time to read what it must
read. Issue 43 found three faults in the first limit (`bandwidth`), and this module is the
corrected one (NumPy and the standard library only; not wired into ``bench`` yet):

* **The bytes** (`step_bytes`): K and V of every slot the step attends (the context and the step's
  own tokens, at most a window's ring), *and* every parameter of the layer (the four projections,
  91% of a step's bytes at 1k tokens and 24% at 32k for the decode preset's Llama-3-like layer),
  biases and the variants' small parameters included. The first limit counted K and V only.
* **The bandwidth** (`read_bandwidth`): a read stream, the way a step reads its cache and weights,
  timed in this process (pin it first: the limit is the pinned cores'), as the fastest of three
  readers (`READ_KERNELS`): ``np.sum`` over float64, ``np.max`` over float32 and BLAS's GEMV over
  float32 rows (a decode step's own pattern). One reader is not enough: on the Intel Xeon of
  2026-12-06 (1 pinned core, 512 MiB) ``np.sum`` read 10.4 GB/s, its pairwise additions the bound,
  while ``np.max`` and the GEMV read 17.0-17.7 GB/s, and ``torch-best``'s B=4 step at 32k read its
  552 MiB at 8.9 GB/s, "109.6%" of the ``np.sum`` limit. The first limit used STREAM's copy counted as twice the bytes (25.1 GB/s on the Intel Xeon
  issue 43 was measured on), while a read stream on one of its cores got 15.3-17.8 GB/s (16.6 for
  ``np.sum`` over 256 MiB there, loaded). Machines differ: the AMD EPYC the README's decode table was
  measured on read 30.6-32.6 GB/s over 512 MiB (docs/bench/decode.json), 16x its 32 MiB L3.
* **The cache** (`measure_llc`): read bandwidth against array size. The Xeon's sysfs reported a
  480 MiB last-level cache while its reads slowed above 48-128 MiB (one pinned core, loaded: 44-48
  GB/s up to 16 MiB, 34-35 at 32-64 MiB, 16.4-16.9 at 128-256 MiB); the EPYC's sysfs says 32 MiB
  and its sweep read 45-50 GB/s up to 16 MiB, 34 at 32 MiB, 30-32 from 64 MiB. So the size is
  measured, never read from sysfs, as two sizes: ``llc_bytes``, the largest array that still reads
  clearly faster than memory (a working set up to it is read from the cache), and
  ``memory_from_bytes``, the smallest from which every larger one reads at memory speed (between
  the two a working set is partly cached: the EPYC's 32 MiB). The bandwidth is then measured over
  arrays `LLC_FACTOR` x the second and no smaller than the sweep's largest (`measure_read_limit`,
  which also checks that the array read at memory speed), and each cell's working set can be
  reported against the cache (`fits_in_cache`).

  Audit (issue 43, part 4): the first rule ended the cache before the *first* size under 1.25x
  memory speed, so one slow reading at a small size (a loaded machine slows reads, never speeds
  them) cut the cache short; it is now the *largest* size below the sweep's tail that reads
  1.25x faster than memory, and the array the bandwidth is read over scales with the size where
  memory speed begins, not with the last fast one. On the EPYC's sweep both rules give 16 MiB and
  a 512 MiB array (the floor), so its published figures stand; tests/test_limits.py checks the
  selection on synthetic curves.

The arithmetic is separate from the clock and the reader, so that tests check it on hand-computed
bytes and a fake clock; nothing here asserts a measured speed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mha_rosetta.core import MHAConfig

# core (NumPy) is imported inside the functions that need it: `bandwidth` imports this module, and the
# bandwidth child imports `bandwidth` before it pins itself (nothing heavy may load before the pin).

MiB = 2**20
# The sweep of `measure_llc`: 1 MiB to 2 GiB by doubling. The largest sizes must be well past the last-level cache
# a core can use: the Intel Xeon of 2026-12-06 (sysfs: 300 MiB) read 31 GB/s up to 128 MiB, 21.5 at 256 and 16.6 at
# 512 with the fastest reader, so a sweep that stopped at 512 MiB took cached sizes for its memory-speed tail.
LLC_SWEEP = tuple(MiB << n for n in range(12))
# A size is "in cache" while it reads at least this much faster than memory: the median of the sweep's
# `MEMORY_TAIL` largest sizes (512 MiB to 2 GiB by default, all past the cache, so one noisy figure moves nothing).
CACHE_SPEEDUP = 1.25
MEMORY_TAIL = 3
# A size reads "at memory speed" under this multiple of it (the EPYC's 32 MiB read 1.11x: partly cached).
MEMORY_BAND = 1.10
# The bandwidth is measured over arrays at least this many times the measured last-level cache.
LLC_FACTOR = 4
READ_KERNEL = "the fastest of np.sum (float64), np.max (float32) and BLAS's GEMV (float32 rows) over one array"
# The readers `read_bandwidth` times by default: each reads every byte of the array once and writes (next to)
# nothing; the limit takes the fastest (a reader bound by its own arithmetic is not the memory's limit).
GEMV_COLUMNS = 1024


def _gemv(array) -> None:
    import numpy as np

    rows = array.view(np.float32)  # (2n,) float32 view of the float64 buffer, no copy
    rows = rows[: rows.size // GEMV_COLUMNS * GEMV_COLUMNS].reshape(-1, GEMV_COLUMNS)  # (R, 1024) view, no copy
    rows @ np.ones(GEMV_COLUMNS, dtype=np.float32)  # (R,): one pass over the rows, as a decode step's x @ W.T


def _max32(array) -> None:
    import numpy as np

    array.view(np.float32).max()  # a float32 view, no copy: a vectorised compare, no dependency chain


READ_KERNELS: dict[str, Callable[[object], object]] = {
    "np.sum (float64)": lambda array: array.sum(),
    "np.max (float32)": _max32,
    "BLAS GEMV (float32 rows)": _gemv,
}


@dataclass(frozen=True)
class StepBytes:
    """The bytes one decode step reads: ``kv`` (K and V of every slot it attends), ``weights`` (w_q, w_k, w_v,
    w_o) and ``other`` (biases, QK-norm weights, sinks, T5's table: every other parameter)."""

    kv: int
    weights: int
    other: int

    @property
    def parameters(self) -> int:
        return self.weights + self.other

    @property
    def total(self) -> int:
        return self.kv + self.weights + self.other


def step_bytes(cfg: MHAConfig, context: int, dtype: str, *, batch: int = 1, step: int = 1) -> StepBytes:
    """What a step of ``step`` tokens over ``context`` cached ones reads, in ``dtype``.

    K and V: ``batch x slots x Hkv x (Dk + Dv) x itemsize`` with ``slots`` the context and the step's
    tokens (at most the window's ring, `core.decode.cache_capacity`); the parameters once each (their
    shapes from `core.expected_param_shapes`), whatever the batch.
    """
    for name, value, low in (("context", context, 0), ("batch", batch, 1), ("step", step, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    from mha_rosetta.core import expected_param_shapes, numpy_dtype
    from mha_rosetta.core.decode import cache_capacity

    itemsize = numpy_dtype(dtype).itemsize
    slots = cache_capacity(cfg, context + step, step)
    kv = batch * slots * cfg.n_kv_heads * (cfg.d_k + cfg.d_v) * itemsize
    sizes = {name: math.prod(shape) for name, shape in expected_param_shapes(cfg).items() if shape is not None}
    weights = sum(size for name, size in sizes.items() if name.startswith("w_"))
    return StepBytes(kv, weights * itemsize, (sum(sizes.values()) - weights) * itemsize)


def limit_seconds(nbytes: int, gbps: float | None) -> float | None:
    """The time to read ``nbytes`` at ``gbps`` (1e9 bytes per second), or None without a bandwidth."""
    if not gbps or gbps <= 0:
        return None
    return nbytes / (gbps * 1e9)


def decode_limit_s(nbytes: int | StepBytes, read_gbps: float | None) -> float | None:
    """The time to read ``nbytes`` (or a `StepBytes`' total) at ``read_gbps`` (1e9 bytes per second): the step's
    limit; None without a bandwidth."""
    return limit_seconds(nbytes.total if isinstance(nbytes, StepBytes) else nbytes, read_gbps)


def fits_in_cache(nbytes: int | StepBytes, llc_bytes: int | None) -> bool | None:
    """Whether a working set of ``nbytes`` fits the measured last-level cache (a timed loop over the same step
    may then read it from the cache, faster than the memory the limit assumes); None when the size is unknown."""
    if llc_bytes is None:
        return None
    return (nbytes.total if isinstance(nbytes, StepBytes) else nbytes) <= llc_bytes


def read_bandwidth(
    array_bytes: int,
    *,
    repeats: int = 7,
    clock: Callable[[], float] = time.perf_counter,
    read: Callable[[object], object] | None = None,
) -> dict:
    """The read stream's bandwidth over a float64 array of ``array_bytes`` (rounded down to whole elements).

    The array is written before timing (its pages faulted in); each reader (``read``, else every one of
    `READ_KERNELS`) reads it once untimed, then ``repeats`` times between two readings of ``clock``. The
    fastest reader's median is the figure. Returns ``{"gbps"`` (1e9 bytes per second), ``"best_gbps"``,
    ``"median_s"``, ``"samples_s"``, ``"array_bytes"``, ``"kernel"`` (the fastest reader's name),
    ``"kernels"`` (every reader's median GB/s)``}``.
    """
    import numpy as np

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    elements = array_bytes // 8
    if elements < 1:
        raise ValueError(f"array_bytes must hold at least one float64 (8 bytes), got {array_bytes!r}")
    array = np.ones(elements)  # written: every page faulted in before the timing
    nbytes = elements * 8
    readers = READ_KERNELS if read is None else {"read": read}
    timed = {}
    for name, reader in readers.items():
        reader(array)  # warm: the first pass may still fault or fill TLBs
        samples = []
        for _ in range(repeats):
            start = clock()
            reader(array)
            samples.append(clock() - start)
        timed[name] = samples
    medians = {name: statistics.median(samples) for name, samples in timed.items()}
    kernel = min(medians, key=medians.__getitem__)
    samples, median = timed[kernel], medians[kernel]
    return {
        "gbps": nbytes / median / 1e9 if median > 0 else None,
        "best_gbps": nbytes / min(samples) / 1e9 if min(samples) > 0 else None,
        "median_s": median,
        "samples_s": samples,
        "array_bytes": nbytes,
        "kernel": kernel,
        "kernels": {name: nbytes / value / 1e9 if value > 0 else None for name, value in medians.items()},
    }


def measure_llc(
    sizes: Sequence[int] = LLC_SWEEP,
    *,
    bandwidth: Callable[[int], float] | None = None,
    speedup: float = CACHE_SPEEDUP,
    tail: int = MEMORY_TAIL,
    band: float = MEMORY_BAND,
) -> dict:
    """The last-level cache's size as reads see it, from read bandwidth against array size (``sizes``, bytes).

    Memory speed is the median bandwidth of the ``tail`` largest sizes (at most all but the smallest). The
    cache (``llc_bytes``) is the largest size before the tail that reads at least ``speedup`` x memory speed
    (None when none does): a slow reading at a smaller size (load) does not end it early, and a fast one in
    the tail (noise) does not stretch it. ``memory_from_bytes``: the smallest size from which every size
    reads under ``band`` x memory speed (the tail's first at the latest); between the two a working set is
    partly cached. ``bandwidth(size) -> GB/s``, default `read_bandwidth`'s median. Returns ``{"llc_bytes",
    "memory_from_bytes", "memory_gbps", "curve": [[size, gbps], ...], "settled", "rule"}``; ``settled`` is
    False when the tail's figures spread by more than 25% of memory speed (a noisy machine, or a sweep that
    does not reach memory speed).
    """
    sizes = sorted(set(sizes))
    if len(sizes) < 2:
        raise ValueError(f"sizes must hold at least two array sizes to compare, got {sizes!r}")
    if bandwidth is None:

        def bandwidth(size: int) -> float:
            return read_bandwidth(size)["gbps"]

    curve = [(size, bandwidth(size)) for size in sizes]
    tail_start = len(curve) - min(tail, len(curve) - 1)
    memory_tail = [gbps for _, gbps in curve[tail_start:]]
    memory = statistics.median(memory_tail)
    fast = [index for index in range(tail_start) if curve[index][1] >= speedup * memory]
    cache_end = fast[-1] if fast else None
    memory_from = tail_start  # the first size of a run, up to the tail, that reads under band x memory speed
    for index in range(tail_start - 1, -1 if cache_end is None else cache_end, -1):
        if curve[index][1] >= band * memory:
            break
        memory_from = index
    return {
        "llc_bytes": None if cache_end is None else curve[cache_end][0],
        "memory_from_bytes": curve[memory_from][0],
        "memory_gbps": memory,
        "curve": [list(point) for point in curve],
        "settled": max(memory_tail) - min(memory_tail) <= 0.25 * memory,
        "rule": f"the largest array before the sweep's {len(memory_tail)} largest that reads {speedup:g}x memory "
        f"speed (their median); memory speed from the first of the run of arrays under {band:g}x it; "
        f"{READ_KERNEL}",
    }


def limit_array_bytes(
    llc_bytes: int | None, factor: int = LLC_FACTOR, floor: int = LLC_SWEEP[-1], memory_from: int | None = None
) -> int:
    """The array the bandwidth is measured over: ``factor`` x where memory speed begins (``memory_from``, else
    the measured cache), and at least ``floor``."""
    start = memory_from or llc_bytes
    return max(floor, factor * start) if start else floor


def measure_read_limit(
    cpus: list[int] | None = None,
    *,
    sizes: Sequence[int] = LLC_SWEEP,
    repeats: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """The machine's side of the decode limit, in one run on the pinned ``cpus`` (None: as this process is):
    the last-level cache measured (`measure_llc`), then the read bandwidth over an array `LLC_FACTOR` x larger
    and no smaller than the sweep's largest (`limit_array_bytes`). Returns ``{"read_gbps", "read", "llc", "cpus"}``; divide a step's `step_bytes` by
    ``read_gbps`` (`decode_limit_s`)."""
    from .pinning import pin_current_process

    pinned = pin_current_process(cpus)
    llc = measure_llc(sizes, bandwidth=lambda size: read_bandwidth(size, repeats=repeats, clock=clock)["gbps"])
    array = limit_array_bytes(llc["llc_bytes"], floor=max(sizes), memory_from=llc["memory_from_bytes"])
    read = read_bandwidth(array, repeats=repeats, clock=clock)
    # The check that the array is past the cache: it reads under `CACHE_SPEEDUP` x the sweep's memory speed.
    read["at_memory_speed"] = read["gbps"] is not None and read["gbps"] < CACHE_SPEEDUP * llc["memory_gbps"]
    return {"read_gbps": read["gbps"], "read": read, "llc": llc, "cpus": pinned}
