"""``hf-bloom``: Hugging Face ``BloomAttention`` (transformers/models/bloom/modeling_bloom.py).

Keys are relative to ``BloomAttention`` (``transformer.h.{i}.self_attention.`` in a ``BloomForCausalLM``
checkpoint): ``query_key_value (3E, E)`` packed **per head**, ``[q_h; k_h; v_h]`` for each head h
(``view(B, N, H, 3, d)``, GPT-NeoX's packing: the per-group packing with G = H), and ``dense (E, E)``, both
``nn.Linear`` with bias. No rotary: ALiBi. ``BloomModel`` builds ``alibi (B*H, 1, N)`` = ``m_h * p_j``
(``build_alibi_tensor``: the key's position from the padding mask's cumsum) and the attention adds it with
``alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(d))``: ``m_h p_j + q.k / sqrt(d)``. Each row of that differs
from the spec's ``m_h (p_j - p_i)`` by ``m_h p_i``, a constant per row, which the softmax removes: the same
weights. The slopes are ``_get_alibi_slopes``, the spec's `core.variants.alibi_slopes`.

The attention's forward also adds a residual (``dropout_add(dense(ctx), residual, ...)``): the runner
passes zeros, so the output is the attention's alone.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._hf import hf_forward, hf_mask
from ._layout import PER_HEAD, Layout, bias_is, causal_only, classic_heads, default_scale, fused_qkv, rotary_is
from ._module_io import torch_reader, unexpressible
from ._packing import pack_groups, unpack_groups
from ._real import HF_REQUIRES, torch_state

MODULE = "BloomAttention"

SOFTMAX_FLOAT32 = "BloomAttention's softmax runs in float32 on its only path (softmax(..., dtype=torch.float32))"


def _bloom(cfg, state, x, padding, options):
    from transformers.models.bloom.modeling_bloom import BloomAttention

    module = BloomAttention(_bloom_config(cfg), layer_idx=0).double().eval()
    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _bloom_config(cfg: MHAConfig):
    """A tiny BloomConfig on the eager path (BloomAttention keeps no config: its mask is built from this one)."""
    from transformers import BloomConfig

    config = BloomConfig(hidden_size=cfg.d_model, n_head=cfg.n_heads, attention_dropout=0.0, hidden_dropout=0.0)
    config._attn_implementation = "eager"  # BloomModel's additive float mask (BloomAttention has one path)
    return config


def _forward(module, cfg, x, padding, options):
    import numpy as np
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    batch, tokens = x.shape[:2]
    keep = np.ones((batch, tokens), dtype=np.int64) if padding is None else padding.astype(np.int64)

    def forward(xt):
        alibi = build_alibi_tensor(torch.from_numpy(keep), module.num_heads, dtype=xt.dtype)  # (B*H, 1, N): m_h p_j
        mask = hf_mask(_bloom_config(cfg), cfg, xt, padding)  # eager: additive float (B, 1, N, N)
        return module(xt, torch.zeros_like(xt), alibi=alibi, attention_mask=mask)[0]

    return hf_forward(
        "hf-bloom", module, "transformers BloomAttention (alibi.baddbmm)", x, forward,
        precision="float32", note=SOFTMAX_FLOAT32,
    )  # fmt: skip


def _config(module) -> MHAConfig:
    """The BloomAttention instance's configuration: heads and ALiBi; tensor-parallel slicing changes no number."""
    if module.beta != 1.0:
        raise unexpressible(module, f"beta={module.beta}", "the spec adds the ALiBi bias once (beta = 1)")
    return MHAConfig(
        d_model=module.hidden_size,
        n_heads=module.num_heads,
        bias=True,
        causal=True,  # BloomModel always builds the causal mask
        scale=module.inv_norm_factor,
        alibi=True,
    )


PACKING = fused_qkv("query_key_value", "dense", pack_groups, unpack_groups)  # G = H: per head

LAYOUT = Layout(
    name="hf-bloom",
    module=MODULE,
    description="BLOOM: query_key_value packed per head [q_h; k_h; v_h] (3E, E) with bias; dense; ALiBi, no rotary",
    packing=PER_HEAD,
    scale="1/sqrt(d_k) (inv_norm_factor, baddbmm's alpha)",
    rotary="none: ALiBi m_h * p_j added by baddbmm (the softmax sees m_h (p_j - p_i))",
    source="transformers/models/bloom/modeling_bloom.py (BloomAttention._reshape, build_alibi_tensor)",
    split="fused_qkv.view(B, N, H, 3, d) -> [..., 0, :], [..., 1, :], [..., 2, :]",
    rules=(
        *classic_heads(MODULE),
        bias_is(True, "BLOOM's query_key_value and dense are nn.Linear with bias"),
        default_scale(MODULE),
        causal_only(MODULE),
        rotary_is((None,), MODULE),
        lambda cfg: None if cfg.alibi else f"MHAConfig.alibi=False: {MODULE} adds ALiBi to every layer's scores",
    ),
    **PACKING,
    notes=(
        "ALiBi as m_h * p_j (the key's position only): the row constant m_h p_i that the spec's m_h (p_j - p_i) "
        "adds cancels in the softmax; the pre-softmax scores differ, the weights do not",
        "slopes: _get_alibi_slopes, with the interleaved second series when H is not a power of two (6 heads: "
        "2^-2, 2^-4, 2^-6, 2^-8, then 2^-1, 2^-3)",
        "float32 inside a float64 model: the softmax (dtype=torch.float32) on the only path, so held to float32; "
        "baddbmm itself keeps float64: with the softmax patched to keep float64 the module agrees in float64",
        "the forward adds a residual (dropout_add(dense(ctx), residual)): pass zeros to read the attention alone",
    ),
    runner=_bloom,
    requires=HF_REQUIRES,
    reader=torch_reader(("transformers.BloomAttention",), _config, PACKING["shapes"], _forward),
    example={"alibi": True, "causal": True},
    variants=("alibi",),
)
