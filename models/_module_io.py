"""Reading a real attention module (weights and configuration) into the spec, and loading the spec into one.

Design rules:

* One registry. Each family's layout carries its own `ModuleReader` (`Layout.reader`), the way it
  carries its runner; `mha_rosetta.models.MODULE_LAYOUTS` is built from `LAYOUTS` once, keyed by
  `class_key` (the class's top-level package and its name: ``"transformers.LlamaAttention"``,
  ``"torch.MultiheadAttention"``, ``"equinox.MultiheadAttention"``: the package tells torch's and
  Equinox's classes of the same name apart). Dispatch is on the exact class: a subclass may change
  what the module computes, so it is not read as its parent.
* A reader reads the module **instance**: the sizes and switches it was built with (its own
  attributes, and its config object for Hugging Face modules) and its tensors, keyed by the layout's
  names. Then `Layout.from_state_dict` unpacks them exactly and checks them against the configuration.
* Nothing is dropped silently. A setting is read into the spec where the spec has it (this layer's
  window, the softcap, QK-norm, sinks, biases, ALiBi, T5's relative bias, scaled rotary); one it cannot
  express (Falcon's ALiBi divided by sqrt(d), MPT's clip_qkv...) raises `LayoutError`
  naming the class, the setting and why (`unexpressible`).
* NumPy only at import. Framework tensors are read by duck typing (``.detach().cpu().numpy()`` for
  torch, ``np.asarray`` for JAX and Keras arrays); a loader that must build a framework tensor imports
  its framework inside the function.
* `from_module` / `to_module` on one layout are in `_from_module` (which imports the layouts; this
  module does not, so that `_layout` can import `ModuleReader` from here).
* `to_module` writes in place where the framework's modules are mutable (torch, Keras, Flax NNX) and
  returns the module; where they are immutable (Equinox, a bound Flax linen module) it returns a new
  module holding the parameters, and the caller must use the returned one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams

from ._errors import LayoutError


class ModuleSpec(NamedTuple):
    """What `from_module` returns: the module's configuration and its canonical parameters (unpacks as a pair)."""

    cfg: MHAConfig
    params: MHAParams


@dataclass(frozen=True)
class ModuleReader:
    """How a family's real module is read and loaded.

    ``classes``: the `class_key` of every class it reads. ``config(module)``: the `MHAConfig` the
    module computes, or `LayoutError` naming a setting the spec cannot express. ``state(module, cfg)``:
    the module's tensors as NumPy arrays keyed by the layout's names (copies). ``load(module, state)``:
    writes a state dict in the layout's names into the module; returns the module (a new one where the
    framework's modules are immutable). ``forward(module, cfg, x, padding, options) -> RealRun``: runs
    the instance on row-sample inputs as its own model would (None where models has no runner).
    """

    classes: tuple[str, ...]
    config: Callable[[Any], MHAConfig]
    state: Callable[[Any, MHAConfig], dict[str, np.ndarray]]
    load: Callable[[Any, dict[str, np.ndarray]], Any]
    forward: Callable | None = None


def class_key(module: object) -> str:
    """``"<top-level package>.<class name>"`` of ``module``'s class: the registry's key."""
    cls = type(module)
    top = cls.__module__.split(".")[0]
    if top == "mlx_lm":  # every mlx-lm family names its class Attention: its file tells them apart
        return f"{cls.__module__}.{cls.__qualname__}"
    return f"{top}.{cls.__qualname__}"


def class_name(module: object) -> str:
    """The class's full import path, for messages."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def unexpressible(module: object, setting: str, why: str = "") -> Exception:
    """The `LayoutError` for a module setting the spec cannot express: names the class and the setting."""
    tail = f": {why}" if why else ""
    return LayoutError(f"{class_name(module)} has {setting}, which the spec cannot express{tail}")


class unexpressible_config:  # lower case, as contextlib's context managers (suppress, closing)
    """``with unexpressible_config(module): return MHAConfig(...)``: a `TypeError` or `ValueError` raised inside (a
    setting MHAConfig refuses, or a reader its fields call) becomes `unexpressible`, naming the class and the reason.

    A class whose ``__exit__`` returns None, not a ``contextlib.contextmanager``: so type checkers know that it never
    swallows the error, and that a function returning inside the block returns."""

    def __init__(self, module: object) -> None:
        self.module = module

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if isinstance(error, (TypeError, ValueError)):
            raise unexpressible(self.module, "a configuration MHAConfig refuses", str(error)) from error


def to_array(value) -> np.ndarray:
    """A torch tensor (any device, bfloat16 too), a JAX array, a Flax NNX variable or a Keras variable -> a NumPy
    array that owns its memory."""
    if hasattr(value, "detach"):  # torch: NumPy has no bfloat16, so widen it (exactly) to float32
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return np.array(value.numpy(), copy=True)
    if hasattr(value, "get_value"):  # a Flax NNX Param
        value = value.get_value()
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # a Keras variable
        value = value.numpy()
    return np.array(value, copy=True)


# --- torch modules -----------------------------------------------------------------------------


def torch_tensors(module, names: Iterable[str]) -> dict[str, np.ndarray]:
    """``module.state_dict()[name]`` for each of ``names``, as NumPy copies."""
    state = module.state_dict()
    return {name: to_array(state[name]) for name in names}


def load_torch(module, state: Mapping[str, np.ndarray]):
    """Copy each array into the parameter of that name, keeping the parameter's dtype and device; returns module."""
    import torch

    with torch.no_grad():
        for name, array in state.items():
            target = module.get_parameter(name)
            if tuple(target.shape) != tuple(array.shape):
                raise LayoutError(
                    f"{class_name(module)}.{name} has shape {tuple(target.shape)}, the state dict {tuple(array.shape)}"
                )
            target.copy_(torch.from_numpy(np.ascontiguousarray(array)))
    return module


def torch_reader(classes: tuple[str, ...], config, names, forward=None) -> ModuleReader:
    """A `ModuleReader` for a torch module whose state dict keys are the layout's names.

    ``names(cfg)`` lists the layout's keys (its ``shapes(cfg)``); extra entries of the module's own
    state dict (BERT's ``output.LayerNorm``) are not attention parameters and are left alone.
    """
    return ModuleReader(
        classes=classes,
        config=config,
        state=lambda module, cfg: torch_tensors(module, names(cfg)),
        load=load_torch,
        forward=forward,
    )


# --- the module's Hugging Face config ----------------------------------------------------------


# Keys of Hugging Face's rope_parameters that are not scaling: MHAConfig holds them in rope_base and rope_dims.
_HF_ROPE_NOT_SCALING = ("rope_type", "rope_theta", "partial_rotary_factor")


def hf_rope(module, config, head_dim: int, partial: bool = False, layer_type: str | None = None) -> HFRope:
    """The rotary settings of a Hugging Face module's config: `HFRope` (base, rotated dims, scaling).

    transformers 5.x keeps them in ``config.rope_parameters``: ``rope_type``, ``rope_theta``,
    ``partial_rotary_factor`` and the scaling keys of the type, one dict for the model, or one per layer
    type where the layer types differ (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``,
    read for ``layer_type``). ``partial``: the family's rotary module honours ``partial_rotary_factor``
    (GPT-NeoX, Phi-3); Llama's and Falcon's default tables ignore it and rotate every feature. A scaling
    type the spec has (`core.rope_scaling`: linear, dynamic, llama3, yarn, proportional, longrope) becomes
    ``rope_scaling`` in Hugging Face's form; any other is `LayoutError`. Dynamic NTK reads its length L from
    ``config.max_position_embeddings``, as transformers does; so does longrope's ``factor`` where neither it nor
    ``attention_factor`` is given (transformers' ``max_position_embeddings / original_max_position_embeddings``,
    Phi-3's configs).
    """
    from mha_rosetta.core.rope_scaling import ROPE_SCALING_TYPES, validate_rope_scaling

    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(parameters.get(layer_type), Mapping):
        parameters = dict(parameters[layer_type])
    rope_type = parameters.get("rope_type", "default")
    base = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if partial else 1
    dims = int(head_dim * factor)  # HF: int(head_dim * partial_rotary_factor)
    if rope_type == "default":
        return HFRope(float(base), dims, None)
    if rope_type not in ROPE_SCALING_TYPES:
        raise unexpressible(
            module,
            f"rope_parameters['rope_type']={rope_type!r}",
            f"the spec scales rotary as {', '.join(ROPE_SCALING_TYPES)} only",
        )
    # proportional (Gemma 4) keeps partial_rotary_factor: there it is the share of pairs that turn, its own key
    kept = ("partial_rotary_factor",) if rope_type == "proportional" else ()
    scaling = {key: value for key, value in parameters.items() if key not in _HF_ROPE_NOT_SCALING or key in kept}
    scaling["rope_type"] = rope_type
    if rope_type == "dynamic":
        scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if rope_type == "longrope" and scaling.get("factor") is None and scaling.get("attention_factor") is None:
        scaling["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]
    try:  # what transformers takes and the spec refuses (a longrope divisor of 0): named here, with the reason
        validate_rope_scaling(scaling)
    except (TypeError, ValueError) as error:
        raise unexpressible(module, f"rope_parameters of rope_type {rope_type!r}", str(error)) from error
    return HFRope(float(base), dims, scaling)


class HFRope(NamedTuple):
    """What `hf_rope` reads: ``rope_base``, ``rope_dims`` and ``rope_scaling`` (None: unscaled) for `MHAConfig`."""

    rope_base: float
    rope_dims: int
    rope_scaling: dict | None

    def half_fields(self) -> dict:
        """The `MHAConfig` rotary fields of a rotate-half family: rope "half", its base and its scaling."""
        return {"rope": "half", "rope_base": self.rope_base, "rope_scaling": self.rope_scaling}


def hf_attention_fields(module, query, n_heads: int, d_k: int) -> dict:
    """The `MHAConfig` fields a transformers attention instance holds alike whatever its family: the width its
    query linear ``query`` reads, its heads and head size (each family names those attributes its own way), its
    ``is_causal`` and its own ``scaling``. The reader adds the bias and what its family adds."""
    return dict(
        d_model=query.in_features, n_heads=n_heads, d_k=d_k, causal=bool(module.is_causal), scale=module.scaling
    )


def hf_window(module, config) -> int | None:
    """This layer's sliding window: the module's own ``sliding_window`` attribute where it has one (set from
    ``config.layer_types[layer_idx]``: None on a full-attention layer), else ``config.sliding_window`` (Mistral,
    Phi-3: every layer). Hugging Face's window counts the query's own key, as the spec's does."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(config, "sliding_window", None)


# --- comparing a module's configuration with the one the parameters were made for --------------


def differing_fields(held: MHAConfig, given: MHAConfig) -> list[tuple[str, Any, Any]]:
    """``(field, held value, given value)`` for every field where two configurations differ (floats within 1e-12
    relative are the same)."""
    out = []
    for f in fields(MHAConfig):
        a, b = getattr(held, f.name), getattr(given, f.name)
        same = math.isclose(a, b, rel_tol=1e-12) if isinstance(a, float) and isinstance(b, float) else a == b
        if not same:
            out.append((f.name, a, b))
    return out


def config_differences(held: MHAConfig, given: MHAConfig) -> list[str]:
    """``field: module value != given value`` for every field where two configurations differ."""
    return [f"{name}: module {a!r}, given {b!r}" for name, a, b in differing_fields(held, given)]
