"""How much memory an implementation needs: what it keeps between calls plus one call's peak.

A cell measures memory in two untimed pieces, so that tracing costs no time in the figures:

* **held**: what the process holds after ``prepare`` and the timed calls, above what it held
  just before ``prepare`` (converted inputs and parameters, workspaces an adapter keeps
  between calls, such as the NumPy and torch adapters' reused score buffers, and what the
  framework caches);
* **call**: the peak of one more call above the state just before it (its temporaries and
  its output).

``peak_mem_mb = held + call``. Two ways of counting, by the arrays an implementation uses:

* NumPy arrays: `tracemalloc`, on during ``prepare`` and the extra call only. NumPy reports
  every buffer it allocates to it, so the figures are exact byte counts, whatever the C
  allocator does with freed memory (a buffer allocated with ``np.empty`` counts at once,
  though its pages are touched later).
* Everything else (torch, XLA on a CPU): the resident set. ``held`` is its growth, and
  ``call`` the rise of the kernel's high-water mark (``VmHWM``), reset just before the call
  (``/proc/self/clear_refs``, Linux). Each reading follows ``malloc_trim``, which returns
  the allocator's free memory to the system: the benchmark keeps freed memory inside the
  process (`pinning.malloc_env`), and without the trim a call would reuse those pages and
  show no growth at all. Where the mark cannot be reset (not Linux) there is no figure.
* On a GPU the cell reports the framework's own peak allocation instead (`cell._gpu_peak_mb`).

Before this module the cell reported only the growth of ``ru_maxrss`` from before
``prepare``: an earlier, larger transient (imports, making the inputs) hid every working set
smaller than it, so NumPy cells up to 4k tokens read 0.0 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import sys
import tracemalloc
from collections.abc import Callable

CLEAR_REFS = "/proc/self/clear_refs"
# Writing "5" to clear_refs resets the peak resident set (VmHWM) to the current one (Linux >= 4.0).
RESET_PEAK = "5"


def proc_mb(path: str, field: str) -> float | None:
    """A ``kB`` field of a /proc file (Linux), in MiB; None where there is none."""
    try:
        with open(path, encoding="ascii") as proc:
            match = re.search(rf"^{field}:\s+(\d+) kB", proc.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


def status_mb(field: str, pid: int | str = "self") -> float | None:
    """A field of /proc/PID/status (VmRSS, VmHWM), in MiB; None where there is none."""
    return proc_mb(f"/proc/{pid}/status", field)


def _malloc_trim() -> bool:
    """Return the C allocator's free memory to the system (glibc); False where there is no malloc_trim."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.malloc_trim(0) >= 0)
    except (OSError, AttributeError):
        return False


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's resident set; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(CLEAR_REFS, "w", encoding="ascii") as clear_refs:
            clear_refs.write(RESET_PEAK)
    except OSError:
        return False
    return status_mb("VmHWM") is not None


def is_numpy_array(value) -> bool:
    """A NumPy array (or a list, tuple or dict whose first item is one): what tracemalloc can see."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    # A NumPy branch by nature, not a framework switch: tracemalloc sees NumPy's allocations only.
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _settled_rss_mb() -> float | None:
    """The resident set after a garbage collection and a trim: what the process really holds."""
    gc.collect()
    _malloc_trim()
    return status_mb("VmRSS")


class MemoryProbe:
    """Counts a cell's memory: `before_prepare`, `after_prepare`, then `call` (see the module)."""

    def __init__(self) -> None:
        self.rss_base: float | None = None
        self.traced_held_mb: float | None = None

    def before_prepare(self) -> None:
        self.rss_base = _settled_rss_mb()
        tracemalloc.start()

    def after_prepare(self) -> None:
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.traced_held_mb = current / 2**20

    def call(self, call: Callable[[], object]) -> tuple[object, dict]:
        """Run ``call`` once; return its result and the memory fields of the cell record."""
        rss_before = _settled_rss_mb()
        can_reset = reset_peak_rss()
        tracemalloc.start()
        try:
            result = call()
            _, traced_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        hwm = status_mb("VmHWM")
        rss_held = rss_call = None
        if None not in (self.rss_base, rss_before):
            rss_held = max(0.0, rss_before - self.rss_base)
            if can_reset and hwm is not None:
                rss_call = max(0.0, hwm - rss_before)
        fields = {
            "held_rss_mb": rss_held,
            "call_rss_peak_mb": rss_call,
            "held_traced_mb": None,
            "call_traced_peak_mb": None,
        }
        if is_numpy_array(result):
            # tracemalloc sees NumPy's buffers (not what torch or XLA allocate in C): only used for NumPy.
            fields.update(held_traced_mb=self.traced_held_mb, call_traced_peak_mb=traced_peak / 2**20)
            peak, method = self.traced_held_mb + traced_peak / 2**20, "tracemalloc"
        elif rss_held is not None and rss_call is not None:
            peak, method = rss_held + rss_call, "rss-high-water"
        else:
            peak, method = None, None
        return result, {"peak_mem_mb": peak, "peak_mem_method": method, **fields}
