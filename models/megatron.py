"""``megatron``: Megatron-LM ``SelfAttention`` (megatron/core/transformer/attention.py).

Keys are relative to ``SelfAttention`` (``decoder.layers.{i}.self_attention.`` in a
Megatron-core checkpoint, one tensor-parallel rank holding all heads here).
``linear_qkv ((H + 2*G)*d, E)`` packs q, k and v **per query group**: for each kv group
``g`` the rows hold ``[q heads g*Q .. (g+1)*Q-1 | k_g | v_g]`` (``Q = H / G``). Megatron
splits it with ``view(s, b, G, (Q + 2)*d)`` and ``split([Q*d, d, d], dim=3)``. Tensor
parallelism cuts this tensor by whole groups, which is why the groups are contiguous.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig

from ._layout import PER_GROUP, Layout, fused_qkv, rotary_is, self_attention_heads
from ._packing import pack_groups, unpack_groups
from ._real import RealRun, allowed_mask, state_shapes, torch_state

MODULE = "Megatron-LM SelfAttention"


def megatron_split(cfg: MHAConfig, mixed_qkv):
    """Megatron-LM's ``SelfAttention.get_query_key_value_tensors`` split, rewritten from its source (torch).

    ``mixed_qkv`` is ``linear_qkv``'s output, sequence-first ``(s, b, (H + 2G)*d)``; returns
    query ``(s, b, H, d)``, key and value ``(s, b, G, d)``.
    """
    import torch

    G, d, Q = cfg.n_kv_heads, cfg.d_k, cfg.group_size
    mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], G, (Q + 2) * d)  # [sq, b, ng, (np/ng + 2) * hn]
    query, key, value = torch.split(mixed_qkv, [Q * d, d, d], dim=3)  # [sq, b, ng, np/ng * hn], [.., hn], [.., hn]
    query = query.reshape(query.size(0), query.size(1), -1, d)  # [sq, b, np, hn]
    return query, key, value


def _megatron(cfg, state, x, padding, options):
    import torch

    B, N, _ = x.shape
    w = torch_state(state)
    hidden = torch.from_numpy(x).transpose(0, 1)  # (s, b, h): Megatron is sequence-first
    mixed = hidden @ w["linear_qkv.weight"].T + (w["linear_qkv.bias"] if cfg.bias else 0.0)  # (s, b, (H+2G)*d)
    query, key, value = megatron_split(cfg, mixed)
    q = query.permute(1, 2, 0, 3)  # (b, H, s, d)
    k = key.permute(1, 2, 0, 3)  # (b, G, s, d)
    v = value.permute(1, 2, 0, 3)
    if cfg.rope is not None:
        q, k = _rotate_bhsd(cfg, q), _rotate_bhsd(cfg, k)
    allowed = torch.from_numpy(allowed_mask(cfg, B, N, padding))
    context = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=cfg.scale, enable_gqa=cfg.n_kv_heads != cfg.n_heads
    )  # (b, H, s, d)
    merged = context.permute(2, 0, 1, 3).reshape(N, B, -1)  # (s, b, H*d), Megatron's core_attn_out
    output = merged @ w["linear_proj.weight"].T + (w["linear_proj.bias"] if cfg.bias else 0.0)
    return RealRun(
        "megatron",
        "reimplementation",
        "Megatron-LM's linear_qkv split (view + split, rewritten from its source) + torch SDPA",
        output.transpose(0, 1).numpy(),
        merged.transpose(0, 1).numpy(),
        parameters=state_shapes(state),
        note="Megatron-LM is not installable here: its split is rewritten from attention.py",
    )


def _rotate_bhsd(cfg, t):
    """Rotary on (b, heads, s, d) with the spec's tables (positions 0..s-1), in cfg.rope's pairing."""
    import torch

    from mha_rosetta.core.rotary import angles, apply_rotary

    positions = np.arange(t.shape[2])
    theta = angles(cfg, positions)  # (s, r/2)
    return torch.from_numpy(apply_rotary(t.numpy(), np.cos(theta), np.sin(theta), cfg.rope))


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
        *self_attention_heads(MODULE),
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
    runner=_megatron,
    requires=("torch",),
    example={"n_kv_heads": 2},
)
