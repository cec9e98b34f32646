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
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mha_rosetta.core import MHAConfig

from . import hf_bert, hf_gpt2, hf_gpt_neox, hf_llama, hf_t5, keras_mha, megatron, meta_llama, timm_vit
from ._convert import convert_layouts
from ._layout import BLOCKS, PACKINGS, PER_GROUP, PER_HEAD, SEPARATE, Layout, LayoutError
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
        megatron.LAYOUT,
        timm_vit.LAYOUT,
        hf_t5.LAYOUT,
        keras_mha.LAYOUT,
        TORCH_MHA,
        FLAX,
        EQUINOX,
    )
}


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
    "PACKINGS",
    "PER_GROUP",
    "PER_HEAD",
    "SEPARATE",
    "Layout",
    "LayoutError",
    "convert_state_dict",
    "get_layout",
    "pack_blocks",
    "pack_groups",
    "unpack_blocks",
    "unpack_groups",
]
