"""``megatron``: Megatron-LM ``SelfAttention`` (megatron/core/transformer/attention.py).

Keys are relative to ``SelfAttention`` (``decoder.layers.{i}.self_attention.`` in a
Megatron-core checkpoint, one tensor-parallel rank holding all heads here).
``linear_qkv ((H + 2*G)*d, E)`` packs q, k and v **per query group**: for each kv group
``g`` the rows hold ``[q heads g*Q .. (g+1)*Q-1 | k_g | v_g]`` (``Q = H / G``). Megatron
splits it with ``view(s, b, G, (Q + 2)*d)`` and ``split([Q*d, d, d], dim=3)``. Tensor
parallelism cuts this tensor by whole groups, which is why the groups are contiguous.
"""

from __future__ import annotations

from ._layout import PER_GROUP, Layout, fused_qkv, rotary_is, same_head_dims, self_attention_widths
from ._packing import pack_groups, unpack_groups

MODULE = "Megatron-LM SelfAttention"

LAYOUT = Layout(
    name="megatron",
    module="SelfAttention (megatron.core.transformer.attention)",
    description="Megatron-LM: linear_qkv packed per query group [q heads of g | k_g | v_g]; linear_proj",
    packing=PER_GROUP,
    scale="1/sqrt(d_k), or config.softmax_scale",
    rotary="none, half or interleaved (config.rotary_interleaved), partial via rotary_percent",
    source="megatron/core/transformer/attention.py (SelfAttention.get_query_key_value_tensors)",
    split="linear_qkv(x).view(s, b, G, (Q + 2)*d).split([Q*d, d, d], dim=3); q.reshape(s, b, H, d)",
    rules=(
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        rotary_is((None, "half", "interleaved"), MODULE, partial=True),
    ),
    **fused_qkv("linear_qkv", "linear_proj", pack_groups, unpack_groups),
    notes=(
        "bias: config.add_bias_linear puts a bias on both layers (add_qkv_bias alone, only on linear_qkv, "
        "is outside the spec's all-or-none bias)",
        "Megatron is sequence-first, (s, b, h); the Transformer Engine variant adds linear_qkv.layer_norm_weight "
        "(the fused pre-norm) and _extra_state entries, which are not attention parameters",
        "with G = H (no grouping) the packing is GPT-NeoX's per-head [q_h; k_h; v_h]",
    ),
)
