"""``hf-mistral``: Hugging Face ``MistralAttention`` (transformers/models/mistral/modeling_mistral.py).

Llama's four linears without bias (`_hf_decoder`); every layer attends to ``config.sliding_window`` keys
counting its own (Mistral 7B v0.1: 4096), by the mask ``MistralModel`` builds
(``create_sliding_window_causal_mask``: ``kv_idx > q_idx - sliding_window``, the spec's ``window``).
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import LLAMA_LIKE_EXAMPLE, Decoder, decoder_layout, field_is

MODULE = "MistralAttention"

DECODER = Decoder(
    **hf_names(MODULE),
    description="Mistral: Llama's q_proj/k_proj/v_proj/o_proj without bias; config.sliding_window on every layer",
    variants=("window",),
    config_kwargs=lambda cfg: {"sliding_window": cfg.window},
    rules=(field_is(MODULE, "bias", (False,), "has no biases (nn.Linear(..., bias=False))"),),
    notes=(
        "window: key j is seen by query i iff i - W < j <= i (W keys, the query's own included); FlashAttention "
        "spells it window_size=(W-1, 0): transformers #29623 was this off-by-one between the two",
        "float32 inside a float64 model: eager attention's softmax and the rotary module's angles; SDPA with "
        "float64 (cos, sin) keeps float64",
    ),
    example={**LLAMA_LIKE_EXAMPLE, "window": 3},
)

LAYOUT = decoder_layout(DECODER)
