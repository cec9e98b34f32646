"""DeepSeek's multi-head latent attention (MLA; DeepSeek V2/V3, Kimi K2, Mistral 4): the spec's float64 formulas.

``DeepseekV3Attention`` (transformers 5.25) with ``R = kv_lora_rank``, ``dn = qk_nope_head_dim``,
``dr = qk_rope_head_dim``, ``dv = v_head_dim``, ``Dk = dn + dr``::

    q        = W_qb RMSNorm(W_qa x + b_qa)      (q_lora_rank set; else q = W_q x, no bias)   (B, Nq, H*Dk)
    q_h      = [q_nope_h (dn) | q_rot_h (dr)]
    [c | k_pe] = W_kva x + b_kva                 (B, Nk, R + dr): the latent and ONE rotary key, shared by all heads
    c        = RMSNorm(c)                        stage kv_latent: what the cache holds, with rot(k_pe) (stage k_rope)
    k_nope_h = W_UK_h c,   v_h = W_UV_h c        W_UK = w_k (H*dn, R), W_UV = w_v (H*dv, R): kv_b_proj's rows, per head
    k_h      = [k_nope_h | rot(k_pe)],  q_h = [q_nope_h | rot(q_rot_h)]
    scale    = Dk^-1/2 * m(factor, mscale_all_dim)^2     (YaRN with mscale_all_dim, `yarn_apply_mscale`)

The spec's canonical parameters under MLA: ``w_q`` is ``q_b_proj`` (H*Dk, q_lora_rank) (``q_proj`` (H*Dk, D) without
q_lora_rank), ``w_k`` and ``w_v`` are the key and value rows of ``kv_b_proj``, de-interleaved (`split_kv_b`), ``w_o``
is ``o_proj``; the new ones are ``w_q_a``/``b_q_a``/``q_a_norm`` (``q_a_proj``, ``q_a_layernorm``) and
``w_kv_a``/``b_kv_a``/``kv_a_norm`` (``kv_a_proj_with_mqa``, ``kv_a_layernorm``). ``attention_bias`` biases only
``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``: ``b_q``, ``b_k``, ``b_v`` never exist (`base_shapes`).

The rotary acts on the LAST ``dr`` features of each query and key head (HF concatenates ``(q_pass, q_rot)``),
with ``rope`` resolved from ``rope_interleave`` (``"interleaved"``: adjacent pairs, DeepSeek V2 always and V3 by
default; ``"half"``: rotate_half) and ``rope_dims = dr``. The scores read the expanded per-head keys: that is the
``naive`` form; the ``absorbed`` form (`absorbed_context`, in `core.variants.mla_forms`) computes the same
numbers as multi-query attention over the latent.
"""

from __future__ import annotations

import numpy as np

from .._validate import require_bool, require_positive_int
from ._diagnose import DiagnoseSpec
from ._entry import BenchSpec, CaseSpec, Config, ConfigField, Explanation, ParamSpec, StageSpec, Variant, numbers
from ._shared import OUR_ADAPTERS

# The field names, YaRN's scale, the layers and the options live in `mla_config`, which `mla_diagnose` reads too
# (re-exported here: ``from mha_rosetta.core.variants.mla import DEEPSEEK_V3_LIKE`` keeps working).
from .mla_config import (
    CLI,
    DEEPSEEK_V2_LITE_LIKE,
    DEEPSEEK_V3_LIKE,
    INTERLEAVE,
    KV_RANK,
    NOPE,
    Q_RANK,
    ROPE,
    V_DIM,
    softmax_scale,
)
from .mla_config import YARN as YARN  # re-exported: the tests import it from here
from .mla_config import yarn_mscale as yarn_mscale
from .mla_diagnose import DIAGNOSE  # what diagnose knows of MLA

# The ops libraries whose adapters apply MLA (`Variant.implemented_by`), in their naive and absorbed strategies.
MLA_ADAPTERS = OUR_ADAPTERS
# The only strategies that run it (`Variant.strategies`): its two forms, the names `backends._mla` and core.mla_forms use.
STRATEGIES = ("naive", "absorbed")
# The sizes MLA owns besides kv_lora_rank, which switches it on (each None unless MLA is on).
SIZES = (Q_RANK, NOPE, ROPE, V_DIM)
CONFIG_FIELDS = (
    ConfigField(Q_RANK, None, "int | None"),
    ConfigField(KV_RANK, None, "int | None"),
    ConfigField(NOPE, None, "int | None"),
    ConfigField(ROPE, None, "int | None"),
    ConfigField(V_DIM, None, "int | None"),
    ConfigField(INTERLEAVE, True, "bool"),
)


def mla_on(cfg: Config) -> bool:
    """Whether ``cfg`` is multi-head latent attention (``kv_lora_rank`` set)."""
    return getattr(cfg, KV_RANK, None) is not None


def rope_style(interleave: bool) -> str:
    """The spec's rotary pairing for ``rope_interleave``: adjacent pairs (True) or rotate_half (False)."""
    return "interleaved" if interleave else "half"


def _refuse_without_mla(cfg: Config) -> dict:
    for name in SIZES:
        if getattr(cfg, name) is not None:
            raise ValueError(
                f"MHAConfig.{name}={getattr(cfg, name)!r} is a size of multi-head latent attention, which needs "
                f"{KV_RANK} (the latent's width; None switches MLA off)"
            )
    return {}


def _must_equal(name: str, given, expected, why: str) -> None:
    if given is not None and given != expected:
        raise ValueError(f"MHAConfig.{name}={given!r} contradicts MLA: it must be {expected!r} ({why})")


def validate(cfg: Config) -> dict:
    """The MLA fields' rules; with MLA on, the resolved d_k, d_v, n_kv_heads, rope, rope_dims and scale."""
    require_bool(INTERLEAVE, getattr(cfg, INTERLEAVE))
    if not mla_on(cfg):
        return _refuse_without_mla(cfg)
    require_positive_int(KV_RANK, cfg.kv_lora_rank)
    for name, what in ((ROPE, "the one rotary key head every head shares"), (NOPE, "each head's un-rotated part")):
        if getattr(cfg, name) is None:
            raise ValueError(f"MHAConfig.{KV_RANK}={cfg.kv_lora_rank} needs {name} ({what}), got None")
        require_positive_int(name, getattr(cfg, name))
    if cfg.v_head_dim is None:
        raise ValueError(
            f"MHAConfig.{KV_RANK}={cfg.kv_lora_rank} needs {V_DIM}, the value head size: it differs from the "
            f"key's ({NOPE} + {ROPE}) and is never taken from it (llama.cpp #7327)"
        )
    require_positive_int(V_DIM, cfg.v_head_dim)
    if cfg.q_lora_rank is not None:
        require_positive_int(Q_RANK, cfg.q_lora_rank)
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"MHAConfig.{ROPE} rotates pairs of features, so it must be even, got {cfg.qk_rope_head_dim}")
    d_k, style = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, rope_style(cfg.rope_interleave)
    _must_equal("d_k", cfg.d_k, d_k, f"the query/key head is {NOPE} + {ROPE}")
    _must_equal("d_v", cfg.d_v, cfg.v_head_dim, f"the value head is {V_DIM}")
    _must_equal("n_kv_heads", cfg.n_kv_heads, cfg.n_heads, "every head expands its own keys and values from the latent")
    _must_equal("rope", cfg.rope, style, f"MLA rotates its {ROPE} features in the pairing {INTERLEAVE} names")
    _must_equal("rope_dims", cfg.rope_dims, cfg.qk_rope_head_dim, f"MLA rotates exactly the last {ROPE} features")
    for name in ("kdim", "vdim"):
        _must_equal(name, getattr(cfg, name), cfg.d_model, "keys and values come from one latent of the tokens")
    if cfg.bias == "qkv":
        raise ValueError(
            "MHAConfig.bias='qkv' contradicts MLA: attention_bias biases q_a_proj, kv_a_proj_with_mqa and o_proj "
            "(bias=True) or nothing (bias=False)"
        )
    if cfg.qk_norm is not None:
        raise ValueError(f"MHAConfig.qk_norm={cfg.qk_norm!r} with MLA: its norms are on the latents, not on q and k")
    scale = softmax_scale(d_k, cfg.rope_scaling) if cfg.scale is None else cfg.scale
    return dict(
        d_k=d_k, d_v=cfg.v_head_dim, n_kv_heads=cfg.n_heads, rope=style, rope_dims=cfg.qk_rope_head_dim, scale=scale
    )


def split_kv_b(kv_b: np.ndarray, n_heads: int, nope: int, v_head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(w_k, w_v) = (W_UK (H*dn, R), W_UV (H*dv, R)) from ``kv_b_proj.weight`` (H*(dn+dv), R), head h's rows [k_nope_h | v_h]."""
    per_head = kv_b.reshape(n_heads, nope + v_head_dim, -1)  # (H, dn + dv, R) view
    return (
        per_head[:, :nope].reshape(n_heads * nope, -1),  # (H*dn, R) copy
        per_head[:, nope:].reshape(n_heads * v_head_dim, -1),  # (H*dv, R) copy
    )


def fuse_kv_b(w_k: np.ndarray, w_v: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `split_kv_b`: ``kv_b_proj.weight``, each head's key rows then its value rows (a copy)."""
    k = w_k.reshape(n_heads, -1, w_k.shape[-1])  # (H, dn, R) view
    v = w_v.reshape(n_heads, -1, w_v.shape[-1])  # (H, dv, R) view
    return np.concatenate([k, v], axis=1).reshape(-1, w_k.shape[-1])  # (H*(dn+dv), R) copy


def q_lora_on(cfg: Config) -> bool:
    return mla_on(cfg) and cfg.q_lora_rank is not None


def base_shapes(cfg: Config) -> dict:
    """The base weights and biases as MLA has them (`Variant.base_shapes`): kv_b_proj's halves, no q/k/v biases."""
    H, R = cfg.n_heads, cfg.kv_lora_rank
    q_in = cfg.d_model if cfg.q_lora_rank is None else cfg.q_lora_rank
    shapes = dict(w_q=(H * cfg.d_k, q_in), w_k=(H * cfg.qk_nope_head_dim, R), w_v=(H * cfg.d_v, R))
    return dict(shapes, b_q=None, b_k=None, b_v=None)


def _shape(on, *dims):
    return lambda cfg: tuple(d(cfg) for d in dims) if on(cfg) else None


def _biased(on):
    return lambda cfg: on(cfg) and cfg.bias is True


# The down-projections N(0, 0.2^2) (about 1/sqrt(d_model) at the cases' widths 16-32); the latent norms' weights
# 1 + 0.3 N(0, 1) as QK-norm's, so that a forgotten norm weight shows; biases as the others'.
KV_PARAMS = (
    ParamSpec(
        "w_kv_a", KV_RANK, _shape(mla_on, lambda c: c.kv_lora_rank + c.qk_rope_head_dim, lambda c: c.d_model), 0.0, 0.2
    ),
    ParamSpec("b_kv_a", KV_RANK, _shape(_biased(mla_on), lambda c: c.kv_lora_rank + c.qk_rope_head_dim), 0.0, 0.1),
    ParamSpec("kv_a_norm", KV_RANK, _shape(mla_on, lambda c: c.kv_lora_rank), 1.0, 0.3),
)
Q_PARAMS = (
    ParamSpec("w_q_a", Q_RANK, _shape(q_lora_on, lambda c: c.q_lora_rank, lambda c: c.d_model), 0.0, 0.2),
    ParamSpec("b_q_a", Q_RANK, _shape(_biased(q_lora_on), lambda c: c.q_lora_rank), 0.0, 0.1),
    ParamSpec("q_a_norm", Q_RANK, _shape(q_lora_on, lambda c: c.q_lora_rank), 1.0, 0.3),
)
KV_STAGES = (
    StageSpec(
        "latent",
        "kv_latent",
        "RMSNorm(c), c the first kv_lora_rank features of x @ w_kv_a.T: cached",
        before="q",
        shape=("B", "Nk", KV_RANK),
    ),
    StageSpec(
        "latent",
        "k_rope",
        "rot(k_pe): the one rotated key head every head shares, cached beside the latent",
        before="q",
        shape=("B", "Nk", ROPE),
    ),
)
Q_STAGES = (
    StageSpec(
        "latent",
        "q_latent",
        "RMSNorm(x @ w_q_a.T + b_q_a): what q_b_proj (w_q) reads",
        before="q",
        shape=("B", "Nq", Q_RANK),
    ),
)


CHECK_CASES = (
    CaseSpec(
        "mla",
        "DeepSeek V3's latent attention: q and kv LoRA, shared rotary key, d_v != d_k, YaRN's mscale on the softmax",
        DEEPSEEK_V3_LIKE,
        dict(batch=2, q_tokens=7, dtypes=("float64",), seed=80),
    ),
    CaseSpec(
        "mla_v2_lite",
        "DeepSeek V2-Lite's: one q_proj (no q_lora_rank), attention_bias on kv_a_proj_with_mqa and o_proj only",
        DEEPSEEK_V2_LITE_LIKE,
        dict(batch=2, q_tokens=6, dtypes=("float64",), seed=81),
    ),
)
DECODE_CASES = (
    CaseSpec(
        "mla",
        "DeepSeek V3's latent attention through a cache: the latent and the rotated shared key, YaRN positions",
        DEEPSEEK_V3_LIKE,
        dict(batch=2, tokens=8, prefill=3, step=2, seed=180),
    ),
)

# The explainer's demonstration (`explain.variants.DEMO`: 6 heads, d_k 4, rotate_half) as MLA: nope 2 + rope 2, d_v 3.
DEMO_ON = dict(
    kv_lora_rank=8, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, d_v=3, rope_dims=2, rope_interleave=False
)
DEMO_OFF = dict(dict.fromkeys(SIZES), kv_lora_rank=None, d_v=4, rope_dims=4, rope_interleave=True)
# DeepSeek V3's sizes (config.json): 128 heads, kv_lora_rank 512, nope 128 + rope 64, v 128.
V3_SIZES = dict(n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def cache_numbers_per_token(
    n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int
) -> dict:
    """Numbers a token adds to the cache: the latent's ``kv_lora_rank + d_rope``, the expanded ``H (d_k + d_v)``.

    The expanded cache is what plain attention of these head sizes (``2 H d`` with ``d_k = d_v = d``) and
    transformers 4.57's MLA (which cached the expanded keys and values) hold; 5.17 and later cache the latent.
    """
    latent = kv_lora_rank + qk_rope_head_dim
    expanded = n_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)
    return dict(latent=latent, expanded=expanded, ratio=expanded / latent)


def explain(demo) -> Explanation:
    from .mla_algebra import form_difference  # the absorbed form on the demonstration (NumPy only)

    on, params, stages, _, _ = demo.run("mla")
    v3 = cache_numbers_per_token(**V3_SIZES)
    return Explanation(
        f"{KV_RANK}, {NOPE}, {ROPE}, {V_DIM} ({Q_RANK}, {INTERLEAVE})",
        "[c | k_pe] = x W_kva^T; c = RMSNorm(c); k_h = [W_UK_h c | rot(k_pe)]; v_h = W_UV_h c; "
        "scale = (d_nope + d_rope)^-1/2 m(factor, mscale_all_dim)^2",
        "the projections and head sizes: every head's keys and values come from one latent; the scores as ever",
        [
            (
                "Hugging Face",
                "DeepseekV2/V3Attention, Mistral4Attention: kv_a_proj_with_mqa, kv_a_layernorm, "
                "kv_b_proj (rows per head [k_nope_h | v_h]), q_a_proj / q_b_proj or q_proj",
            ),
            ("spec", "w_kv_a, kv_a_norm; w_k = W_UK, w_v = W_UV (core.variants.mla.split_kv_b); w_q = q_b_proj"),
            ("absorbed (decode)", "q_h W_UK_h against the latent c, then W_O_h W_UV_h: MQA over [c | rot(k_pe)]"),
        ],
        [
            "why the two forms agree: q_nope_h . k_nope_h = q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, and "
            "sum_j a_hj v_hj = W_UV_h (sum_j a_hj c_j), so W_UK_h folds into the query and W_UV_h into the output "
            f"(on the demonstration they differ by {form_difference(on, params, stages):.1e}, float64)",
            f"the cache holds {v3['latent']} numbers a token at DeepSeek V3's sizes (kv_lora_rank 512 + rope 64) "
            f"against {v3['expanded']} for per-head keys and values: {v3['ratio']:.1f}x fewer",
            f"the value head ({on.d_v}) is v_head_dim, not the key's {on.d_k} (llama.cpp #7327); the shared "
            f"rotary key of token 0 is {numbers(stages['k_rope'][0, 0], 3)}",
            "YaRN acts twice: the softmax scale gets m(f, mscale_all_dim)^2, the rotary cos/sin m(f, mscale) / "
            "m(f, mscale_all_dim) (transformers #47435: mscale missing or doubled)",
        ],
    )


def explain_q_lora(demo) -> Explanation:
    _, _, stages, _, _ = demo.run("mla_q_lora")
    return Explanation(
        f"{Q_RANK} (with {KV_RANK})",
        "q = W_qb RMSNorm(W_qa x + b_qa)",
        "the query projection, before the head split",
        [
            ("Hugging Face", "q_a_proj, q_a_layernorm, q_b_proj (q_proj without q_lora_rank)"),
            ("spec", "w_q_a, b_q_a, q_a_norm; w_q = q_b_proj (H*d_k, q_lora_rank)"),
        ],
        [
            f"q_b_proj has no bias even with attention_bias; token 0's query latent: {numbers(stages['q_latent'][0, 0], 3)}"
        ],
    )


ENTRY = Variant(
    name="mla",
    summary="multi-head latent attention: keys and values expanded per head from one cached latent and one shared "
    "rotary key (DeepSeek V2/V3)",
    fields=(KV_RANK, NOPE, ROPE, V_DIM, INTERLEAVE, "norm_eps"),  # norm_eps: the latent's RMSNorm
    is_on=mla_on,
    validate=validate,
    params=KV_PARAMS,
    config_fields=CONFIG_FIELDS,
    stage_specs=KV_STAGES,
    base_shapes=base_shapes,
    check_cases=CHECK_CASES,
    decode_cases=DECODE_CASES,
    # Its cost against plain attention at the forms preset's size (d_model 512, 8 heads, d_k 64): DeepSeek's
    # proportions, nope 48 + rope 16, d_v 64, a latent of 4 * d_k (V3: 512 for d_k 128 + 64), the query's 6 * d_k
    # (V3: 1536).
    # The adapters that apply it run it in their naive and absorbed strategies (`backends._mla`); the rest refuse it.
    bench=BenchSpec(
        {Q_RANK: 384, KV_RANK: 256, NOPE: 48, ROPE: 16, V_DIM: 64, INTERLEAVE: True}, "plain", preset="forms"
    ),
    cli=CLI,
    demo_on=DEMO_ON,
    demo_off=DEMO_OFF,
    explain=explain,
    # The numpy, torch, jax and mlx adapters apply MLA, in their naive and absorbed strategies only (`backends._mla`);
    # every other adapter and oracle refuses it by name (`Variant.implemented_by`). The float64 oracles
    # (core.reference, core.grad) and the NumPy forms of `core.mla_forms` compute it.
    implemented_by=MLA_ADAPTERS,
    diagnose=DIAGNOSE,
    strategies=STRATEGIES,
)
Q_LORA_ENTRY = Variant(
    name="mla_q_lora",
    summary="MLA's low-rank query: q = W_qb RMSNorm(W_qa x + b_qa) (DeepSeek V2/V3's q_lora_rank)",
    fields=(Q_RANK, "norm_eps"),  # norm_eps: the query latent's RMSNorm
    is_on=q_lora_on,
    validate=validate,
    params=Q_PARAMS,
    stage_specs=Q_STAGES,
    demo_on=dict(DEMO_ON, q_lora_rank=5),
    demo_off={Q_RANK: None},
    explain=explain_q_lora,
    implemented_by=MLA_ADAPTERS,
    # diagnose's simulator builds the query latent with MLA's heads (`mla_heads.head_stages`); no mistake of its own.
    diagnose=DiagnoseSpec(rank=75),
    strategies=STRATEGIES,
)
