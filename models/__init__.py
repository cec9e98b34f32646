"""mha_rosetta.models: the weight layouts of real checkpoints, tied to the canonical parameters.

Imports NumPy only, like `mha_rosetta.core`. One module per family; each layout maps the
canonical `MHAParams` to a state dict keyed by the real module's own parameter names and
back, exactly::

    from mha_rosetta.core import MHAConfig, init_params
    from mha_rosetta.models import LAYOUTS, get_layout

    cfg = MHAConfig(d_model=16, n_heads=4)
    state = get_layout("hf-gpt2").to_state_dict(cfg, init_params(cfg))   # {"c_attn.weight": (16, 48), ...}
    params = get_layout("hf-gpt2").from_state_dict(cfg, state)            # the same numbers back

A layout whose real module cannot hold a configuration (GPT-2 has no grouped kv heads,
T5 does not scale its scores, Meta's Llama has no biases) raises `LayoutError` naming the
layout and the field. `convert_state_dict` moves a checkpoint from one family to another
through the canonical parameters, permuting the q/k rows when the two families use
different rotary conventions (Meta's interleaved pairs vs Hugging Face's halves).

`from_module(module)` reads a real attention module instance (weights and configuration) into
``ModuleSpec(cfg, params)``; `to_module(cfg, params, module)` loads it back. The class decides the
layout (`MODULE_LAYOUTS`, built from each layout's `Layout.reader`); see `_module_io` for the rules.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mha_rosetta.core import MHAConfig

from . import (
    hf_bert,
    hf_bloom,
    hf_deepseek,
    hf_falcon,
    hf_gemma2,
    hf_gemma3,
    hf_gemma4,
    hf_gpt2,
    hf_gpt_neox,
    hf_gpt_oss,
    hf_llama,
    hf_llama4,
    hf_mistral,
    hf_mistral4,
    hf_mpt,
    hf_olmo2,
    hf_phi3,
    hf_qwen2,
    hf_qwen3,
    hf_qwen3_next,
    hf_t5,
    keras_hub,
    keras_mha,
    megatron,
    meta_llama,
    mlx_deepseek,
    mlx_llama4,
    mlx_llama4_text,
    mlx_lm,
    timm_vit,
)
from ._convert import convert_layouts
from ._from_module import load_module, read_module
from ._layout import BLOCKS, PACKINGS, PER_GROUP, PER_HEAD, SEPARATE, Layout, LayoutError
from ._module_io import ModuleReader, ModuleSpec, class_key, class_name, differing_fields
from ._packing import pack_blocks, pack_groups, unpack_blocks, unpack_groups
from .library_oracles import EQUINOX, FLAX, TORCH_MHA

LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        hf_gpt2.LAYOUT,
        hf_bert.LAYOUT,
        hf_llama.LAYOUT,
        meta_llama.LAYOUT,
        hf_gpt_neox.LAYOUT,
        hf_phi3.LAYOUT,
        hf_falcon.LAYOUT,
        hf_qwen2.LAYOUT,
        hf_mistral.LAYOUT,
        hf_qwen3.LAYOUT,
        hf_olmo2.LAYOUT,
        hf_gemma2.LAYOUT,
        hf_gemma3.LAYOUT,
        hf_gemma4.LAYOUT,
        hf_gpt_oss.LAYOUT,
        hf_llama4.LAYOUT,
        hf_deepseek.LAYOUT_V2,
        hf_deepseek.LAYOUT_V3,
        hf_mistral4.LAYOUT,
        hf_qwen3_next.LAYOUT,
        hf_bloom.LAYOUT,
        hf_mpt.LAYOUT,
        megatron.LAYOUT,
        timm_vit.LAYOUT,
        hf_t5.LAYOUT,
        keras_mha.LAYOUT,
        *mlx_lm.LAYOUTS,
        mlx_deepseek.LAYOUT,
        mlx_llama4.LAYOUT,
        mlx_llama4_text.LAYOUT,
        *keras_hub.LAYOUTS,
        TORCH_MHA,
        FLAX,
        EQUINOX,
    )
}


# The one dispatch of `from_module` / `to_module`: each layout registers the classes its reader reads.
MODULE_LAYOUTS: dict[str, Layout] = {
    key: layout for layout in LAYOUTS.values() if layout.reader is not None for key in layout.reader.classes
}


def layout_of_module(module) -> Layout:
    """The layout whose reader reads ``module``'s class (`MODULE_LAYOUTS`); `LayoutError` listing them otherwise."""
    key = class_key(module)
    if key not in MODULE_LAYOUTS:
        raise LayoutError(
            f"from_module/to_module: no layout reads {class_name(module)} ({key}); known classes: "
            f"{', '.join(MODULE_LAYOUTS)} (a subclass is not read as its parent: it may compute something else)"
        )
    return MODULE_LAYOUTS[key]


def from_module(module) -> ModuleSpec:
    """A real attention module instance -> ``ModuleSpec(cfg, params)``: what it computes, in the spec.

    Reads the module's configuration (heads, kv heads, head_dim, the scale with Gemma's
    ``query_pre_attn_scalar``, causal where the module has it, biases including ``"qkv"``, rotary base,
    partial factor and scaling, this layer's sliding window, the softcap, QK-norm, sinks, ALiBi, T5's
    relative bias) and its tensors, exactly. ``cfg, params = from_module(m)``; then
    ``reference_mha(cfg, params, x)`` is the module's output. A setting the spec cannot express (Falcon's
    ALiBi divided by sqrt(d), Phi-3's longrope, MPT's clip_qkv...) raises `LayoutError` naming the class,
    the setting and why; so does a class no layout reads.
    """
    return read_module(layout_of_module(module), module)


def to_module(cfg: MHAConfig, params, module):
    """Load canonical ``params`` (for ``cfg``) into ``module`` and return it.

    In place for torch, Keras and Flax NNX modules; Equinox modules and bound Flax linen modules are
    immutable, so the returned module is a new one: use the return value. The module must have been built
    for ``cfg`` (`LayoutError` naming the fields that differ otherwise).
    """
    return load_module(layout_of_module(module), cfg, params, module)


def get_layout(name: str) -> Layout:
    """The layout registered as ``name`` (see `LAYOUTS`)."""
    if not isinstance(name, str) or name not in LAYOUTS:
        raise LayoutError(f"unknown layout {name!r}; known layouts: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def convert_state_dict(
    cfg: MHAConfig, state_dict: Mapping, source: str, target: str
) -> tuple[MHAConfig, dict[str, np.ndarray]]:
    """A ``source``-family state dict for ``cfg`` -> the ``target`` family's state dict for the same layer.

    Goes through the canonical parameters. When the target module applies the other
    rotary convention (``meta-llama`` interleaved -> ``hf-llama`` half), the rows of
    ``w_q``/``w_k`` are permuted per head so that the target computes the same scores
    (`mha_rosetta.core.rotary`). Returns ``(target cfg, target state dict)``; the target
    cfg differs from ``cfg`` only in ``rope``.
    """
    return convert_layouts(cfg, state_dict, get_layout(source), get_layout(target))


__all__ = [
    "BLOCKS",
    "LAYOUTS",
    "MODULE_LAYOUTS",
    "PACKINGS",
    "PER_GROUP",
    "PER_HEAD",
    "SEPARATE",
    "Layout",
    "LayoutError",
    "ModuleReader",
    "ModuleSpec",
    "convert_state_dict",
    "differing_fields",
    "from_module",
    "get_layout",
    "layout_of_module",
    "pack_blocks",
    "pack_groups",
    "to_module",
    "unpack_blocks",
    "unpack_groups",
]
