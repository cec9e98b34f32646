"""``hf-olmo2``: Hugging Face ``Olmo2Attention`` (transformers/models/olmo2/modeling_olmo2.py).

Llama's four linears (`_hf_decoder`, biases with ``config.attention_bias``) and QK-norm over the whole
projection: ``q_norm = Olmo2RMSNorm(H*d)``, ``k_norm = Olmo2RMSNorm(G*d)``, applied to ``q_proj(x)`` and
``k_proj(x)`` before the head split (``qk_norm="projection"``).
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import LLAMA_LIKE_EXAMPLE, NORMS, Decoder, decoder_layout, field_is, norm_eps

MODULE = "Olmo2Attention"

NORM_FLOAT32 = "the RMSNorm of q and k runs in float32 (hidden_states.to(torch.float32)) on every path"

LAYOUT = decoder_layout(
    Decoder(
        **hf_names(MODULE),
        description="OLMo 2: Llama's linears and q_norm (H*d,) / k_norm (G*d,) RMSNorm over the whole projection",
        variants=("qk_norm_projection",),
        config_kwargs=lambda cfg: {"rms_norm_eps": cfg.norm_eps},
        read_extra=lambda module: {"qk_norm": "projection", "norm_eps": norm_eps(module)},
        extras=NORMS,
        float32=(NORM_FLOAT32,),
        attention_bias=True,
        rules=(field_is(MODULE, "qk_norm", ("projection",), "normalises the whole q and k projections"),),
        notes=(
            "q_norm.weight (H*d,) and k_norm.weight (G*d,): rows h*d:(h+1)*d scale head h, but the statistics "
            "are taken over all H*d features; sharding the heads needs the full sum of squares (one all-reduce)",
            "float32 inside a float64 model on every path: " + NORM_FLOAT32 + ": held to float32; with the norm "
            "patched to keep float64, SDPA agrees in float64 (the cast is the only float32 step left)",
        ),
        example={**LLAMA_LIKE_EXAMPLE, "qk_norm": "projection"},
    )
)
