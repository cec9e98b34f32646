"""``hf-gpt-neox``: Hugging Face ``GPTNeoXAttention`` (transformers/models/gpt_neox/modeling_gpt_neox.py).

Keys are relative to ``GPTNeoXAttention`` (``gpt_neox.layers.{i}.attention.`` in a
Pythia / GPT-NeoX checkpoint). ``query_key_value (3E, E)`` packs q, k and v **per
head**: rows ``3*d*h : 3*d*(h+1)`` hold ``[q_h; k_h; v_h]``. The module splits it with
``view(B, N, H, 3*d)`` and ``chunk(3, dim=-1)``; reading it as ``[Q; K; V]`` blocks (the
``nn.MultiheadAttention`` / timm packing) mixes heads and roles without any shape error.
Rotary embeddings (rotate-half) turn only the first ``rotary_pct * d`` features of a head.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._hf import hf_config, hf_forward, hf_implementation, hf_mask, hf_rope_parameters, rotary_precision, rotary_tables
from ._layout import PER_HEAD, Layout, classic_heads, default_scale, fused_qkv, rotary_is
from ._module_io import hf_attention_fields, hf_rope, torch_reader
from ._packing import pack_groups, unpack_groups
from ._real import HF_REQUIRES, torch_state

MODULE = "GPTNeoXAttention"


def _gpt_neox(cfg, state, x, padding, options):
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    config = hf_config(
        GPTNeoXConfig(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            attention_bias=cfg.bias,
            attention_dropout=0.0,
            rope_parameters=hf_rope_parameters(cfg, partial=True),
        ),
        options,
    )
    module = GPTNeoXAttention(config, layer_idx=0).double().eval()
    if module.rotary_ndims != cfg.rope_dims:
        raise ValueError(f"GPTNeoXAttention rotates {module.rotary_ndims} features per head, the spec {cfg.rope_dims}")

    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    with hf_implementation(module.config, options) as config:

        def forward(xt):
            cos_sin = rotary_tables(cfg, options, GPTNeoXRotaryEmbedding(config), xt)
            return module(xt, attention_mask=hf_mask(config, cfg, xt, padding), position_embeddings=cos_sin)[0]

        description = f"transformers GPTNeoXAttention ({options.implementation})"
        return hf_forward("hf-gpt-neox", module, description, x, forward, **rotary_precision(options))


def _config(module) -> MHAConfig:
    """The GPTNeoXAttention instance's configuration: heads, bias, and its partial rotary (rotary_ndims)."""
    config = module.config
    rope = hf_rope(module, config, module.head_size, partial=True)  # rotary_ndims is the module's own
    qkv = module.query_key_value
    return MHAConfig(
        **hf_attention_fields(module, qkv, config.num_attention_heads, module.head_size),
        bias=qkv.bias is not None,
        **rope.half_fields(),
        rope_dims=module.rotary_ndims,
    )


# With one query head per kv group (no grouping here), Megatron's per-group packing is exactly
# GPT-NeoX's per-head packing: [q_h; k_h; v_h] for each head h.
PACKING = fused_qkv("query_key_value", "dense", pack_groups, unpack_groups)

LAYOUT = Layout(
    name="hf-gpt-neox",
    module=MODULE,
    description="GPT-NeoX / Pythia: query_key_value (3E, E) packed per head [q_h; k_h; v_h]; dense",
    packing=PER_HEAD,
    scale="1/sqrt(d_k)",
    rotary="half (rotate_half) on the first rotary_pct * d_k features of each head (partial rotary)",
    source="transformers/models/gpt_neox/modeling_gpt_neox.py",
    split="query_key_value(x).view(B, N, H, 3*d).transpose(1, 2).chunk(3, dim=-1) -> q, k, v (B, H, N, d)",
    rules=(
        *classic_heads(MODULE),
        default_scale(MODULE),
        rotary_is(("half",), MODULE, partial=True),
    ),
    **PACKING,
    notes=(
        "rope_dims = int(d_k * rotary_pct) (config.rope_parameters['partial_rotary_factor'] in transformers 5); "
        "Pythia uses rotary_pct = 0.25",
        "bias: config.attention_bias (on by default) puts a bias on both layers",
        "float32 inside a float64 model: eager attention's softmax (softmax(..., dtype=torch.float32)) and the "
        "rotary module's angles (inv_freq in torch.float); SDPA with float64 (cos, sin) keeps float64",
    ),
    runner=_gpt_neox,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.GPTNeoXAttention",), _config, PACKING["shapes"], _forward),
    example={"rope": "half", "rope_dims": 2},
    variants=("rope_scaling",),
)
