"""``hf-gemma2``: Hugging Face ``Gemma2Attention`` (transformers/models/gemma2/modeling_gemma2.py).

Llama's four linears (`_hf_decoder`, biases with ``config.attention_bias``) and three changes:

* the scale is ``config.query_pre_attn_scalar ** -0.5`` (Gemma 2 27B: 144, not head_dim = 128), read from
  the module's own ``scaling``;
* ``config.attn_logit_softcapping`` (50.0): scores become ``c * tanh(s / c)`` after the scale and before
  the mask (the eager path; SDPA raises, and the model declares ``_supports_sdpa = False``);
* layers alternate by ``config.layer_types``: ``"sliding_attention"`` layers see ``sliding_window`` keys
  (the module's own ``sliding_window`` attribute), ``"full_attention"`` layers all of them.
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import LLAMA_LIKE_EXAMPLE, Decoder, decoder_layout, pre_attn_scalar, sliding_config

MODULE = "Gemma2Attention"

LAYOUT = decoder_layout(
    Decoder(
        **hf_names(MODULE),
        description="Gemma 2: Llama's linears; scale query_pre_attn_scalar**-0.5, logit softcap, sliding or global "
        "by layer",
        variants=("softcap", "window"),
        config_kwargs=lambda cfg: {
            **sliding_config(cfg),
            "query_pre_attn_scalar": pre_attn_scalar(cfg),  # the module's scaling = query_pre_attn_scalar**-0.5
            "attn_logit_softcapping": cfg.softcap,
        },
        read_extra=lambda module: {"softcap": module.attn_logit_softcapping},
        custom_scale=True,
        sdpa=False,
        attention_bias=True,
        notes=(
            "scale = query_pre_attn_scalar**-0.5 (the module's scaling), not head_dim**-0.5",
            "the softcap sits between the scale and the mask; transformers PR #32865: SDPA silently dropped it "
            "(now sdpa_attention_forward raises and the model refuses SDPA)",
            "layer_types decides sliding or global per layer: from_module reads the module's own sliding_window",
            "float32 inside a float64 model on every path: eager attention's softmax (softmax(..., "
            "dtype=torch.float32)), and SDPA cannot hold the softcap: held to float32; with the softmax patched to "
            "keep float64, eager agrees in float64 (the softcap itself runs in the scores' dtype)",
        ),
        example={**LLAMA_LIKE_EXAMPLE, "scale": 0.25, "softcap": 5.0, "window": 3},
    )
)
