"""Reading, loading and running an mlx-lm attention instance: its rotary, its biases, its parameters, its own call.

Shared by every mlx-lm family of `mlx_lm` (the families and their layouts). MLX and mlx-lm are imported inside
the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, tolerance_for
from mha_rosetta.core._rope_checks import is_real
from mha_rosetta.core.rope_scaling import describe_rope_scaling, scaled_frequencies, validate_rope_scaling

from ._errors import LayoutError
from ._module_io import ModuleReader, class_name, unexpressible
from ._real import RealRun, state_shapes

FLOAT64_NOTE = (
    "MLX float64 (CPU): mx.exp, mx.sin and mx.cos are float32-accurate, so the output is about 4e-8 off the "
    "float64 oracle (backends/frameworks/mlx.py measures it): held to float32"
)
# The rope scalings the reader reads: nn.RoPE and DynamicNTKScalingRoPE keep their settings; Llama3RoPE, YarnRoPE and
# SuScaledRoPE keep only their frequency table, read from the model args and proved on that table (`_table_rope`,
# `_longrope`). longrope is built by Phi-3's family only (`mlx_lm.PHI3_FAMILY`: phi3.ModelArgs takes no other).
READ_SCALINGS = (None, "linear", "dynamic", "llama3", "yarn")
LONGROPE_SCALINGS = (None, "longrope")
# What mlx-lm's classes use where the model args' rope_scaling leaves a key out (rope_utils.Llama3RoPE, YarnRoPE):
# the keys the spec requires, filled as the module was built.
MLX_SCALING_DEFAULTS: dict[str, dict[str, float]] = {
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"original_max_position_embeddings": 4096},
}
# initialize_rope's other names for YaRN (rope_utils.initialize_rope builds YarnRoPE for each)
MLX_YARN_NAMES = ("yarn", "deepseek_yarn", "telechat3-yarn")


class RopeClasses:
    """The rotary classes mlx-lm's families hold (``initialize_rope``), by their exact import path."""

    ROPE = "mlx.nn.layers.positional_encoding.RoPE"
    DYNAMIC = "mlx_lm.models.rope_utils.DynamicNTKScalingRoPE"
    # frequency table only; the rope_type the table is read as (from the model args, proved on the table)
    TABLES: ClassVar[dict[str, str]] = {
        "mlx_lm.models.rope_utils.Llama3RoPE": "llama3",
        "mlx_lm.models.rope_utils.YarnRoPE": "yarn",
    }
    LONGROPE = "mlx_lm.models.rope_utils.SuScaledRoPE"
    FREQUENCIES_ONLY = ("mlx_lm.models.rope_utils.ProportionalRoPE",)
    ALL = (ROPE, DYNAMIC, *TABLES, LONGROPE, *FREQUENCIES_ONLY)


def mlx_rope(module) -> dict:
    """The MHAConfig rotary fields of ``module.rope`` (`nn.RoPE`, `DynamicNTKScalingRoPE`, and `Llama3RoPE` or
    `YarnRoPE` with the model args), or LayoutError."""
    rope = module.rope
    kind = f"{type(rope).__module__}.{type(rope).__qualname__}"  # the exact class: a subclass may compute otherwise
    if kind not in RopeClasses.ALL:
        raise unexpressible(module, f"rope {kind}", f"the reader reads the classes {', '.join(RopeClasses.ALL)} only")
    if kind in RopeClasses.FREQUENCIES_ONLY:
        raise unexpressible(
            module,
            f"rope {kind}",
            "it keeps only its frequency table (_freqs) of the pairs that turn, not partial_rotary_factor "
            "(proportional is read from Hugging Face only)",
        )
    if kind == RopeClasses.LONGROPE:
        return _longrope(module)
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
    base, scaling = _table_rope(module, kind, RopeClasses.TABLES[kind])
    return dict(rope=style, rope_dims=rope.dims, rope_base=base, rope_scaling=scaling)


def model_args(module):
    """The model args the instance keeps: ``args`` (Llama 4's attention; a port's ``attention.args = model.args``)
    or ``config`` (DeepSeek V3's), when they hold ``rope_theta``; else None."""
    for name in ("args", "config"):
        args = getattr(module, name, None)
        if args is not None and hasattr(args, "rope_theta"):
            return args
    return None


def mlx_scaling_dict(raw: Mapping, rope_type: str) -> dict:
    """The Hugging Face form of the ``rope_scaling`` mlx-lm built ``rope_type``'s class from: its type named as the
    spec names it, mlx-lm's defaults for the keys it leaves out (`MLX_SCALING_DEFAULTS`), the None keys dropped."""
    given = {key: value for key, value in raw.items() if value is not None and key != "type"}
    return {**MLX_SCALING_DEFAULTS[rope_type], **given, "rope_type": rope_type}


def _table_rope(module, kind: str, rope_type: str) -> tuple[float, dict]:
    """``(rope_base, rope_scaling)`` of a `Llama3RoPE`/`YarnRoPE`, from the model args, proved on the module's table.

    The table is ``_freqs``: ``mx.fast.rope(freqs=...)`` turns pair i by ``position / _freqs[i]``, so the spec's
    ``inv_freq`` is ``1 / _freqs``; it must equal `scaled_frequencies` of the dict to float32's relative tolerance
    (mlx-lm computes it in float32), and YarnRoPE's ``mscale`` (on the rotated features) YaRN's attention factor.
    """
    rope, args = module.rope, _args_or_refuse(module, kind)
    setting = f"rope {kind}"
    raw = getattr(args, "rope_scaling", None) or {}
    named = raw.get("rope_type", raw.get("type"))
    if named not in (MLX_YARN_NAMES if rope_type == "yarn" else (rope_type,)):
        raise unexpressible(module, setting, f"its model args' rope_scaling is {dict(raw)!r}, not a {rope_type} one")
    base = float(args.rope_theta)
    try:
        scaling = validate_rope_scaling(mlx_scaling_dict(raw, rope_type))
        expected, attention = scaled_frequencies(rope.dims, base, scaling, 1)
    except (TypeError, ValueError) as error:
        raise unexpressible(module, f"{setting} built from rope_scaling {dict(raw)!r}", str(error)) from error
    assert scaling is not None  # a dict of rope_type's
    table = 1.0 / np.array(rope._freqs, dtype=np.float64)  # (r/2,): the turn per position of each pair
    factor = float(getattr(rope, "mscale", 1.0))  # YarnRoPE: x[..., :dims] * mscale, i.e. cos and sin * mscale
    rtol = tolerance_for("float32").rtol
    worst = float(np.max(np.abs(table - expected) / expected))
    if worst > rtol or not math.isclose(factor, attention, rel_tol=1e-12):
        raise unexpressible(
            module,
            f"{setting} whose table is not {describe_rope_scaling(scaling)} with base {base:g}",
            f"1/_freqs is {worst:.2g} off the spec's scaled_frequencies (relative; float32 allows {rtol:g}) and its "
            f"factor on the rotated features is {factor:.6g}, the spec's {attention:.6g} (mlx-lm's YarnRoPE reads "
            "neither attention_factor nor truncate=False; Gemma 3's local layers turn at rope_local_base_freq)",
        )
    return base, scaling


def _args_or_refuse(module, kind: str):
    """The model args (`model_args`) a table-only rope is read from, or LayoutError saying how to give them."""
    args = model_args(module)
    if args is None:
        raise unexpressible(
            module,
            f"rope {kind}",
            "it keeps only its frequency table (_freqs), not the scaling config it was built from, and the instance "
            "keeps no model args to read it from: give it its model's (attention.args = model.args; mlx-lm's Model "
            "keeps them as model.args) and the reader recovers rope_scaling and proves it on the table",
        )
    return args


def _longrope(module) -> dict:
    """The rotary fields of a `SuScaledRoPE`: longrope with ``short_factor = long_factor`` (it turns by the long table
    at every length), ``factor = max_position_embeddings / original_max_position_embeddings`` of the model args, and
    ``attention_factor`` its ``_scale`` where that is not the factor's (a ``long_mscale``); proved on ``_freqs``."""
    rope, args = module.rope, _args_or_refuse(module, RopeClasses.LONGROPE)
    raw = getattr(args, "rope_scaling", None) or {}
    setting = f"rope {RopeClasses.LONGROPE}"
    if raw.get("type", raw.get("rope_type")) not in ("longrope", "su"):
        raise unexpressible(module, setting, f"its model args' rope_scaling is {dict(raw)!r}, not a longrope one")
    base, original = float(args.rope_theta), int(rope.original_max_position_embeddings)
    long = raw.get("long_factor", 1.0)
    long = [float(long)] * (rope.dim // 2) if is_real(long) else list(long)  # SuScaledRoPE takes a number too
    scaling = {
        "rope_type": "longrope",
        "short_factor": long,  # the table it turns by below original_max_position_embeddings too
        "long_factor": long,
        "original_max_position_embeddings": original,
        "factor": args.max_position_embeddings / original,
    }
    try:
        expected, attention = scaled_frequencies(rope.dim, base, scaling, original + 1)
    except (TypeError, ValueError) as error:
        raise unexpressible(module, f"{setting} built from rope_scaling {dict(raw)!r}", str(error)) from error
    table = 1.0 / np.array(rope._freqs, dtype=np.float64)  # (r/2,): mx.fast.rope(freqs=...) turns by position / _freqs
    rtol = tolerance_for("float32").rtol
    worst = float(np.max(np.abs(table - expected) / expected))
    if worst > rtol:
        raise unexpressible(
            module,
            f"{setting} whose table is not long_factor * base ** (2i / dims) with base {base:g}",
            f"1/_freqs is {worst:.2g} off the spec's longrope frequencies (relative; float32 allows {rtol:g})",
        )
    if not math.isclose(float(rope._scale), attention, rel_tol=1e-12):  # built with a long_mscale
        raise unexpressible(
            module,
            f"{setting} whose factor on the rotated features is {float(rope._scale):.6g}",
            f"its model args give sqrt(1 + ln(max_position_embeddings / original) / ln(original)) = {attention:.6g}; "
            "a long_mscale, which mlx-lm's Phi-3 never passes and this layout cannot build",
        )
    return dict(rope="half", rope_dims=rope.dim, rope_base=base, rope_scaling=validate_rope_scaling(scaling))


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


def mlx_reader(module: str, config, shapes, forward) -> ModuleReader:
    """The `ModuleReader` of one mlx-lm class: ``config(module)``, its parameters read and loaded by their names
    (``shapes(cfg)``'s keys: `mlx_state`, `load_mlx`), ``forward`` its own call."""
    return ModuleReader(
        classes=(module,),
        config=config,
        state=lambda instance, cfg: mlx_state(instance, shapes(cfg)),
        load=load_mlx,
        forward=forward,
    )


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


def mlx_forward(layout: str, module, cfg: MHAConfig, x, padding, array_mask: bool = False, mask=None) -> RealRun:
    """mlx-lm's own call, ``module(x, mask=create_attention_mask(x, None, return_array=array_mask))`` (``"causal"``
    or the boolean causal array, as the family's model passes it; ``mask``: the boolean (N, N) array the model
    builds itself, Llama 4's chunks) on the CPU stream; held to its dtype's level."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    if padding is not None:
        raise ValueError(
            f"{layout}: mlx-lm's models take a padding only through a batched cache (left_padding); padding=None here"
        )
    dtype = module.o_proj.weight.dtype
    with mx.stream(mx.cpu):
        h = mx.array(np.asarray(x), dtype=dtype)
        allowed = create_attention_mask(h, None, return_array=array_mask) if mask is None else mx.array(mask)
        output = module(h, mask=allowed)
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


def scaling_read(module: str, scalings: tuple = READ_SCALINGS):
    """The rope scalings the family builds and the reader reads back (``scalings``), as mlx-lm's classes compute them."""

    def rule(cfg: MHAConfig) -> str | None:
        scaling = cfg.rope_scaling
        kind = None if scaling is None else scaling["rope_type"]
        if kind not in scalings:
            return (
                f"MHAConfig.rope_scaling type {kind!r}: {module} is built and read with "
                f"{', '.join(map(repr, scalings[1:]))} scaling only"
            )
        if kind == "longrope" and scaling is not None:
            return _longrope_rule(module, scaling)
        if (
            kind == "yarn"
            and scaling is not None
            and (scaling["attention_factor"] is not None or not scaling["truncate"])
        ):
            return (
                f"MHAConfig.rope_scaling {describe_rope_scaling(scaling)}: mlx-lm's YarnRoPE reads no "
                "attention_factor and always truncates the correction range to whole pairs"
            )
        return None

    return rule


def _longrope_rule(module: str, scaling: dict) -> str | None:
    """What SuScaledRoPE cannot compute: another short table, an attention_factor, a length that is not whole."""
    if scaling["short_factor"] != scaling["long_factor"]:
        return (
            f"MHAConfig.rope_scaling {describe_rope_scaling(scaling)}: {module}'s SuScaledRoPE turns by long_factor "
            "at every length (short_factor is taken and never used), so short_factor must equal long_factor"
        )
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    if scaling["attention_factor"] is not None or factor is None or not float(factor * original).is_integer():
        return (
            f"MHAConfig.rope_scaling {describe_rope_scaling(scaling)}: {module}'s SuScaledRoPE reads no "
            "attention_factor; its factor on cos and sin comes from max_position_embeddings (an int) / "
            "original_max_position_embeddings, so factor * original_max_position_embeddings must be a whole number"
        )
    return None


def qk_norm_fields(module, over: str) -> dict:
    eps = (module.q_norm.eps, module.k_norm.eps)
    if eps[0] != eps[1]:
        raise unexpressible(module, f"q_norm eps {eps[0]} and k_norm eps {eps[1]}", "the spec has one norm_eps")
    return {"qk_norm": over, "norm_eps": float(eps[0])}
