"""``timm-vit``: timm's ViT ``Attention`` (timm/models/vision_transformer.py).

Keys are relative to ``Attention`` (``blocks.{i}.attn.`` in a timm ViT checkpoint):
``qkv (3E, E)`` packs q, k and v as **blocks** ``[Q; K; V]`` — exactly
``nn.MultiheadAttention.in_proj_weight`` — and timm splits it with
``reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)``; ``proj (E, E)`` is the output.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams

from ._layout import (
    BLOCKS,
    Layout,
    default_scale,
    head_dim_is_width_over_heads,
    no_grouped_kv,
    rotary_is,
    same_head_dims,
    self_attention_widths,
)
from ._packing import pack_blocks, unpack_blocks

MODULE = "timm Attention"


def _shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
    E = cfg.d_model
    shapes = {"qkv.weight": (3 * E, E), "proj.weight": (E, E)}
    if cfg.bias:
        shapes.update({"qkv.bias": (3 * E,), "proj.bias": (E,)})
    return shapes


def _pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
    state = {"qkv.weight": pack_blocks(params.w_q, params.w_k, params.w_v), "proj.weight": params.w_o.copy()}  # (3E, E)
    if cfg.bias:
        state["qkv.bias"] = pack_blocks(params.b_q, params.b_k, params.b_v)
        state["proj.bias"] = params.b_o.copy()
    return state


def _unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
    w_q, w_k, w_v = unpack_blocks(cfg, state["qkv.weight"])
    b_q, b_k, b_v = unpack_blocks(cfg, state.get("qkv.bias"))
    return MHAParams(w_q, w_k, w_v, state["proj.weight"], b_q, b_k, b_v, state.get("proj.bias"))


LAYOUT = Layout(
    name="timm-vit",
    module="Attention (timm.models.vision_transformer)",
    description="timm ViT: fused qkv (3E, E) as [Q; K; V] blocks (nn.MultiheadAttention's in_proj packing); proj",
    packing=BLOCKS,
    scale="1/sqrt(d_k)",
    rotary="none (learned absolute position embeddings, outside attention)",
    source="timm/models/vision_transformer.py",
    split="qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0) -> q, k, v (B, H, N, d)",
    rules=(
        no_grouped_kv(MODULE),
        head_dim_is_width_over_heads(MODULE),
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        default_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    shapes=_shapes,
    pack=_pack,
    unpack=_unpack,
    notes=(
        "bias: qkv_bias (True in ViTs) and proj_bias; the spec's bias is all-or-none",
        "qkv.weight == nn.MultiheadAttention's in_proj_weight and proj == out_proj: a timm block loads into "
        "nn.MultiheadAttention by renaming the keys",
        "q_norm/k_norm (qk_norm=True) are outside the spec; by default they are Identity and store nothing",
    ),
)

to_state_dict = LAYOUT.to_state_dict
from_state_dict = LAYOUT.from_state_dict
