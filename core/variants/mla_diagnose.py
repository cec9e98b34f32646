"""What ``mha-rosetta diagnose`` knows of MLA (`core.variants.mla`'s `DiagnoseSpec`): the mistakes porters make.

MLA forgotten is no mistake anyone makes (a layer with MLA's weights cannot run without it); these are the
ones on record, each a `DiagnoseCause` simulated at a place of diagnose's pipeline:

- YaRN's ``m(f, mscale_all_dim)^2`` missing from the softmax scale, or ``m(f, mscale)^2`` used where
  ``mscale_all_dim`` belongs (transformers #47435, Megatron-LM #1429): the scale (``scale``);
- the rotary interleave permutation (transformers #39687, vllm #26995): V3's interleaved path writes each rotated
  key's features de-interleaved, ``[evens | odds]``, and caches ``k_rot`` so; the scores are unchanged only
  when the queries are permuted the same way. A port that reads that cached ``k_rot`` (or transformers' stage)
  against queries in the pairs' order scores feature ``2i`` against ``i``: the keys' rotary features permuted
  after rotary (``rotated``);
- the value head size taken from the key's (llama.cpp #7327): each head's ``d_v`` values read from column
  ``h * d_k`` of the merged values, the key head's stride (``values``; it runs where ``d_k < d_v``);
- ``W_UK`` transposed in the absorbed form (mlx-lm #1715, Megatron-LM #3193): ``q_nope_h @ W_UK_h^T`` where
  ``q_nope_h @ W_UK_h`` belongs, which only runs when ``d_nope == kv_lora_rank``; it scores as the naive form
  with each head's ``W_UK_h`` block transposed (``params``).

And two of its decode loop (causes with ``decode``, hypotheses of `diagnose_decode`, whose simulated loop keeps
MLA's latent cache): the cache holding the latent before ``kv_a_layernorm``, and ``k_rope`` cached before rotary,
each read as it is (``cached``). ``DeepseekV3Attention`` caches both after them (``cache.update(kv_nope, k_rot)``
follows the norm and the rotary), as DeepSeek's own ``kv_cache = kv_norm(kv)`` and ``pe_cache`` of the rotated key.

The NumPy candidate builds MLA's heads as ``DeepseekV3Attention`` does (`_latent_heads`, the candidate's
``latent`` step), apart from `core.variants.mla_heads`, which the simulator reads. NumPy only.
"""

from __future__ import annotations

import math

import numpy as np

from ..rope_scaling import validate_rope_scaling
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import Config
from .mla_config import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE, softmax_scale, yarn_mscale

CODE = "mla"


def _mscales(cfg: Config) -> tuple[float, float] | None:
    """(m(f, mscale), m(f, mscale_all_dim)) of a YaRN scaling with ``mscale_all_dim``, or None (no m^2 on the scale)."""
    scaling = validate_rope_scaling(cfg.rope_scaling)
    if scaling is None or not scaling.get("mscale_all_dim"):
        return None
    factor = scaling["factor"]
    return yarn_mscale(factor, scaling.get("mscale") or 0.0), yarn_mscale(factor, scaling["mscale_all_dim"])


def _squares(cfg: Config) -> tuple[float, float]:
    """(m(f, mscale)^2, m(f, mscale_all_dim)^2) of a configuration whose scale carries them (the causes' `when`)."""
    m = _mscales(cfg)
    assert m is not None, "only asked where YaRN's mscale_all_dim is set"
    return m[0] ** 2, m[1] ** 2


def _scaled_by_yarn(cfg: Config) -> bool:
    """The spec's scale is MLA's own (not one given) and carries m(f, mscale_all_dim)^2 != 1."""
    m = _mscales(cfg)
    return m is not None and m[1] != 1.0 and cfg.scale == softmax_scale(cfg.d_k, cfg.rope_scaling)


def _mscales_differ(cfg: Config) -> bool:
    m = _mscales(cfg)
    return _scaled_by_yarn(cfg) and m is not None and m[0] != m[1]


def _scale_read(cfg: Config, mistake) -> float:
    """The softmax scale a candidate with ``mistake`` multiplies the scores by (the spec's: ``cfg.scale``)."""
    if mistake == "mscale_missing":
        return 1.0 / math.sqrt(cfg.d_k)
    if mistake == "mscale_for_all_dim":
        return _squares(cfg)[0] / math.sqrt(cfg.d_k)
    return cfg.scale


def _planted_scale(cfg: Config, mistake) -> float:
    """``DeepseekV3Attention.__init__``'s scaling, with the candidate's mistake (written apart from `_scale_read`)."""
    if cfg.scale != softmax_scale(cfg.d_k, cfg.rope_scaling):
        return cfg.scale  # a scale given: the module's own
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    scaling = qk_head_dim**-0.5
    rope = validate_rope_scaling(cfg.rope_scaling) or {}
    k = rope.get("mscale" if mistake == "mscale_for_all_dim" else "mscale_all_dim")
    if k and mistake != "mscale_missing":
        mscale = 0.1 * k * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0  # yarn_get_mscale
        scaling = scaling * mscale * mscale
    return scaling


def deinterleave_order(d_rope: int) -> np.ndarray:
    """V3's order of the rotated features with ``rope_interleave``: ``[evens | odds]`` (transformers writes k_rot so)."""
    return np.concatenate([np.arange(0, d_rope, 2), np.arange(1, d_rope, 2)])


def _keys_read(cfg: Config, p, q, k, positions, mistake):
    """q and k as a candidate with ``"deinterleaved_keys"`` scores them: each key head's rotary features in V3's
    [evens | odds] order against queries in the pairs' order."""
    if mistake != "deinterleaved_keys":
        return q, k
    dn = cfg.qk_nope_head_dim
    return q, np.concatenate([k[..., :dn], k[..., dn:][..., deinterleave_order(cfg.qk_rope_head_dim)]], axis=-1)


def _values_read(cfg: Config, p, v, k_raw, k_rotated, mistake):
    """The values (B, H, Nk, d_v) a candidate with ``"key_stride"`` reads: head h's d_v features of the merged values
    from column h * d_k, the key head's stride; ``v`` otherwise."""
    if mistake != "key_stride":
        return v
    B, H, N, dv = v.shape
    merged = v.transpose(0, 2, 1, 3).reshape(B, N, H * dv)  # (B, N, H*dv) copy
    return np.stack([merged[..., h * cfg.d_k : h * cfg.d_k + dv] for h in range(H)], axis=1)  # (B, H, N, dv)


def _params_read(cfg: Config, p: dict, mistake) -> dict:
    """The parameters by name as a candidate reads them: with ``"w_uk_transposed"``, each head's W_UK block
    (d_nope, R) transposed, which scores as the absorbed form's ``q_nope_h @ W_UK_h^T`` (d_nope == R)."""
    if mistake != "w_uk_transposed":
        return p
    H, dn = cfg.n_heads, cfg.qk_nope_head_dim
    w_uk = p["w_k"].reshape(H, dn, -1)  # (H, dn, R) view
    return dict(p, w_k=w_uk.swapaxes(-1, -2).reshape(H * dn, -1))  # (H*dn, R) copy: each head's block transposed


def _latent_heads(cfg: Config, params, query, key, rotate, mistake):
    """The NumPy candidate's heads as ``DeepseekV3Attention`` builds them: q (B, H, Nq, Dk), k (B, H, Nk, Dk) and v
    (B, H, Nk, d_v); ``rotate(x)`` turns (B, n, N, d_rope). The absorbed form's transposed W_UK is its einsum read
    the other way round, the key stride its value columns at h * d_k."""
    H, dn, dr, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    B, Nq, Nk = query.shape[0], query.shape[1], key.shape[1]

    def linear(x, w, b=None):
        return x @ w.T if b is None else x @ w.T + b

    def rms_norm(x, w):  # DeepseekV3RMSNorm
        return w * (x * (1.0 / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.norm_eps)))

    q_in = query if params.w_q_a is None else rms_norm(linear(query, params.w_q_a, params.b_q_a), params.q_a_norm)
    q = linear(q_in, params.w_q).reshape(B, Nq, H, dn + dr).transpose(0, 2, 1, 3)  # (B, H, Nq, Dk) view
    compressed = linear(key, params.w_kv_a, params.b_kv_a)  # (B, Nk, R + dr): kv_a_proj_with_mqa
    c, k_rot = rms_norm(compressed[..., :R], params.kv_a_norm), compressed[..., R:]  # (B, Nk, R), (B, Nk, dr)
    w_uk = params.w_k.reshape(H, dn, R)  # (H, dn, R) view: kv_b_proj's key rows per head
    pattern = "bnr,hrd->bhnd" if mistake == "w_uk_transposed" else "bnr,hdr->bhnd"  # (dn, R) read as (R, dn)
    k_pass = np.einsum(pattern, c, w_uk)  # (B, H, Nk, dn)
    values = linear(c, params.w_v)  # (B, Nk, H*dv)
    stride = cfg.d_k if mistake == "key_stride" else cfg.d_v
    v = values[..., np.arange(H)[:, None] * stride + np.arange(cfg.d_v)].transpose(0, 2, 1, 3)  # (B, H, Nk, dv)
    k_rot = np.broadcast_to(rotate(k_rot[:, None]), (B, H, Nk, dr))  # the one rotated key, every head
    if mistake == "deinterleaved_keys":
        k_rot = k_rot[..., deinterleave_order(dr)]  # the cached k_rot in V3's order
    q = np.concatenate([q[..., :dn], rotate(q[..., dn:])], axis=-1)  # (B, H, Nq, Dk)
    return q, np.concatenate([k_pass, k_rot], axis=-1), v


_SCALE_FIX = (
    "the softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^-1/2 * m(factor, mscale_all_dim)^2 under YaRN "
    "with mscale_all_dim (transformers' DeepseekV3Attention; core.variants.mla.softmax_scale); mscale itself acts "
    "on the rotary's cos and sin only (transformers #47435)"
)
CAUSES = (
    DiagnoseCause(
        CODE,
        "mscale_missing",
        lambda cfg: f"YaRN's m(f, mscale_all_dim)^2 = {_squares(cfg)[1]:.4g} missing from the softmax scale",
        _SCALE_FIX,
        when=_scaled_by_yarn,
    ),
    DiagnoseCause(
        CODE,
        "mscale_for_all_dim",
        lambda cfg: (
            f"m(f, mscale)^2 = {_squares(cfg)[0]:.4g} on the softmax scale where m(f, mscale_all_dim)^2 = "
            f"{_squares(cfg)[1]:.4g} belongs"
        ),
        _SCALE_FIX,
        when=_mscales_differ,
    ),
    DiagnoseCause(
        CODE,
        "deinterleaved_keys",
        "the rotary interleave permutation: the keys' rotary features in V3's de-interleaved order [evens | odds] "
        "(its cached k_rot) against queries in the pairs' order",
        "permute queries and keys alike: V3 de-interleaves both q_rot and k_rot before rotate_half (transformers "
        "#39687, vllm #26995); a cached k_rot read from transformers is in that order",
        when=lambda cfg: cfg.rope == "interleaved" and cfg.qk_rope_head_dim > 2,
    ),
    DiagnoseCause(
        CODE,
        "key_stride",
        lambda cfg: (
            f"the value head size taken from the key's: head h's values read from column h * {cfg.d_k} "
            f"(d_k) of the merged values where v_head_dim = {cfg.d_v} sets the stride"
        ),
        "split the values per head at v_head_dim (kv_b_proj's rows per head are [k_nope (qk_nope_head_dim) | v "
        "(v_head_dim)], core.variants.mla.split_kv_b): the value head is never the key's (llama.cpp #7327)",
        when=lambda cfg: cfg.d_k < cfg.d_v,
    ),
    DiagnoseCause(
        CODE,
        "w_uk_transposed",
        "W_UK transposed in the absorbed form: q_nope_h @ W_UK_h^T where q_nope_h @ W_UK_h (d_nope, R) belongs",
        "fold W_UK_h on its output side: q_latent = q_nope_h @ W_UK_h, (Nq, d_nope) @ (d_nope, R) "
        "(core.variants.mla_algebra.absorbed_queries; mlx-lm #1715, Megatron-LM #3193)",
        when=lambda cfg: cfg.qk_nope_head_dim == cfg.kv_lora_rank,
    ),
)


def _cached(cfg: Config, p, entries, raw, mistake):
    """What a decode loop with ``mistake`` caches: (kv_latent, k_rope), the latent before its norm
    (``"unnormed_latent"``) or the shared key before rotary (``"unrotated_k_rope"``) in their place."""
    (kv_latent, k_rope), (c, k_pe) = entries, raw
    if mistake == "unnormed_latent":
        return c, k_rope
    return (kv_latent, k_pe) if mistake == "unrotated_k_rope" else (kv_latent, k_rope)


DECODE_CAUSES = (
    DiagnoseCause(
        "decode_latent_not_normed",
        "unnormed_latent",
        "the cache holds the un-normalised latent: kv_a_proj_with_mqa's first kv_lora_rank features cached before "
        "kv_a_layernorm and expanded by kv_b_proj as they are",
        "cache kv_a_layernorm(c), as DeepseekV3Attention does (cache.update after the norm; DeepSeek's "
        "kv_cache[...] = kv_norm(kv)), or normalise what the cache returns before kv_b_proj",
        decode=True,
    ),
    DiagnoseCause(
        "decode_k_rope_not_rotated",
        "unrotated_k_rope",
        "k_rope cached before rotary: the shared key's qk_rope_head_dim features cached as kv_a_proj_with_mqa gives "
        "them and scored unrotated",
        "rotate k_pe at its position before caching it, as DeepseekV3Attention does (apply_rotary_pos_emb before "
        "cache.update; DeepSeek's pe_cache holds the rotated key), or rotate on read by the cached positions",
        decode=True,
    ),
)


def _runs(cause: DiagnoseCause):
    return lambda cfg, q_tokens: cause.applies(cfg)


_BY = {cause.mistake: cause for cause in CAUSES}
MISTAKES = (
    PlantedMistake(
        "mla mscale missing",
        CODE,
        "softmax_scale = qk_head_dim ** -0.5",
        "mscale_missing",
        _runs(_BY["mscale_missing"]),
    ),
    PlantedMistake(
        "mla mscale for mscale_all_dim",
        CODE,
        "yarn_get_mscale(factor, mscale) on the softmax scale",
        "mscale_for_all_dim",
        _runs(_BY["mscale_for_all_dim"]),
    ),
    PlantedMistake(
        "mla keys de-interleaved",
        CODE,
        "the cached k_rot in [evens | odds] order, q_rot in pairs",
        "deinterleaved_keys",
        _runs(_BY["deinterleaved_keys"]),
    ),
    PlantedMistake(
        "mla value head from the key",
        CODE,
        "v split at the key head's stride d_k",
        "key_stride",
        _runs(_BY["key_stride"]),
    ),
    PlantedMistake(
        "mla W_UK transposed",
        CODE,
        "einsum('bnr,hrd->bhnd', c, W_UK): each head's block transposed",
        "w_uk_transposed",
        _runs(_BY["w_uk_transposed"]),
    ),
)
# DeepSeek V3's attention (YaRN with mscale != mscale_all_dim, interleaved rotary of 6 features: scale and interleave
# mistakes run) and an absorbed V2-Lite-like layer (d_nope == kv_lora_rank 4, d_k 6 < d_v 8: W_UK transposed and the
# key stride run).
SETTINGS = (
    ("deepseek-v3", dict(DEEPSEEK_V3_LIKE)),
    (
        "deepseek-absorbed",
        dict(DEEPSEEK_V2_LITE_LIKE, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=8),
    ),
)
DIAGNOSE: DiagnoseSpec = DiagnoseSpec(
    rank=75,  # with the forms of 2025-26, before a variant registered from outside at 80
    causes=CAUSES + DECODE_CAUSES,
    mistakes=MISTAKES,
    settings=SETTINGS,
    simulated=SimulatedSteps(
        params=_params_read, values=_values_read, rotated=_keys_read, scale=_scale_read, cached=_cached
    ),
    planted=PlantedSteps(latent=_latent_heads, scale=_planted_scale),
)
