"""``hf-qwen3``: Hugging Face ``Qwen3Attention`` (transformers/models/qwen3/modeling_qwen3.py).

Llama's four linears (`_hf_decoder`, biases with ``config.attention_bias``) and QK-norm over each
head: ``q_norm``/``k_norm`` are ``Qwen3RMSNorm(head_dim)``, applied after ``view(B, N, -1, d)`` and
before rotary, one ``(d,)`` weight shared by every head (``qk_norm="head"``). Layers of
``config.layer_types`` ``"sliding_attention"`` have ``sliding_window`` keys.
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import LLAMA_LIKE_EXAMPLE, NORMS, Decoder, decoder_layout, field_is, norm_eps, sliding_config

MODULE = "Qwen3Attention"

NORM_FLOAT32 = "the RMSNorm of q and k runs in float32 (hidden_states.to(torch.float32)) on every path"

LAYOUT = decoder_layout(
    Decoder(
        **hf_names(MODULE),
        description="Qwen3: Llama's linears and q_norm/k_norm RMSNorm (d,) over each head, before rotary",
        variants=("qk_norm_head", "window"),
        config_kwargs=lambda cfg: {
            **sliding_config(cfg),
            "use_sliding_window": cfg.window is not None,
            "rms_norm_eps": cfg.norm_eps,
        },
        read_extra=lambda module: {"qk_norm": "head", "norm_eps": norm_eps(module)},
        extras=NORMS,
        float32=(NORM_FLOAT32,),
        attention_bias=True,
        rules=(field_is(MODULE, "qk_norm", ("head",), "normalises each head's q and k (Qwen3RMSNorm(head_dim))"),),
        notes=(
            "QK-norm over the head (d,), where OLMo 2 normalises the whole projection (H*d,): the one difference "
            "between the two, and the statistics differ (the mean over d features vs over H*d)",
            "float32 inside a float64 model on every path: " + NORM_FLOAT32 + " (plus eager's softmax and the "
            "rotary angles): held to float32, as no path avoids the norm; with the norm patched to keep float64, SDPA "
            "agrees in float64 (tests/test_from_module.py): the cast is the only float32 step left",
        ),
        example={**LLAMA_LIKE_EXAMPLE, "qk_norm": "head"},
    )
)
