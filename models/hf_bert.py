"""``hf-bert``: Hugging Face ``BertAttention`` (transformers/models/bert/modeling_bert.py).

Keys are relative to ``BertAttention`` (``bert.encoder.layer.{i}.attention.`` in a
``BertModel`` checkpoint): ``self.query/key/value`` belong to ``BertSelfAttention``, which
stops at the merged heads (its output is the merged context, ``(B, N, H*d)``), and
``output.dense`` to ``BertSelfOutput``, which applies the output projection and then
dropout and ``LayerNorm(dense + input)``. ``output.LayerNorm`` is outside the spec and
outside this layout.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig

from ._hf import hf_config, hf_heads, hf_implementation, hf_mask
from ._layout import SEPARATE, Layout, bias_is, classic_heads, default_scale, rotary_is, separate_linears
from ._module_io import hf_attention_fields, to_array, torch_reader
from ._real import HF_REQUIRES, RealRun, module_shapes, torch_state

MODULE = "BertSelfAttention"


def _bert(cfg, state, x, padding, options):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertAttention

    config = hf_config(
        BertConfig(
            **hf_heads(cfg, grouped=False),
            attention_probs_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
            is_decoder=cfg.causal,
        ),
        options,
    )
    module = BertAttention(config, is_causal=cfg.causal).double().eval()
    tensors = torch_state(state)
    # BertAttention also holds output.LayerNorm, which is not attention: load the two parts strictly, apart.
    for part, prefix in ((module.self, "self."), (module.output.dense, "output.dense.")):
        part.load_state_dict(
            {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}, strict=True
        )
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    import torch

    dtype = next(module.parameters()).dtype
    xt = torch.from_numpy(x).to(dtype)
    with hf_implementation(module.self.config, options) as config, torch.no_grad():
        merged = module.self(xt, attention_mask=hf_mask(config, cfg, xt, padding))[0]  # (B, N, H*d): stops here
        output = module.output.dense(merged)
    run = RealRun(
        "hf-bert",
        "real",
        f"transformers BertSelfAttention + BertSelfOutput.dense ({options.implementation})",
        to_array(output).astype(np.float64),
        to_array(merged).astype(np.float64),
        parameters=module_shapes(module),
        note="BertSelfOutput then computes LayerNorm(dense + input): outside the spec",
    )
    if dtype != torch.float64:
        run.precision = str(dtype).removeprefix("torch.")
    return run


def _config(module) -> MHAConfig:
    """The BertAttention instance's configuration (its self-attention's heads, causal when a decoder)."""
    attention = module.self
    heads = (attention.num_attention_heads, attention.attention_head_size)
    return MHAConfig(**hf_attention_fields(attention, attention.query, *heads), bias=attention.query.bias is not None)


PACKING = separate_linears({"w_q": "self.query", "w_k": "self.key", "w_v": "self.value", "w_o": "output.dense"})

LAYOUT = Layout(
    name="hf-bert",
    module="BertAttention (self.* = BertSelfAttention, output.dense = BertSelfOutput.dense)",
    description="BERT: three nn.Linear (out, in) in BertSelfAttention; the output projection is BertSelfOutput.dense",
    packing=SEPARATE,
    scale="1/sqrt(d_k)",
    rotary="none (absolute position embeddings, outside attention)",
    source="transformers/models/bert/modeling_bert.py",
    split="self.query(x).view(B, N, H, d).transpose(1, 2) (the same for key and value)",
    rules=(
        *classic_heads(MODULE),
        bias_is(True, "BERT's query/key/value and output.dense are nn.Linear layers with a bias"),
        default_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    **PACKING,
    notes=(
        "BertSelfAttention returns the merged context (before the output projection); "
        "BertSelfOutput then computes LayerNorm(dense(context) + input)",
        "not causal (an encoder): padding masks come from BertModel as an additive (B, 1, N, N) mask",
    ),
    runner=_bert,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.BertAttention",), _config, PACKING["shapes"], _forward),
)
