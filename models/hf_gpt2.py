"""``hf-gpt2``: Hugging Face ``GPT2Attention`` (transformers/models/gpt2/modeling_gpt2.py).

Keys are relative to the ``GPT2Attention`` module (``transformer.h.{i}.attn.`` in a
``GPT2LMHeadModel`` checkpoint). GPT-2's ``Conv1D`` stores its weight as ``(in, out)`` and
computes ``x @ weight + bias``: the row-sample ``W_B``, the transpose of ``nn.Linear``.
``c_attn`` packs q, k and v as blocks along ``out`` (columns ``0:E`` are q, ``E:2E`` k,
``2E:3E`` v), and the module splits them with ``c_attn(x).split(E, dim=2)``.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, from_row_sample, to_row_sample

from ._layout import (
    BLOCKS,
    Layout,
    bias_is,
    default_scale,
    head_dim_is_width_over_heads,
    no_grouped_kv,
    rotary_is,
    same_head_dims,
    self_attention_widths,
)
from ._packing import pack_blocks, unpack_blocks

MODULE = "GPT2Attention"


def _shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
    E = cfg.d_model
    return {"c_attn.weight": (E, 3 * E), "c_attn.bias": (3 * E,), "c_proj.weight": (E, E), "c_proj.bias": (E,)}


def _pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
    return {
        "c_attn.weight": to_row_sample(pack_blocks(params.w_q, params.w_k, params.w_v)),  # (3E, E) -> (E, 3E)
        "c_attn.bias": pack_blocks(params.b_q, params.b_k, params.b_v),  # (3E,)
        "c_proj.weight": to_row_sample(params.w_o),  # (E, E), (in, out)
        "c_proj.bias": params.b_o.copy(),
    }


def _unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
    w_q, w_k, w_v = unpack_blocks(cfg, from_row_sample(state["c_attn.weight"]))  # (E, 3E) -> (3E, E) -> 3 x (E, E)
    b_q, b_k, b_v = unpack_blocks(cfg, state["c_attn.bias"])
    return MHAParams(w_q, w_k, w_v, from_row_sample(state["c_proj.weight"]), b_q, b_k, b_v, state["c_proj.bias"])


LAYOUT = Layout(
    name="hf-gpt2",
    module=MODULE,
    description="GPT-2: one Conv1D c_attn (in, out) holding q, k, v as column blocks; Conv1D c_proj",
    packing=BLOCKS,
    scale="1/sqrt(d_k) (config.scale_attn_weights=True, the default)",
    rotary="none (learned absolute positions, outside attention)",
    source="transformers/models/gpt2/modeling_gpt2.py",
    split="c_attn(x).split(E, dim=2) -> q, k, v (B, N, E); each .view(B, N, H, d).transpose(1, 2)",
    rules=(
        no_grouped_kv(MODULE),
        head_dim_is_width_over_heads(MODULE),
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        bias_is(True, "GPT-2's Conv1D layers always have a bias"),
        default_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    shapes=_shapes,
    pack=_pack,
    unpack=_unpack,
    notes=(
        "Conv1D weight is (in, out): the transpose of nn.Linear.weight; loading c_attn.weight into an nn.Linear "
        "without .T is the classic GPT-2 porting bug",
        "scale_attn_by_inverse_layer_idx=True (off by default) divides the scale by layer_idx + 1; not covered here",
        "the module is causal in the model (GPT2Model builds the causal mask); the attention itself takes any mask",
    ),
)

to_state_dict = LAYOUT.to_state_dict
from_state_dict = LAYOUT.from_state_dict
