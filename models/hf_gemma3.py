"""``hf-gemma3``: Hugging Face ``Gemma3Attention`` (transformers/models/gemma3/modeling_gemma3.py).

Gemma 2's attention (`hf_gemma2`: ``query_pre_attn_scalar``, sliding or global by ``layer_types``) without
its softcap (the module keeps ``attn_logit_softcapping`` but never passes it), plus:

* QK-norm over each head, ``Gemma3RMSNorm(head_dim)`` after the head split and before rotary, whose
  stored ``weight`` is zero-initialised and used as ``1 + weight``: the canonical ``q_norm`` is
  ``1 + stored`` (`separate_linears`' offsets);
* a rotary base per layer type: transformers 5.x keeps ``config.rope_parameters`` as
  ``{"sliding_attention": {..., "rope_theta": 10000.0}, "full_attention": {..., "rope_theta": 1e6}}``
  (the ``rope_local_base_freq`` of the 4.x configs), read for the module's own ``layer_type``.
"""

from __future__ import annotations

from ._hf import hf_names, hf_rope_parameters
from ._hf_decoder import (
    LLAMA_LIKE_EXAMPLE,
    NORMS,
    Decoder,
    decoder_layout,
    field_is,
    layer_type,
    norm_eps,
    pre_attn_scalar,
)

MODULE = "Gemma3Attention"

NORM_FLOAT32 = "Gemma3RMSNorm computes in float32 (x.float(), 1.0 + weight.float()) on every path"


def _config_kwargs(cfg) -> dict:
    rope = hf_rope_parameters(cfg)
    return {
        "layer_types": [layer_type(cfg)],
        "sliding_window": cfg.window if cfg.window is not None else 4096,  # unused by a full-attention layer
        "query_pre_attn_scalar": pre_attn_scalar(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"sliding_attention": rope, "full_attention": rope},  # this layer's type is the one read
    }


LAYOUT = decoder_layout(
    Decoder(
        **hf_names(MODULE, config_class="Gemma3TextConfig"),
        description="Gemma 3: Llama's linears; q_norm/k_norm RMSNorm (d,) stored as w for 1 + w; "
        "query_pre_attn_scalar; sliding or global by layer, each with its rotary base",
        variants=("qk_norm_head", "window", "rope_scaling"),
        config_kwargs=_config_kwargs,
        read_extra=lambda module: {"qk_norm": "head", "norm_eps": norm_eps(module)},
        extras=NORMS,
        offsets={"q_norm": 1.0, "k_norm": 1.0},
        custom_scale=True,
        layer_typed_rotary=True,
        float32=(NORM_FLOAT32,),
        attention_bias=True,
        rules=(field_is(MODULE, "qk_norm", ("head",), "normalises each head's q and k (Gemma3RMSNorm(head_dim))"),),
        notes=(
            "q_norm.weight stores w and the norm multiplies by 1 + w: canonical q_norm = 1 + stored (a zero stored "
            "weight is the identity); a port that multiplies by w zeroes every query",
            "rope_parameters per layer type (5.x): sliding layers rotate with the local base (10000), global ones "
            "with 1e6; from_module reads the module's layer_type",
            "config.attn_logit_softcapping is ignored by Gemma3Attention (never passed to the attention function)",
            "float32 inside a float64 model on every path: " + NORM_FLOAT32 + ": held to float32; with the norm "
            "patched to keep float64, SDPA agrees in float64 (the cast is the only float32 step left)",
        ),
        example={**LLAMA_LIKE_EXAMPLE, "scale": 0.25, "qk_norm": "head", "window": 3},
    )
)
