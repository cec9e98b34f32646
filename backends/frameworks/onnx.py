"""ONNX Runtime in the framework layer: a runtime whose arrays are NumPy's.

How it fits, and why: ``InferenceSession.run`` takes and returns NumPy arrays, so ONNX has no
array type of its own to recognise, convert, copy or stride (`owns` is always False and every
array question is answered by `NumpyFramework`). What it does have is a runtime with its own
thread pools, set per session and not per process: ``SessionOptions.intra_op_num_threads``
and ``inter_op_num_threads``. `configure_threads` (called in a pinned benchmark child before
anything runs, `benchmarks.pinning.configure_frameworks`) records the count here, and every
session the ONNX backends make afterwards reads it (`session_options`), so the benchmark's
pinning reaches ORT's pools; the harness then checks the child's CPU time over wall time as
for every library. The GEMM peak and the copy bandwidth stay NumPy's (same arrays, same BLAS
family on this CPU); ORT's CUDA provider is not driven here (`drives_gpu` False: no CUDA build
is installed, and its causal alignment differs: see docs/onnx.md, ORT #29020).
"""

from __future__ import annotations

from .interface import Framework

# Threads every new session gets; None: ORT's defaults (one per core). Set by `configure_threads`.
_SESSION_THREADS: dict[str, int | None] = {"threads": None}


class OnnxRuntimeFramework(Framework):
    name = "onnxruntime"
    modules = ()  # its inputs and outputs are NumPy arrays: no array type of its own
    startup_s = 1.0  # import onnxruntime + onnx and build a session, roughly, on the 2-core machine
    layout_unknown = "n/a: ONNX Runtime takes and returns NumPy arrays"
    array_module = "numpy"  # the arrays a session takes and returns

    def owns(self, value) -> bool:
        return False

    def configure_threads(self, threads: int) -> dict:
        _SESSION_THREADS["threads"] = int(threads)
        return {"onnxruntime.intra_op_num_threads": int(threads), "onnxruntime.inter_op_num_threads": 1}


def session_threads() -> int | None:
    """The thread count a benchmark child pinned (`OnnxRuntimeFramework.configure_threads`), or None."""
    return _SESSION_THREADS["threads"]


def session_options(threads: int | None = None):
    """``onnxruntime.SessionOptions`` with both pools pinned to ``threads`` (default: the configured count);
    sequential execution, so that inter-op parallelism adds no thread of its own."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    threads = session_threads() if threads is None else threads
    if threads is not None:
        options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-wait on idle threads
    return options
