"""``hf-t5``: Hugging Face ``T5Attention`` (transformers/models/t5/modeling_t5.py).

Keys are relative to ``T5Attention`` (``encoder.block.{i}.layer.0.SelfAttention.`` in a
T5 checkpoint): ``q``, ``k``, ``v (H*d_kv, E)`` and ``o (E, H*d_kv)``, ``nn.Linear``
without bias. T5 does **not** scale the scores by ``1/sqrt(d)`` (``self.scaling = 1.0``;
its initialisation folds the factor into ``q``), so the spec needs ``scale=1.0``. The first
layer of each stack also stores ``relative_attention_bias.weight``, a learned position
bias added to the scores, which is outside the spec: use a layer without it.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._hf import hf_config, hf_forward, hf_implementation, hf_mask
from ._layout import (
    SEPARATE,
    Layout,
    bias_is,
    no_grouped_kv,
    rotary_is,
    same_head_dims,
    self_attention_widths,
    separate_linears,
    unit_scale,
)
from ._module_io import torch_reader, unexpressible
from ._real import HF_REQUIRES, torch_state

MODULE = "T5Attention"


def _t5(cfg, state, x, padding, options):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = hf_config(
        T5Config(d_model=cfg.d_model, d_kv=cfg.d_k, num_heads=cfg.n_heads, dropout_rate=0.0, is_decoder=cfg.causal),
        options,
    )
    module = T5Attention(config, has_relative_attention_bias=False, layer_idx=0, is_causal=cfg.causal).double().eval()

    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    with hf_implementation(module.config, options) as config:

        def forward(xt):
            return module(xt, mask=hf_mask(config, cfg, xt, padding))[0]

        description = f"transformers T5Attention ({options.implementation}, no relative bias)"
        return hf_forward("hf-t5", module, description, x, forward)


def _config(module) -> MHAConfig:
    """The T5Attention instance's configuration; the first layer's relative bias is not in the spec yet."""
    if module.has_relative_attention_bias:
        raise unexpressible(
            module,
            f"has_relative_attention_bias=True (relative_attention_bias.weight: {module.relative_attention_num_buckets}"
            f" buckets x {module.n_heads} heads, added to the scores)",
            "the relative bias is not yet in the spec; a T5 layer without it (every layer but the first) is",
        )
    return MHAConfig(
        d_model=module.d_model,
        n_heads=module.n_heads,
        d_k=module.key_value_proj_dim,
        bias=False,
        causal=bool(module.is_causal),
        scale=float(module.scaling),
    )


PACKING = separate_linears({"w_q": "q", "w_k": "k", "w_v": "v", "w_o": "o"})

LAYOUT = Layout(
    name="hf-t5",
    module=MODULE + " (has_relative_attention_bias=False)",
    description="T5: q/k/v/o nn.Linear (out, in) without bias; head size d_kv free; no 1/sqrt(d) scale",
    packing=SEPARATE,
    scale="1 (no scaling)",
    rotary="none (relative position bias on the first layer, outside the spec)",
    source="transformers/models/t5/modeling_t5.py",
    split="q(x).view(B, N, -1, d_kv).transpose(1, 2) (the same for k and v)",
    rules=(
        no_grouped_kv(MODULE),
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        bias_is(False, "T5's q/k/v/o are nn.Linear(..., bias=False)"),
        unit_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    **PACKING,
    notes=(
        "porting T5 into a standard attention that divides by sqrt(d) shrinks every score: the softmax flattens",
        "layer 0 adds relative_attention_bias (buckets x heads) to the scores: not part of this layout",
    ),
    runner=_t5,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.T5Attention",), _config, PACKING["shapes"], _forward),
    example={"bias": False, "scale": 1.0},
)
