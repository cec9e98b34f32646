"""`Layout`: one checkpoint family's weight layout, tied to the canonical `MHAParams`.

A catalogue, over 400 lines on purpose: the rules a real module sets on a configuration and the
packings of its tensors, which every family's layout (`models/hf_*.py` and the others) picks from.

A layout knows four things about a family, and nothing about its framework:

* which configurations its real module can hold (`Layout.unsupported_reason`): the
  variants of 2024-26 attention it has (`Layout.variants`, names of `core.config.VARIANTS`;
  any other is refused), then its rules; a rule that fails names the ``MHAConfig`` field,
  the value and why the module cannot hold it;
* the name and shape of every tensor the real module stores (`Layout.expected_shapes`),
  keyed by the module's own parameter names, relative to the module named in
  `Layout.module`;
* how to pack canonical parameters into those tensors, and how to unpack them again:
  NumPy reshapes, transposes and concatenations only, so the round trip is exact.

`to_state_dict` and `from_state_dict` wrap the family's pack/unpack with the checks every
family shares: the configuration is one the module can hold, the parameters fit the
configuration, and a state dict has exactly the expected names with the expected shapes
(a missing, extra or wrong-shape entry is an error naming the layout and the key).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAParams,
    expected_param_shapes,
    from_flax_params,
    from_row_sample,
    to_flax_params,
    to_row_sample,
    validate_params,
)
from mha_rosetta.core.config import require_config
from mha_rosetta.core.layouts import _to_numpy  # torch tensors and JAX/Keras arrays -> NumPy, no framework import
from mha_rosetta.core.variants import param_spec, variant

from ._errors import LayoutError
from ._module_io import ModuleReader

# Packing of q, k and v in the stored tensors: the three ways users confuse.
SEPARATE = "separate"  # one tensor each for q, k and v
BLOCKS = "blocks"  # one tensor, [Q; K; V]: every q row, then every k row, then every v row
PER_HEAD = "per head"  # one tensor, [q_0; k_0; v_0; q_1; k_1; v_1; ...]
PER_GROUP = "per group"  # one tensor, per kv group g: [q heads of group g; k_g; v_g]
PACKINGS = (SEPARATE, BLOCKS, PER_HEAD, PER_GROUP)


Rule = Callable[[MHAConfig], "str | None"]


@dataclass(frozen=True)
class Layout:
    """One family's layout. Build with the family's rules, shapes and pack/unpack functions."""

    name: str
    module: str  # the real module whose parameter names key the state dict
    description: str
    packing: str  # one of PACKINGS
    scale: str  # the module's score scale, in words
    rotary: str  # the module's rotary convention, in words
    source: str  # where the real module lives
    split: str  # how the real module splits its stored tensors into heads, from its source
    rules: tuple[Rule, ...]
    shapes: Callable[[MHAConfig], dict[str, tuple[int, ...]]]
    pack: Callable[[MHAConfig, MHAParams], dict[str, np.ndarray]]
    unpack: Callable[[MHAConfig, dict[str, np.ndarray]], MHAParams]
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The family's real module: runner(cfg, state, x, padding, options) -> RealRun builds it tiny and runs it
    # (`real_modules.run_real`); None where models has none (the library oracles run through their backends).
    runner: Callable | None = None
    requires: tuple[str, ...] = ()  # the libraries the runner imports
    hf_options: bool = False  # the runner takes Hugging Face's implementation / float64_rotary options
    # How `from_module` / `to_module` read and load the family's real module instance (`_module_io`); None: no reader.
    reader: ModuleReader | None = None
    # A small configuration the real module holds, for the explainer's pictures (MHAConfig keyword arguments).
    example: Mapping = field(default_factory=dict, hash=False)
    # The `core.config.VARIANTS` the real module has (a window, QK-norm, sinks...); cfg.variants outside it is refused.
    variants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # The hook a layout reads a variant by: its registry entry (`core.variants`); a name that is none
        # (a typo, a variant not yet registered) is a KeyError naming the registry's variants.
        for name in self.variants:
            variant(name)

    def unsupported_reason(self, cfg: MHAConfig) -> str | None:
        """Why this family's real module cannot hold ``cfg`` (a variant it lacks, or the first rule that fails), or None."""
        require_config(cfg)
        lacking = [name for name in cfg.variants if name not in self.variants]
        if lacking:
            has = f"it has {', '.join(self.variants)} only" if self.variants else "it has none of the 2024-26 variants"
            return f"MHAConfig switches on {', '.join(lacking)}: {self.module} does not ({has})"
        for rule in self.rules:
            reason = rule(cfg)
            if reason:
                return reason
        return None

    def require(self, cfg: MHAConfig) -> None:
        reason = self.unsupported_reason(cfg)
        if reason:
            raise LayoutError(f"layout {self.name!r} cannot express {cfg.describe()}: {reason}")

    def expected_shapes(self, cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the real module stores for ``cfg``."""
        self.require(cfg)
        return self.shapes(cfg)

    def to_state_dict(self, cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
        """Canonical params -> this family's state dict (NumPy arrays, new memory, exact)."""
        self.require(cfg)
        validate_params(cfg, params)
        state = {name: np.ascontiguousarray(array) for name, array in self.pack(cfg, params).items()}
        _check_names_and_shapes(self.name, self.shapes(cfg), state)  # the family's own promise
        return state

    def from_state_dict(self, cfg: MHAConfig, state_dict: Mapping) -> MHAParams:
        """This family's state dict (NumPy, torch or JAX values) -> canonical params, exactly."""
        self.require(cfg)
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"layout {self.name!r}: state_dict must be a mapping of name -> array, got {type(state_dict).__name__}"
            )
        arrays = {name: _to_numpy(value) for name, value in state_dict.items()}
        _check_names_and_shapes(self.name, self.shapes(cfg), arrays)
        for name, array in arrays.items():
            if array.dtype.kind != "f":
                raise LayoutError(
                    f"layout {self.name!r}: {name} must hold floating-point numbers, got dtype {array.dtype}"
                )
        params = self.unpack(cfg, arrays)
        validate_params(cfg, params)
        return params


def _check_names_and_shapes(layout: str, expected: dict[str, tuple[int, ...]], state: Mapping) -> None:
    missing = [name for name in expected if name not in state]
    extra = [name for name in state if name not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if extra:
            parts.append(f"unexpected {', '.join(map(str, extra))}")
        raise LayoutError(
            f"layout {layout!r}: state dict does not match: {'; '.join(parts)} (expected keys: {', '.join(expected)})"
        )
    for name, shape in expected.items():
        actual = tuple(np.shape(state[name]))
        if actual != tuple(shape):
            raise LayoutError(f"layout {layout!r}: {name} has shape {actual}, expected {tuple(shape)}")


# --- rules: each returns None when the module can hold cfg, else the reason naming the field ---


def no_grouped_kv(module: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        if cfg.n_kv_heads != cfg.n_heads:
            return f"MHAConfig.n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads}: {module} has no grouped kv heads"
        return None

    return rule


def head_dim_is_width_over_heads(module: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        if cfg.d_k * cfg.n_heads != cfg.d_model:
            return f"MHAConfig.d_k={cfg.d_k}: {module} fixes d_k = d_model / n_heads = {cfg.d_model / cfg.n_heads:g}"
        return None

    return rule


def same_head_dims(module: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        if cfg.d_v != cfg.d_k:
            return f"MHAConfig.d_v={cfg.d_v} != d_k={cfg.d_k}: {module} uses one head size for q, k and v"
        return None

    return rule


def self_attention_widths(module: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        if not cfg.is_self_attention_shaped:
            return f"MHAConfig.kdim={cfg.kdim}, vdim={cfg.vdim}: {module} projects keys and values from d_model={cfg.d_model} inputs"
        return None

    return rule


def self_attention_heads(module: str) -> tuple[Rule, ...]:
    """The rules of every self-attention module here: q, k and v heads of one size, keys and values from d_model."""
    return (same_head_dims(module), self_attention_widths(module))


def classic_heads(module: str) -> tuple[Rule, ...]:
    """The rules of a module built like ``nn.MultiheadAttention``: H heads of d_model / H, no grouping, self-attention."""
    return (no_grouped_kv(module), head_dim_is_width_over_heads(module), *self_attention_heads(module))


def bias_is(value: bool, why: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        if cfg.bias != value:
            return f"MHAConfig.bias={cfg.bias}: {why}"
        return None

    return rule


def default_scale(module: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        default = cfg.d_k**-0.5
        if abs(cfg.scale - default) > 1e-12 * default:
            return f"MHAConfig.scale={cfg.scale:g}: {module} scales scores by 1/sqrt(d_k) = {default:g}"
        return None

    return rule


def unit_scale(module: str) -> Rule:
    def rule(cfg: MHAConfig) -> str | None:
        if cfg.scale != 1.0:
            return f"MHAConfig.scale={cfg.scale:g}: {module} does not scale scores (scale 1); pass scale=1.0"
        return None

    return rule


def causal_only(module: str) -> Rule:
    """The module is causal whatever mask it gets (``is_causal = True``, used by SDPA when no mask is passed)."""

    def rule(cfg: MHAConfig) -> str | None:
        if not cfg.causal:
            return f"MHAConfig.causal=False: {module} is a decoder layer (is_causal=True); pass causal=True"
        return None

    return rule


def rotary_is(allowed: tuple[str | None, ...], module: str, partial: bool = False) -> Rule:
    """The module applies one of ``allowed`` rotary conventions (None: no rotary at all)."""

    def rule(cfg: MHAConfig) -> str | None:
        rope = cfg.rope
        if rope not in allowed:
            wanted = " or ".join("None" if style is None else repr(style) for style in allowed)
            return f"MHAConfig.rope={rope!r}: {module} applies rope={wanted}"
        if rope is not None and not partial and cfg.rope_dims != cfg.d_k:
            return f"MHAConfig.rope_dims={cfg.rope_dims}: {module} rotates every feature of a head (rope_dims = d_k = {cfg.d_k})"
        return None

    return rule


# --- one fused q/k/v layer and one output layer: the families that pack q, k and v together ---


class PackFunctions(TypedDict):
    """`Layout`'s shapes, pack and unpack, as the helpers below build them (typed for ``Layout(**...)``)."""

    shapes: Callable[[MHAConfig], dict[str, tuple[int, ...]]]
    pack: Callable[[MHAConfig, MHAParams], dict[str, np.ndarray]]
    unpack: Callable[[MHAConfig, dict[str, np.ndarray]], MHAParams]


def fused_qkv(qkv: str, out: str, pack_rows, unpack_rows, conv1d: bool = False) -> PackFunctions:
    """`Layout`'s shapes, pack, unpack for a module with one fused q/k/v layer ``qkv`` and an output layer ``out``.

    ``pack_rows(cfg, q, k, v)`` / ``unpack_rows(cfg, packed)`` order the rows (`_packing`).
    Weights are ``(out, in)`` like ``nn.Linear``, or ``(in, out)`` with ``conv1d`` (GPT-2's
    ``Conv1D``, the row-sample ``W_B``); ``{name}.bias`` is stored when cfg has biases.
    """

    def orient(weight: np.ndarray) -> np.ndarray:
        return to_row_sample(weight) if conv1d else weight.copy()  # Conv1D keeps (in, out): the transpose

    def unorient(weight: np.ndarray) -> np.ndarray:
        return from_row_sample(weight) if conv1d else weight

    def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
        rows = cfg.q_width + cfg.k_width + cfg.v_width
        weights = {f"{qkv}.weight": (rows, cfg.d_model), f"{out}.weight": (cfg.d_model, cfg.context_width)}
        result: dict[str, tuple[int, ...]] = {name: shape[::-1] if conv1d else shape for name, shape in weights.items()}
        if cfg.bias:
            result.update({f"{qkv}.bias": (rows,), f"{out}.bias": (cfg.d_model,)})
        return result

    def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
        state = {
            f"{qkv}.weight": orient(pack_rows(cfg, params.w_q, params.w_k, params.w_v)),  # (rows, E), or (E, rows)
            f"{out}.weight": orient(params.w_o),
        }
        if cfg.bias:
            state[f"{qkv}.bias"] = pack_rows(cfg, params.b_q, params.b_k, params.b_v)
            state[f"{out}.bias"] = params.b_o.copy()  # type: ignore[union-attr]  # cfg.bias: validated present
        return state

    def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
        w_q, w_k, w_v = unpack_rows(cfg, unorient(state[f"{qkv}.weight"]))
        b_q, b_k, b_v = unpack_rows(cfg, state.get(f"{qkv}.bias"))
        return MHAParams(w_q, w_k, w_v, unorient(state[f"{out}.weight"]), b_q, b_k, b_v, state.get(f"{out}.bias"))

    return {"shapes": shapes, "pack": pack, "unpack": unpack}


# --- four separate (out, in) weights: the pack/unpack of every family that keeps them apart ----


def separate_linears(
    prefixes: dict[str, str], extras: Mapping[str, str] | None = None, offsets: Mapping[str, float] | None = None
) -> PackFunctions:
    """`Layout`'s shapes, pack, unpack for a module with one ``(out, in)`` linear layer per projection.

    ``prefixes`` maps ``w_q``/``w_k``/``w_v``/``w_o`` to the module's names for those layers;
    the state dict holds ``{prefix}.weight`` (canonical, untouched) and ``{prefix}.bias``
    when the layer has a bias. ``extras`` maps the variants' parameters the module stores
    (``q_norm``, ``k_norm``, ``sinks``, ``rel_bias``) to their stored names, in the canonical
    shape. ``offsets``: a stored parameter that is ``canonical - offset`` (Gemma's RMSNorm
    stores ``w`` and multiplies by ``1 + w``: offset 1.0), read into float64. Exact both ways
    for canonical values in [0.5, 2] (Sterbenz: ``c - 1`` is exact there, and so is
    ``(c - 1) + 1``), and for a stored float32 or bfloat16 ``w`` (a real checkpoint's): ``1 + w``
    has room for all its bits in float64. A float64 ``w`` far from 0 and 1 loses its last bits.
    """
    extras = dict(extras or {})
    offsets = dict(offsets or {})
    for canonical in extras:
        param_spec(canonical)  # a variant's parameter (`Variant.params`): KeyError for any other name

    def names(cfg: MHAConfig) -> dict[str, str]:
        # canonical name -> stored name, for the parameters cfg has
        out = {}
        for canonical, shape in expected_param_shapes(cfg).items():
            if shape is None:
                continue
            if canonical in extras:
                out[canonical] = extras[canonical]
            else:  # the rules refuse a variant the module does not store before this is reached
                out[canonical] = f"{prefixes['w' + canonical[1:]]}.{'weight' if canonical[0] == 'w' else 'bias'}"
        return out

    def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
        canonical_shapes = expected_param_shapes(cfg)
        # names() lists only the parameters cfg has, so every shape here is a tuple.
        return {
            stored: shape
            for canonical, stored in names(cfg).items()
            if (shape := canonical_shapes[canonical]) is not None
        }

    def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
        return {
            stored: getattr(params, canonical) - offsets.get(canonical, 0.0) for canonical, stored in names(cfg).items()
        }  # a new array each (the subtraction copies)

    def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
        return MHAParams(
            **{
                # float64 for an offset one: 1 + w of a float32 or bfloat16 w is exact there, not in float32
                canonical: state[stored].astype(np.float64) + offsets[canonical]
                if canonical in offsets
                else state[stored]
                for canonical, stored in names(cfg).items()
            }
        )

    return {"shapes": shapes, "pack": pack, "unpack": unpack}


# --- DenseGeneral kernels with the head axis inside: Flax's attention, and Keras's --------------


def dense_general(out: str) -> PackFunctions:
    """`Layout`'s shapes, pack, unpack for Flax's / Keras's attention, its params tree flattened with ``/``.

    ``query``/``key``/``value`` hold ``kernel (in, H, head_dim)`` and ``bias (H, head_dim)``;
    the output layer ``out`` (Flax's ``out``, Keras's ``attention_output``) holds
    ``kernel (H, Dv, E)`` and ``bias (E,)``. The arrays are those of `core.to_flax_params`.
    """

    def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
        H = cfg.n_heads
        widths = {"query": (cfg.d_model, cfg.d_k), "key": (cfg.kdim, cfg.d_k), "value": (cfg.vdim, cfg.d_v)}
        result: dict[str, tuple[int, ...]] = {}
        for name, (width, head_dim) in widths.items():
            result[f"{name}/kernel"] = (width, H, head_dim)
            if cfg.bias:
                result[f"{name}/bias"] = (H, head_dim)
        result[f"{out}/kernel"] = (H, cfg.d_v, cfg.d_model)
        if cfg.bias:
            result[f"{out}/bias"] = (cfg.d_model,)
        return result

    def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
        tree = to_flax_params(cfg, params)
        tree[out] = tree.pop("out")  # Flax names the output layer "out"; it stays last
        return {f"{module}/{leaf}": array for module, leaves in tree.items() for leaf, array in leaves.items()}

    def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
        tree: dict[str, dict[str, np.ndarray]] = {}
        for path, array in state.items():
            module, leaf = path.split("/")
            tree.setdefault(module, {})[leaf] = array
        tree["out"] = tree.pop(out)
        return from_flax_params(cfg, tree)

    return {"shapes": shapes, "pack": pack, "unpack": unpack}
