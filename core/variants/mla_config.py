"""MLA's configuration, apart from its entry (`core.variants.mla`): its field names, YaRN's scale, its layers, its options.

`core.variants.mla` (the entry) and `core.variants.mla_diagnose` (what diagnose knows of it) both read these, so
neither imports the other's module for them (issue 42: the two imported each other, hidden by an import at the
bottom of ``mla``). NumPy-free: plain data and `math`.
"""

from __future__ import annotations

import math

from ..rope_scaling import validate_rope_scaling
from ._entry import switch_option, value_option

KV_RANK, Q_RANK, NOPE, ROPE, V_DIM, INTERLEAVE = (
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
)


def yarn_mscale(factor: float, k: float) -> float:
    """YaRN's ``m(s, k)`` (transformers' ``yarn_get_mscale``): 1 for ``s <= 1``, else ``0.1 k ln(s) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0


def softmax_scale(head_dim: int, rope_scaling: dict | None) -> float:
    """``head_dim^-1/2``, times ``m(factor, mscale_all_dim)^2`` with a scaled rope and ``mscale_all_dim`` set.

    transformers' ``yarn_apply_mscale``: only a non-default rope type with a nonzero ``mscale_all_dim`` changes it;
    ``mscale`` itself never does (it acts on the rotary's cos and sin, over ``m(f, mscale_all_dim)``).
    """
    scale = 1.0 / math.sqrt(head_dim)  # MHAConfig's own default, bit for bit (models._from_module)
    scaling = validate_rope_scaling(rope_scaling)
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


# DeepSeek V3's attention at a small size, every size distinct: 3 heads, latent 10, nope 4 + rope 6 = d_k 10, d_v 5;
# YaRN (factor 4) with mscale != mscale_all_dim, so both of its effects (cos/sin and the softmax scale) show.
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4, mscale=0.8, mscale_all_dim=0.9)
DEEPSEEK_V3_LIKE: dict = dict(
    d_model=24,
    n_heads=3,
    q_lora_rank=7,
    kv_lora_rank=10,
    qk_nope_head_dim=4,
    qk_rope_head_dim=6,
    v_head_dim=5,
    causal=True,
    bias=False,
    rope_scaling=YARN,
)
# DeepSeek V2-Lite: no query LoRA (one q_proj), attention_bias on, adjacent-pair rotary without scaling.
DEEPSEEK_V2_LITE_LIKE: dict = dict(
    d_model=20, n_heads=4, kv_lora_rank=6, qk_nope_head_dim=3, qk_rope_head_dim=4, v_head_dim=5, causal=True, bias=True
)

# ``mha-rosetta diagnose``'s options for MLA (`Variant.cli`): --kv-lora-rank switches it on, the others are its sizes.
_NEEDS = "--kv-lora-rank"


def _size(flag: str, field: str, help: str, rank: int):
    return value_option(flag, field, help, rank=rank, needs=_NEEDS, type=int, metavar="N")


CLI = (
    value_option(_NEEDS, KV_RANK, "MLA (DeepSeek V2/V3): the latent's width", rank=90, type=int, metavar="N"),
    _size("--q-lora-rank", Q_RANK, "MLA's low-rank query's width (default: one q_proj)", 91),
    _size("--qk-nope-head-dim", NOPE, "MLA: each head's un-rotated query/key features", 92),
    _size("--qk-rope-head-dim", ROPE, "MLA: the rotated features, of one key head all heads share", 93),
    _size("--v-head-dim", V_DIM, "MLA: the value head size (never the key's)", 94),
    switch_option(
        "--no-rope-interleave",
        {INTERLEAVE: False},
        "MLA rotates with rotate_half (rope_interleave=False; default: adjacent pairs, DeepSeek V2/V3)",
        rank=95,
        needs=_NEEDS,
    ),
)
