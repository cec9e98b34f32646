"""Reading, loading and running an mlx-lm attention instance: its rotary, its biases, its parameters, its own call.

Shared by every mlx-lm family of `mlx_lm` (the families and their layouts). MLX and mlx-lm are imported inside
the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mha_rosetta.core import MHAConfig

from ._errors import LayoutError
from ._module_io import class_name, unexpressible
from ._real import RealRun, state_shapes

FLOAT64_NOTE = (
    "MLX float64 (CPU): mx.exp, mx.sin and mx.cos are float32-accurate, so the output is about 4e-8 off the "
    "float64 oracle (backends/frameworks/mlx.py measures it): held to float32"
)
# The rope scalings whose module keeps what the spec needs; the others keep only their frequency table.
READ_SCALINGS = (None, "linear", "dynamic")


class RopeClasses:
    """The rotary classes mlx-lm's families hold (``initialize_rope``), by their exact import path."""

    ROPE = "mlx.nn.layers.positional_encoding.RoPE"
    DYNAMIC = "mlx_lm.models.rope_utils.DynamicNTKScalingRoPE"
    FREQUENCIES_ONLY = tuple(
        f"mlx_lm.models.rope_utils.{name}" for name in ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
    )
    ALL = (ROPE, DYNAMIC, *FREQUENCIES_ONLY)


def mlx_rope(module) -> dict:
    """The MHAConfig rotary fields of ``module.rope`` (`nn.RoPE` or `DynamicNTKScalingRoPE`), or LayoutError."""
    rope = module.rope
    kind = f"{type(rope).__module__}.{type(rope).__qualname__}"  # the exact class: a subclass may compute otherwise
    if kind not in RopeClasses.ALL:
        raise unexpressible(module, f"rope {kind}", f"the reader reads the classes {', '.join(RopeClasses.ALL)} only")
    style = "interleaved" if rope.traditional else "half"
    if kind == RopeClasses.ROPE:
        scaling = None if rope.scale == 1.0 else {"rope_type": "linear", "factor": 1.0 / rope.scale}
        return dict(rope=style, rope_dims=rope.dims, rope_base=float(rope.base), rope_scaling=scaling)
    if kind == RopeClasses.DYNAMIC:
        scaling = {
            "rope_type": "dynamic",
            "factor": float(rope.factor),
            "original_max_position_embeddings": rope.max_position_embeddings,
        }
        return dict(rope=style, rope_dims=rope.dims, rope_base=float(rope.base), rope_scaling=scaling)
    raise unexpressible(
        module,
        f"rope {kind}",
        "it keeps only its frequency table (_freqs), not the scaling config it was built from; "
        "the spec reads linear (nn.RoPE scale) and dynamic NTK (DynamicNTKScalingRoPE) from mlx-lm",
    )


def mlx_bias(module, query: str = "q_proj") -> bool | str:
    """MHAConfig.bias from which linears hold a ``bias`` parameter (True, False or "qkv")."""
    qkv, out = "bias" in getattr(module, query), "bias" in module.o_proj
    if out and not qkv:
        raise unexpressible(module, "a bias on o_proj only", "the spec biases q, k, v and the output, or q, k, v only")
    return "qkv" if qkv and not out else qkv


def mlx_state(module, names) -> dict[str, np.ndarray]:
    """The module's parameters named ``names`` (``"q_proj.weight"``...), as NumPy copies."""
    from mlx.utils import tree_flatten

    flat = dict(tree_flatten(module.parameters()))
    return {name: np.array(flat[name], copy=True) for name in names}


def load_mlx(module, state: Mapping[str, np.ndarray]):
    """Each array into the parameter of that name, in the parameter's dtype (float64 needs it said); the module."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    flat = dict(tree_flatten(module.parameters()))
    pairs = []
    for name, array in state.items():
        target = flat[name]
        if tuple(target.shape) != tuple(np.shape(array)):
            raise LayoutError(
                f"{class_name(module)}.{name} has shape {tuple(target.shape)}, the state dict {np.shape(array)}"
            )
        pairs.append((name, mx.array(np.asarray(array), dtype=target.dtype)))
    module.update(tree_unflatten(pairs))
    return module


def mlx_forward(layout: str, module, cfg: MHAConfig, x, padding, array_mask: bool = False) -> RealRun:
    """mlx-lm's own call, ``module(x, mask=create_attention_mask(x, None, return_array=array_mask))`` (``"causal"``
    or the boolean causal array, as the family's model passes it) on the CPU stream; held to its dtype's level."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    if padding is not None:
        raise ValueError(
            f"{layout}: mlx-lm's models take a padding only through a batched cache (left_padding); padding=None here"
        )
    dtype = module.o_proj.weight.dtype
    with mx.stream(mx.cpu):
        h = mx.array(np.asarray(x), dtype=dtype)
        output = module(h, mask=create_attention_mask(h, None, return_array=array_mask))
        mx.eval(output)
    name = str(dtype).removeprefix("mlx.core.")
    run = RealRun(
        layout,
        "real",
        f"mlx-lm {type(module).__module__}.{type(module).__qualname__} (its model's causal mask)",
        np.array(output).astype(np.float64),
    )
    run.parameters = state_shapes(mlx_state(module, [n for n in _names(module)]))
    run.precision = "float32" if name == "float64" else name
    run.note = FLOAT64_NOTE if name == "float64" else f"the module holds {name} parameters"
    return run


def _names(module) -> list[str]:
    from mlx.utils import tree_flatten

    return [str(pair[0]) for pair in tree_flatten(module.parameters())]  # (name, array) pairs


def scaling_read(module: str):
    """The rope scalings the reader reads back (`READ_SCALINGS`): the others' modules keep only ``_freqs``."""

    def rule(cfg: MHAConfig) -> str | None:
        kind = None if cfg.rope_scaling is None else cfg.rope_scaling["rope_type"]
        if kind not in READ_SCALINGS:
            return f"MHAConfig.rope_scaling type {kind!r}: {module}'s rope keeps only its frequency table (_freqs)"
        return None

    return rule


def qk_norm_fields(module, over: str) -> dict:
    eps = (module.q_norm.eps, module.k_norm.eps)
    if eps[0] != eps[1]:
        raise unexpressible(module, f"q_norm eps {eps[0]} and k_norm eps {eps[1]}", "the spec has one norm_eps")
    return {"qk_norm": over, "norm_eps": float(eps[0])}
