"""``hf-llama``: Hugging Face ``LlamaAttention`` (transformers/models/llama/modeling_llama.py).

Keys are relative to ``LlamaAttention`` (``model.layers.{i}.self_attn.`` in a
``LlamaForCausalLM`` checkpoint): four ``nn.Linear`` layers, ``q_proj (H*d, E)``,
``k_proj``/``v_proj (Hkv*d, E)`` (grouped-query attention) and ``o_proj (E, H*d)``, with
biases only when ``config.attention_bias`` is set (off in Llama). The module applies
rotary embeddings in the rotate-half convention; Meta's original checkpoints use the
interleaved one, and Hugging Face's conversion permutes the rows of ``q_proj`` and
``k_proj`` to move between them (``meta-llama``).

Built by the Llama-like factory (`_hf_decoder`), of which it is the plainest family: no window
(``sliding_window=False``: a ``config.sliding_window`` set by hand is refused, since Llama's code
ignores it), ``config.attention_bias`` on all four linears, and causal or not (``causal_only=False``:
the runner gives it the model's bidirectional mask for ``causal=False``).
"""

from __future__ import annotations

from ._hf import hf_names
from ._hf_decoder import Decoder, decoder_layout

MODULE = "LlamaAttention"

DECODER = Decoder(
    **hf_names(MODULE),
    description="Llama (Hugging Face): q_proj/k_proj/v_proj/o_proj as nn.Linear (out, in), grouped kv heads",
    variants=("rope_scaling",),  # Llama 3's "llama3" (and linear, dynamic, yarn) from config.rope_parameters
    config_kwargs=lambda cfg: {},
    attention_bias=True,
    sliding_window=False,
    causal_only=False,
    notes=(
        "bias: config.attention_bias puts a bias on all four layers (off for Llama itself)",
        "float32 inside a float64 model: eager attention's softmax (softmax(..., dtype=torch.float32)) and the "
        "rotary module's angles (inv_freq in torch.float); SDPA with float64 (cos, sin) keeps float64",
        "query head h reads kv head h // (n_heads / n_kv_heads) (repeat_kv), the spec's grouping",
    ),
    example={"n_kv_heads": 2, "bias": False, "rope": "half"},
)

LAYOUT = decoder_layout(DECODER)
