"""``meta-llama``: Meta's reference ``Attention`` (llama/model.py of Meta's Llama repositories).

Keys are relative to the ``Attention`` module (``layers.{i}.attention.`` in Meta's
``consolidated.*.pth``): ``wq``, ``wk``, ``wv``, ``wo``, ``(out, in)`` like ``nn.Linear``,
no biases. The module applies rotary embeddings to *interleaved* pairs (features ``2i``
and ``2i+1``, as complex numbers). The same layer in Hugging Face's ``LlamaAttention``
(``hf-llama``) rotates halves; the conversion between the two checkpoints permutes the
rows of ``wq``/``wk`` per head (`mha_rosetta.core.rotary`), which `convert_state_dict`
applies.
"""

from __future__ import annotations

from ._layout import (
    SEPARATE,
    Layout,
    bias_is,
    default_scale,
    head_dim_is_width_over_heads,
    rotary_is,
    same_head_dims,
    self_attention_widths,
    separate_linears,
)

MODULE = "Meta's llama Attention"

LAYOUT = Layout(
    name="meta-llama",
    module="Attention (Meta's llama/model.py)",
    description="Llama (Meta): wq/wk/wv/wo (out, in), no bias, interleaved rotary pairs",
    packing=SEPARATE,
    scale="1/sqrt(d_k)",
    rotary="interleaved (pairs 2i, 2i+1, as complex numbers), every feature of a head",
    source="llama/model.py in Meta's Llama repositories",
    split="wq(x).view(B, N, H, d); wk/wv with n_kv_heads; apply_rotary_emb via view_as_complex(reshape(..., -1, 2))",
    rules=(
        head_dim_is_width_over_heads(MODULE),
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        bias_is(False, "Meta's wq/wk/wv/wo are built with bias=False"),
        default_scale(MODULE),
        rotary_is(("interleaved",), MODULE),
    ),
    **separate_linears({"w_q": "wq", "w_k": "wk", "w_v": "wv", "w_o": "wo"}),
    notes=(
        "to load into Hugging Face's LlamaAttention, permute the rows of wq and wk per head "
        "(convert_state_dict(cfg, state, 'meta-llama', 'hf-llama')); copying them unchanged gives "
        "fluent-looking wrong output",
        "Meta shards wq/wk/wv by rows and wo by columns across model-parallel ranks (consolidated.NN.pth)",
    ),
)
