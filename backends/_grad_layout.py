"""Gradients held in a library's parameter layout, mapped back to the canonical ``(out, in)`` layout.

An adapter loads the canonical parameters through a converter that only moves entries
(reshapes, transposes, splits into heads, packing into one matrix). The gradient of such a
move is the same move undone. Rather than write an inverse for every converter, this feeds
the converter the canonical *flat indices* (as float64 numbers, exact up to 2**53) and reads
off where each entry went; the gradient entries then go back to those indices, added up
where a converter used one entry twice (as a repeat of kv heads would).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, expected_param_shapes

from .base import tensor_to_numpy


def _leaves(tree, prefix: str = "") -> dict[str, object]:
    """Nested dicts (and lists/tuples) -> {"a/b/0": leaf}; None leaves are dropped."""
    if tree is None:
        return {}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, object] = {}
    for key, value in items:
        out.update(_leaves(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


def gradients_to_canonical(cfg: MHAConfig, to_native: Callable[[MHAParams], object], native_grads) -> dict:
    """Gradients in the layout ``to_native(params)`` produces -> canonical gradients by name.

    ``native_grads`` has the structure of ``to_native``'s result (nested dicts of arrays of
    any library); parameters absent from it (biases without bias) stay absent.
    """
    shapes = {name: shape for name, shape in expected_param_shapes(cfg).items() if shape is not None}
    sizes = {name: int(np.prod(shape)) for name, shape in shapes.items()}
    starts = dict(zip(shapes, np.cumsum([0, *sizes.values()])[:-1].tolist(), strict=True))
    index_params = MHAParams(
        **{
            name: np.arange(starts[name], starts[name] + sizes[name], dtype=np.float64).reshape(shape)
            for name, shape in shapes.items()
        }
    )
    where = _leaves(to_native(index_params))
    grads = _leaves(native_grads)
    flat = np.zeros(sum(sizes.values()))
    for key, index in where.items():
        grad = np.asarray(tensor_to_numpy(grads[key]), dtype=np.float64)
        np.add.at(flat, np.asarray(tensor_to_numpy(index)).astype(np.int64).ravel(), grad.ravel())
    return {name: flat[starts[name] : starts[name] + sizes[name]].reshape(shape) for name, shape in shapes.items()}
