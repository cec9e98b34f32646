"""``hf-gpt-oss``: Hugging Face ``GptOssAttention`` (transformers/models/gpt_oss/modeling_gpt_oss.py).

Llama's four linears with biases (`_hf_decoder`; ``config.attention_bias``, on in the released models),
plus:

* ``sinks (H,)``: one learned logit per head, concatenated to each row of scores before the softmax and
  dropped after it (``torch.cat([attn_weights, sinks])``, ``probs[..., :-1]``): the spec's ``sinks``;
* alternating layers by ``config.layer_types``: ``"sliding_attention"`` ones see ``sliding_window``
  keys (128);
* YaRN rotary (``rope_parameters["rope_type"] = "yarn"``, factor 32, its attention factor on cos and sin).

Building a ``GptOssConfig`` needs ``num_local_experts`` and ``num_experts_per_tok`` (the MoE block's).
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import Decoder, decoder_layout, field_is, sliding_config

MODULE = "GptOssAttention"

LAYOUT = decoder_layout(
    Decoder(
        **hf_names(MODULE),
        description="gpt-oss: Llama's linears with biases, sinks (H,) in the softmax, sliding or global by layer, "
        "YaRN rotary",
        variants=("sinks", "window", "rope_scaling"),
        config_kwargs=lambda cfg: {
            **sliding_config(cfg),
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
        },
        extras={"sinks": "sinks"},
        read_extra=lambda module: {"sinks": True},
        sdpa=False,
        repeated_tables=False,  # GptOssRotaryEmbedding returns cos, sin (1, N, d/2); _apply_rotary_emb splits q
        eager_softmax_float32=False,  # softmax(combined_logits, dtype=combined_logits.dtype)
        attention_bias=True,
        rules=(field_is(MODULE, "sinks", (True,), "has one sink logit per head (self.sinks)"),),
        notes=(
            "sinks: a_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik)); the row sums to less than one",
            "the model refuses SDPA (_supports_sdpa = False): sdpa_attention_forward ignores s_aux, so a module set "
            "to 'sdpa' by hand silently drops the sinks; the runner refuses it",
            "float32 inside a float64 model: only the rotary module's angles; the eager softmax keeps the scores' "
            "dtype, so eager with float64 (cos, sin) is float64 throughout",
        ),
        example={
            "n_kv_heads": 2,
            "bias": True,
            "rope": "half",
            "causal": True,
            "sinks": True,
            "window": 3,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
        },
    )
)
