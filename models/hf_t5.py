"""``hf-t5``: Hugging Face ``T5Attention`` (transformers/models/t5/modeling_t5.py).

Keys are relative to ``T5Attention`` (``encoder.block.{i}.layer.0.SelfAttention.`` in a
T5 checkpoint): ``q``, ``k``, ``v (H*d_kv, E)`` and ``o (E, H*d_kv)``, ``nn.Linear``
without bias. T5 does **not** scale the scores by ``1/sqrt(d)`` (``self.scaling = 1.0``;
its initialisation folds the factor into ``q``), so the spec needs ``scale=1.0``. The first
layer of each stack (``has_relative_attention_bias=True``) also stores
``relative_attention_bias.weight (buckets, H)``, T5's learned relative position bias, added to the
scores of every layer of the stack (the later layers reuse layer 0's ``position_bias``): the spec's
``rel_buckets``/``rel_max_distance`` with ``params.rel_bias`` in the same ``(buckets, H)`` layout,
bidirectional in the encoder and past-only in the decoder (``bidirectional=not is_decoder``).
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
from ._module_io import torch_reader
from ._real import HF_REQUIRES, torch_state

MODULE = "T5Attention"


def _t5(cfg, state, x, padding, options):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = hf_config(
        T5Config(
            d_model=cfg.d_model,
            d_kv=cfg.d_k,
            num_heads=cfg.n_heads,
            dropout_rate=0.0,
            is_decoder=not cfg.rel_bidirectional if cfg.rel_buckets else cfg.causal,
            relative_attention_num_buckets=cfg.rel_buckets or 32,
            relative_attention_max_distance=cfg.rel_max_distance,
        ),
        options,
    )
    relative = cfg.rel_buckets is not None
    module = T5Attention(config, has_relative_attention_bias=relative, layer_idx=0, is_causal=cfg.causal)
    module = module.double().eval()

    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    with hf_implementation(module.config, options) as config:

        def forward(xt):
            return module(xt, mask=hf_mask(config, cfg, xt, padding))[0]

        bias = "relative bias" if module.has_relative_attention_bias else "no relative bias"
        description = f"transformers T5Attention ({options.implementation}, {bias})"
        return hf_forward("hf-t5", module, description, x, forward)


def _config(module) -> MHAConfig:
    """The T5Attention instance's configuration, with the first layer's relative bias where it has one."""
    relative = {}
    if module.has_relative_attention_bias:
        relative = {
            "rel_buckets": module.relative_attention_num_buckets,
            "rel_max_distance": module.relative_attention_max_distance,
            "rel_bidirectional": not module.is_decoder,  # compute_bias(bidirectional=(not self.is_decoder))
        }
    return MHAConfig(
        d_model=module.d_model,
        n_heads=module.n_heads,
        d_k=module.key_value_proj_dim,
        bias=False,
        causal=bool(module.is_causal),
        scale=float(module.scaling),
        **relative,
    )


PACKING = separate_linears(
    {"w_q": "q", "w_k": "k", "w_v": "v", "w_o": "o"}, {"rel_bias": "relative_attention_bias.weight"}
)

LAYOUT = Layout(
    name="hf-t5",
    module=MODULE,
    description="T5: q/k/v/o nn.Linear (out, in) without bias; head size d_kv free; no 1/sqrt(d) scale",
    packing=SEPARATE,
    scale="1 (no scaling)",
    rotary="none; relative_attention_bias (buckets, H) on the first layer of a stack",
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
        "layer 0 stores relative_attention_bias.weight (buckets, H): column h is head h's bias by bucket, the "
        "spec's rel_bias; the later layers of the stack add layer 0's position_bias (read layer 0 for it)",
        "buckets: half exact distances, half log-spaced to max_distance; the log in float32, as T5 takes it "
        "(relative_position.float()): float64 would land on the other side of the edges at 16, 32, 64",
        "encoder: bidirectional (half the buckets per sign); decoder: past distances only (is_decoder)",
        "float64 throughout on the eager path (the softmax keeps the scores' dtype, .type_as(scores))",
    ),
    runner=_t5,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.T5Attention",), _config, PACKING["shapes"], _forward),
    example={"bias": False, "scale": 1.0, "rel_buckets": 8, "rel_max_distance": 16},
    variants=("rel_bias",),
)
