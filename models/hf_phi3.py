"""``hf-phi3``: Hugging Face ``Phi3Attention`` (transformers/models/phi3/modeling_phi3.py).

Keys are relative to ``Phi3Attention`` (``model.layers.{i}.self_attn.`` in a ``Phi3ForCausalLM``
checkpoint). ``qkv_proj ((H + 2G)*d, E)`` packs q, k and v as **blocks** ``[Q; K; V]`` with grouped
kv heads: rows ``0:H*d`` are q, then ``G*d`` rows of k, then ``G*d`` of v; the module slices them
(``qkv[..., :H*d]``, ...) and views each as ``(B, N, -1, d)``. ``o_proj (E, H*d)``; no biases.
Rotary is rotate-half on the first ``partial_rotary_factor * d`` features of a head (Phi-3 itself
uses 1.0, Phi-4-mini 0.75), taken from ``config.rope_parameters``. The 128k models scale it with
``longrope`` (`core.longrope`): ``Phi3RotaryEmbedding``'s ``dynamic_rope_update`` picks the long table
when the call's ``max(position_ids) + 1`` exceeds ``original_max_position_embeddings`` (which
``Phi3Config`` keeps at the top level and copies over the dict's), the short one otherwise, and
multiplies cos and sin by the attention factor at every length.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from . import _hf
from ._hf import hf_config, hf_forward, hf_implementation, hf_mask, hf_rope_parameters, rotary_precision, rotary_tables
from ._hf_decoder import LLAMA_LIKE_EXAMPLE
from ._layout import (
    BLOCKS,
    Layout,
    bias_is,
    causal_only,
    default_scale,
    fused_qkv,
    rotary_is,
    self_attention_heads,
)
from ._module_io import hf_attention_fields, hf_rope, hf_window, torch_reader
from ._packing import pack_blocks, unpack_blocks
from ._real import HF_REQUIRES, torch_state

MODULE = "Phi3Attention"


def _phi3(cfg, state, x, padding, options):
    module = build(cfg, options)
    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def build(cfg: MHAConfig, options):
    """A tiny float64 ``Phi3Attention`` (layer 0) for ``cfg``, not loaded."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    config = hf_config(
        Phi3Config(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.d_k,
            attention_dropout=0.0,
            sliding_window=cfg.window,
            rope_parameters=hf_rope_parameters(cfg, partial=True),
            **_lengths(cfg),
        ),
        options,
    )
    return Phi3Attention(config, layer_idx=0).double().eval()


def _lengths(cfg: MHAConfig) -> dict:
    """Phi3Config's lengths for longrope: ``original_max_position_embeddings`` at the top level (Phi3Config's own
    field, 4096 by default, overrides the dict's) and ``max_position_embeddings`` = factor * it."""
    if cfg.rope_scaling is None:
        return {}
    original = cfg.rope_scaling["original_max_position_embeddings"]
    return {"original_max_position_embeddings": original, **_hf.hf_max_positions(cfg)}


def _longrope_rule(cfg: MHAConfig) -> str | None:
    """Phi3Config takes no other scaling, and checks longrope's tables against hidden_size // heads."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return None
    if scaling["rope_type"] != "longrope":
        return (
            f"MHAConfig.rope_scaling type {scaling['rope_type']!r}: Phi3Config.validate_rope accepts 'default' and "
            "'longrope' only"
        )
    if cfg.d_k != cfg.d_model // cfg.n_heads:
        return (
            f"MHAConfig.d_k={cfg.d_k} with longrope: Phi3Config.validate_rope measures the tables against "
            f"hidden_size // num_attention_heads = {cfg.d_model // cfg.n_heads} (times partial_rotary_factor), where "
            "the rotary (_compute_longrope_parameters) uses head_dim: it refuses the tables the rotary needs"
        )
    return None


def _forward(module, cfg, x, padding, options):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    with hf_implementation(module.config, options) as config:

        def forward(xt):
            cos_sin = rotary_tables(cfg, options, Phi3RotaryEmbedding(config), xt)
            return module(xt, position_embeddings=cos_sin, attention_mask=hf_mask(config, cfg, xt, padding))[0]

        description = f"transformers Phi3Attention ({options.implementation})"
        return hf_forward("hf-phi3", module, description, x, forward, **rotary_precision(options))


def _config(module) -> MHAConfig:
    """The Phi3Attention instance's configuration: its window is config.sliding_window (every layer); its rotary from
    config.rope_parameters, longrope included (`hf_rope`: factor from max_position_embeddings where not given)."""
    config = module.config
    rope = hf_rope(module, config, module.head_dim, partial=True)
    return MHAConfig(
        **hf_attention_fields(module, module.qkv_proj, config.num_attention_heads, module.head_dim),
        n_kv_heads=module.num_key_value_heads,
        bias=False,
        **rope.half_fields(),
        rope_dims=rope.rope_dims,
        window=hf_window(module, config),
    )


PACKING = fused_qkv("qkv_proj", "o_proj", pack_blocks, unpack_blocks)

LAYOUT = Layout(
    name="hf-phi3",
    module=MODULE,
    description="Phi-3: one qkv_proj ((H + 2G)*d, E) holding [Q; K; V] blocks with grouped kv heads; o_proj; no bias",
    packing=BLOCKS,
    scale="1/sqrt(d_k)",
    rotary="half (rotate_half) on the first partial_rotary_factor * d_k features of each head",
    source="transformers/models/phi3/modeling_phi3.py",
    split="qkv[..., :H*d], qkv[..., H*d:H*d + G*d], qkv[..., H*d + G*d:]; each .view(B, N, -1, d).transpose(1, 2)",
    rules=(
        *self_attention_heads(MODULE),
        bias_is(False, "Phi-3's qkv_proj and o_proj are nn.Linear(..., bias=False)"),
        default_scale(MODULE),
        causal_only(MODULE),
        rotary_is(("half",), MODULE, partial=True),
        _longrope_rule,
    ),
    **PACKING,
    notes=(
        "the blocks of nn.MultiheadAttention's in_proj_weight, but with G kv heads: k and v take G*d rows each",
        "rope_dims = int(d_k * partial_rotary_factor) (config.rope_parameters); Phi-3 rotates every feature",
        "float32 inside a float64 model: eager attention's softmax (softmax(..., dtype=torch.float32)) and the "
        "rotary module's angles (inv_freq in torch.float); SDPA with float64 (cos, sin) keeps float64",
        "config.sliding_window (Phi-3-mini's 2047) is every layer's window (MHAConfig.window, the same count)",
        "rope_type 'longrope' (the 128k models): the short table up to original_max_position_embeddings, the long one "
        "past it, by the call's max(position_ids) + 1 (core.longrope); its tables and angles are float32",
    ),
    runner=_phi3,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.Phi3Attention",), _config, PACKING["shapes"], _forward),
    example={**LLAMA_LIKE_EXAMPLE, "rope_dims": 2},
    variants=("window", "rope_scaling"),
)
