"""``timm-vit``: timm's ViT ``Attention`` (timm/models/vision_transformer.py).

Keys are relative to ``Attention`` (``blocks.{i}.attn.`` in a timm ViT checkpoint):
``qkv (3E, E)`` packs q, k and v as **blocks** ``[Q; K; V]`` — exactly
``nn.MultiheadAttention.in_proj_weight`` — and timm splits it with
``reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)``; ``proj (E, E)`` is the output.
"""

from __future__ import annotations

from ._layout import BLOCKS, Layout, classic_heads, default_scale, fused_qkv, rotary_is
from ._packing import pack_blocks, unpack_blocks

MODULE = "timm Attention"

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
        *classic_heads(MODULE),
        default_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    **fused_qkv("qkv", "proj", pack_blocks, unpack_blocks),
    notes=(
        "bias: qkv_bias (True in ViTs) and proj_bias; the spec's bias is all-or-none",
        "qkv.weight == nn.MultiheadAttention's in_proj_weight and proj == out_proj: a timm block loads into "
        "nn.MultiheadAttention by renaming the keys",
        "q_norm/k_norm (qk_norm=True) are outside the spec; by default they are Identity and store nothing",
    ),
)
