"""``hf-llama``: Hugging Face ``LlamaAttention`` (transformers/models/llama/modeling_llama.py).

Keys are relative to ``LlamaAttention`` (``model.layers.{i}.self_attn.`` in a
``LlamaForCausalLM`` checkpoint): four ``nn.Linear`` layers, ``q_proj (H*d, E)``,
``k_proj``/``v_proj (Hkv*d, E)`` (grouped-query attention) and ``o_proj (E, H*d)``, with
biases only when ``config.attention_bias`` is set (off in Llama). The module applies
rotary embeddings in the rotate-half convention; Meta's original checkpoints use the
interleaved one, and Hugging Face's conversion permutes the rows of ``q_proj`` and
``k_proj`` to move between them (``meta-llama``).
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._errors import LayoutError
from ._hf import (
    hf_config,
    hf_forward,
    hf_implementation,
    hf_mask,
    hf_max_positions,
    hf_rope_parameters,
    rotary_precision,
    rotary_tables,
)
from ._layout import (
    SEPARATE,
    Layout,
    default_scale,
    rotary_is,
    same_head_dims,
    self_attention_widths,
    separate_linears,
)
from ._module_io import class_name, hf_rope, torch_reader
from ._real import HF_REQUIRES, torch_state

MODULE = "LlamaAttention"


def _llama_config(cfg, options):
    from transformers import LlamaConfig

    return hf_config(
        LlamaConfig(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.d_k,
            attention_bias=cfg.bias,
            attention_dropout=0.0,
            rope_parameters=hf_rope_parameters(cfg),
            **hf_max_positions(cfg),
        ),
        options,
    )


def run_llama(cfg, state, x, padding, options, layout="hf-llama"):
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = _llama_config(cfg, options)
    module = LlamaAttention(config, layer_idx=0).double().eval()
    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options, layout)


def _forward(module, cfg, x, padding, options, layout="hf-llama"):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with hf_implementation(module.config, options) as config:

        def forward(xt):
            cos_sin = rotary_tables(cfg, options, LlamaRotaryEmbedding(config).to(xt.dtype), xt)
            return module(xt, position_embeddings=cos_sin, attention_mask=hf_mask(config, cfg, xt, padding))[0]

        description = f"transformers LlamaAttention ({options.implementation})"
        return hf_forward(layout, module, description, x, forward, **rotary_precision(options))


def _config(module) -> MHAConfig:
    """The LlamaAttention instance's configuration: heads, kv heads and head_dim, bias, rotary from its config."""
    config = module.config
    window = getattr(config, "sliding_window", None)
    if window:  # LlamaConfig has no such field; one set by hand does nothing in Llama's code
        raise LayoutError(
            f"{class_name(module)}'s config has sliding_window={window!r}, which LlamaAttention and LlamaModel ignore "
            "(no window is applied): remove it, or build the family that applies it (MistralAttention: hf-mistral)"
        )
    rope = hf_rope(module, config, module.head_dim)  # LlamaRotaryEmbedding rotates every feature
    return MHAConfig(
        d_model=module.q_proj.in_features,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        d_k=module.head_dim,
        bias=module.q_proj.bias is not None,
        causal=bool(module.is_causal),
        scale=module.scaling,
        rope="half",
        rope_base=rope.rope_base,
        rope_scaling=rope.rope_scaling,  # Llama 3's "llama3", or linear / dynamic / yarn
    )


PACKING = separate_linears({"w_q": "q_proj", "w_k": "k_proj", "w_v": "v_proj", "w_o": "o_proj"})

LAYOUT = Layout(
    name="hf-llama",
    module=MODULE,
    description="Llama (Hugging Face): q_proj/k_proj/v_proj/o_proj as nn.Linear (out, in), grouped kv heads",
    packing=SEPARATE,
    scale="1/sqrt(d_k)",
    rotary="half (rotate_half), every feature of a head",
    source="transformers/models/llama/modeling_llama.py",
    split="q_proj(x).view(B, N, -1, d).transpose(1, 2); k/v the same with Hkv heads; repeat_kv for the groups",
    rules=(
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        default_scale(MODULE),
        rotary_is(("half",), MODULE),
    ),
    **PACKING,
    notes=(
        "bias: config.attention_bias puts a bias on all four layers (off for Llama itself)",
        "float32 inside a float64 model: eager attention's softmax (softmax(..., dtype=torch.float32)) and the "
        "rotary module's angles (inv_freq in torch.float); SDPA with float64 (cos, sin) keeps float64",
        "query head h reads kv head h // (n_heads / n_kv_heads) (repeat_kv), the spec's grouping",
    ),
    runner=run_llama,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.LlamaAttention",), _config, PACKING["shapes"], _forward),
    example={"n_kv_heads": 2, "bias": False, "rope": "half"},
    variants=("rope_scaling",),  # Llama 3's "llama3" (and linear, dynamic, yarn) from config.rope_parameters
)
