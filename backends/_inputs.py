"""Converting the three input arrays once each, the way every adapter's `prepare` does."""

from __future__ import annotations

from collections.abc import Callable

from mha_rosetta.core import MHAInputs


def convert_inputs(inputs: MHAInputs, convert: Callable) -> tuple:
    """(x_q, x_k, x_v) as ``convert`` makes them, converting each distinct array once.

    Self-attention passes one array as query, key and value; it stays one converted
    array, as a caller's code would have it (torch's fast path checks that identity,
    and a device copy made three times would be memory spent for nothing).
    """
    x_q = convert(inputs.query)
    x_k = x_q if inputs.key is inputs.query else convert(inputs.key)
    x_v = x_k if inputs.value is inputs.key else convert(inputs.value)
    return x_q, x_k, x_v
