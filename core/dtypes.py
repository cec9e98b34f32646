"""Dtype names shared by every backend: ``float64``, ``float32``, ``float16``, ``bfloat16``.

NumPy has no bfloat16 of its own; ``ml_dtypes`` provides one. It is a dependency of this
package (small, NumPy only, and JAX needs it anyway), so every install can check bfloat16;
it is imported only when bfloat16 is asked for, so importing core loads NumPy alone.
"""

from __future__ import annotations

import numpy as np

DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")


def check_dtype_name(dtype: object) -> str:
    """Return ``dtype`` as one of DTYPE_NAMES, or raise naming the accepted values.

    Accepts a name (``"float32"``) or anything ``numpy.dtype`` understands
    (``np.float32``, ``ml_dtypes.bfloat16``).
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            # Any object on purpose: NumPy raises TypeError for what it does not know (caught below).
            name = np.dtype(dtype).name  # type: ignore[call-overload]
        except TypeError:
            name = None
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    return name


def numpy_dtype(dtype: object) -> np.dtype:
    """The NumPy dtype for a dtype name (bfloat16 through ml_dtypes)."""
    name = check_dtype_name(dtype)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as error:
            raise ImportError(
                "bfloat16 on NumPy arrays needs ml_dtypes, a dependency of mha-rosetta that is missing here "
                "(installed with --no-deps?): pip install ml_dtypes"
            ) from error
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
