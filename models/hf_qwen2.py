"""``hf-qwen2``: Hugging Face ``Qwen2Attention`` (transformers/models/qwen2/modeling_qwen2.py).

Llama's four linears (`_hf_decoder`) with a bias on ``q_proj``, ``k_proj`` and ``v_proj`` and none on
``o_proj`` (``bias=True`` / ``bias=False`` in the source, no config switch): the spec's ``bias="qkv"``.
A layer of ``config.layer_types`` ``"sliding_attention"`` (``use_sliding_window``, from layer
``max_window_layers`` on) has ``sliding_window`` keys.
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import LLAMA_LIKE_EXAMPLE, Decoder, decoder_layout, field_is, sliding_config

MODULE = "Qwen2Attention"

LAYOUT = decoder_layout(
    Decoder(
        **hf_names(MODULE),
        description="Qwen2: q_proj/k_proj/v_proj with bias, o_proj without (bias='qkv'); grouped kv heads",
        variants=("qkv_bias", "window"),
        config_kwargs=lambda cfg: {**sliding_config(cfg), "use_sliding_window": cfg.window is not None},
        rules=(field_is(MODULE, "bias", ("qkv",), "biases q_proj, k_proj and v_proj, never o_proj: bias='qkv'"),),
        notes=(
            "b_o is absent: o_proj = nn.Linear(H*d, E, bias=False); a port that adds one (bias=True) adds a constant",
            "float32 inside a float64 model: eager attention's softmax and the rotary module's angles; SDPA with "
            "float64 (cos, sin) keeps float64",
        ),
        example={**LLAMA_LIKE_EXAMPLE, "bias": "qkv"},
    )
)
