"""Calling the candidate: each call in a daemon worker thread with a time limit, and its result made a NumPy array.

Why a thread: see `diagnosis` (Time limit). No non-daemon thread is ever started here, so an abandoned
call never keeps the interpreter from exiting.
"""

from __future__ import annotations

import threading

import numpy as np

from mha_rosetta.backends.base import tensor_to_numpy
from mha_rosetta.backends.frameworks import framework_of


class DiagnoseError(ValueError):
    """The candidate cannot be diagnosed (raised, timed out, wrong shape or dtype, NaN everywhere)."""


def _call(candidate, args: tuple, timeout: float, probe: str, announce=None):
    box: dict = {}
    if announce is not None:
        announce("call", probe)

    def work():
        try:
            box["result"] = result = candidate(*args)
            framework = framework_of(result)
            if framework is not None:  # computed here: MLX's lazy graph runs only on this thread's stream
                framework.synchronize(result)
        except BaseException as error:  # handed to the caller, which names the probe
            box["error"] = error

    worker = threading.Thread(target=work, name=f"diagnose probe {probe}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise DiagnoseError(
            f"the candidate did not return within {timeout:g} s on probe {probe!r} (time limit per probe)"
        )
    if announce is not None:
        announce("done", probe)
    if "error" in box:
        error = box["error"]
        raise DiagnoseError(f"the candidate raised {type(error).__name__}: {error} on probe {probe!r}") from error
    return box["result"]


def _as_output(
    result, expected_shape: tuple[int, ...], probe: str, axes: str = "(batch, q_tokens, d_model)"
) -> tuple[np.ndarray, str]:
    """The candidate's result as float64 NumPy, and the name of its dtype; clear errors otherwise (``axes``: the
    expected shape's axes in words)."""
    if isinstance(result, (tuple, list)):
        raise DiagnoseError(
            f"the candidate returned a {type(result).__name__} on probe {probe!r}; it must return the output array "
            f"{expected_shape} only (nn.MultiheadAttention returns (output, weights): return [0])"
        )
    dtype_name = str(getattr(result, "dtype", "")).replace("torch.", "")
    try:
        array = tensor_to_numpy(result)
    except Exception as error:
        raise DiagnoseError(
            f"the candidate returned {type(result).__name__} on probe {probe!r}, which is not an array "
            f"(NumPy, torch, JAX or MLX) of shape {expected_shape}: {error}"
        ) from error
    if array.dtype.kind != "f":
        raise DiagnoseError(
            f"the candidate returned dtype {array.dtype} on probe {probe!r}; expected floating point "
            f"(float64, float32, float16 or bfloat16) of shape {expected_shape}"
        )
    if array.shape != expected_shape:
        raise DiagnoseError(
            f"the candidate returned shape {array.shape} on probe {probe!r}; expected {expected_shape} {axes}"
        )
    dtype_name = "bfloat16" if "bfloat16" in dtype_name else array.dtype.name
    return array.astype(np.float64), dtype_name
