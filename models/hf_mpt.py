"""``hf-mpt``: Hugging Face ``MptAttention`` (transformers/models/mpt/modeling_mpt.py).

Keys are relative to ``MptAttention`` (``transformer.blocks.{i}.attn.`` in an ``MptForCausalLM``
checkpoint): ``Wqkv (3E, E)`` packed as **blocks** ``[Q; K; V]`` (``mixed_qkv.chunk(3, dim=2)``) and
``out_proj (E, E)``, ``nn.Linear`` without bias. ``MptModel`` always passes ALiBi
(``build_mpt_alibi_tensor(H, max_seq_len)``: ``m_h * (j - (max_seq_len - 1))``, the last N columns of it
taken by the module), whatever ``attn_config.alibi`` says; with ``alibi_bias_max = 8`` (the default) its
slopes are BLOOM's, the spec's. The bias differs from the spec's ``m_h (p_j - p_i)`` by a constant per row,
which the softmax removes.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._hf import hf_forward, hf_mask
from ._layout import BLOCKS, Layout, bias_is, causal_only, classic_heads, fused_qkv, rotary_is
from ._module_io import torch_reader, unexpressible
from ._packing import pack_blocks, unpack_blocks
from ._real import HF_REQUIRES, torch_state

MODULE = "MptAttention"

SOFTMAX_FLOAT32 = "MptAttention's softmax runs in float32 on its only path (softmax(attention_scores.float()))"
MAX_SEQ_LEN = 16  # the tiny runner's config.max_seq_len (the ALiBi table's length)
# MptModel's attn_config.alibi_bias_max: 8, the default, gives BLOOM's slopes. The model holds it, not the
# attention module, so from_module cannot read it from an MptAttention: it reads the default's ALiBi.
ALIBI_BIAS_MAX = 8


def _mpt_config(cfg: MHAConfig, max_seq_len: int = MAX_SEQ_LEN):
    """A tiny MptConfig on the eager path (MptAttention keeps no config: the mask is built from this one)."""
    from transformers import MptConfig

    config = MptConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        max_seq_len=max_seq_len,
        attn_config={"softmax_scale": cfg.scale, "attn_pdrop": 0},
    )
    config._attn_implementation = "eager"  # MptModel's mask: create_causal_mask(...).to(torch.bool)
    return config


def _mpt(cfg, state, x, padding, options):
    from transformers.models.mpt.modeling_mpt import MptAttention

    module = MptAttention(_mpt_config(cfg, max(MAX_SEQ_LEN, x.shape[1])), layer_idx=0).double().eval()
    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    import torch
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    def forward(xt):
        alibi = build_mpt_alibi_tensor(module.n_heads, module.max_seq_length, ALIBI_BIAS_MAX)  # (H, 1, max_seq_len)
        mask = hf_mask(_mpt_config(cfg), cfg, xt, padding).to(torch.bool)  # True: masked (its masked_fill)
        return module(xt, position_bias=alibi, attention_mask=mask)[0]

    return hf_forward(
        "hf-mpt", module, "transformers MptAttention (torch attn_impl)", x, forward,
        precision="float32", note=SOFTMAX_FLOAT32 + "; the ALiBi table is float32 (slopes from .float())",
    )  # fmt: skip


def _config(module) -> MHAConfig:
    """The MptAttention instance's configuration (it keeps no config: its own attributes); clip_qkv is not the spec's.

    The ALiBi slopes are the model's (``attn_config.alibi_bias_max``, which the module does not hold): read as
    the default 8, BLOOM's slopes.
    """
    if module.clip_qkv:
        raise unexpressible(module, f"clip_qkv={module.clip_qkv}", "the spec does not clamp q, k and v")
    return MHAConfig(
        d_model=module.hidden_size,
        n_heads=module.n_heads,
        bias=module.Wqkv.bias is not None,
        causal=True,  # MptModel always builds the causal mask
        scale=float(module.softmax_scale),
        alibi=True,  # MptModel passes its ALiBi tensor to every block, whatever attn_config.alibi says
    )


PACKING = fused_qkv("Wqkv", "out_proj", pack_blocks, unpack_blocks)

LAYOUT = Layout(
    name="hf-mpt",
    module=MODULE,
    description="MPT: Wqkv (3E, E) holding [Q; K; V] blocks, out_proj, no bias; ALiBi (BLOOM's slopes), no rotary",
    packing=BLOCKS,
    scale="attn_config.softmax_scale, default 1/sqrt(d_k)",
    rotary="none: ALiBi m_h * (j - (max_seq_len - 1)) (the softmax sees m_h (p_j - p_i))",
    source="transformers/models/mpt/modeling_mpt.py (MptAttention, build_mpt_alibi_tensor)",
    split="mixed_qkv.chunk(3, dim=2); each .reshape(B, N, H, d).transpose(1, 2)",
    rules=(
        *classic_heads(MODULE),
        bias_is(False, "MPT's Wqkv and out_proj are nn.Linear(..., bias=False)"),
        causal_only(MODULE),
        rotary_is((None,), MODULE),
        lambda cfg: None if cfg.alibi else f"MHAConfig.alibi=False: {MODULE}'s model adds ALiBi to every layer",
    ),
    **PACKING,
    notes=(
        "the blocks of nn.MultiheadAttention's in_proj_weight, where BLOOM packs the same rows per head",
        "slopes: 1 / 2^(k * 8 / 2^ceil(log2 H)), reordered [odd terms; even terms][:H] when H is not a power of "
        "two: the same numbers as BLOOM's _get_alibi_slopes (with alibi_bias_max = 8)",
        "attn_config.clip_qkv (clamping q, k, v) is not in the spec: LayoutError; alibi_bias_max belongs to the "
        "model, not to MptAttention: from_module reads the default 8 (BLOOM's slopes); qk_ln is not implemented "
        "by transformers' MptAttention",
        "float32 inside a float64 model: the softmax (attention_scores.float()) and the ALiBi table (float32 "
        "slopes) on the only path: held to float32",
    ),
    runner=_mpt,
    requires=HF_REQUIRES,
    reader=torch_reader(("transformers.MptAttention",), _config, PACKING["shapes"], _forward),
    example={"bias": False, "alibi": True, "causal": True},
    variants=("alibi",),
)
