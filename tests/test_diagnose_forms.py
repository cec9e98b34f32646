"""`diagnose` names the mistakes of Llama 4's attention forms and of MLA in a user's own port (issue 45).

The candidates here are a user's NumPy port of ``Llama4TextAttention`` (einsum on ``(B, N, H, d)``, Meta's complex
rotary on adjacent pairs, the temperature and the weightless norm as the module writes them), written apart from
diagnose's simulator and from its planted candidates, with one mistake each where asked: the temperature forgotten
or its floor off by one, the QK-norm after rotary across the heads or forgotten, and a decode loop whose
temperature positions restart at 0 on every call. Each is named first by its own cause; the port done right, and
the norm moved before rotary (no output shows it: rotation keeps each head's norm), agree. MLA: a user's absorbed
form with W_UK transposed, and ports whose softmax scale lacks YaRN's m(f, mscale_all_dim)^2 or uses mscale's.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, apply_rotary, init_params
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.mla_forms import mla_decode, mla_forward
from mha_rosetta.core.rotary import rotary_tables
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE
from mha_rosetta.core.variants.mla_algebra import absorbed_output, absorbed_queries, absorbed_scores, latent_keys
from mha_rosetta.core.variants.mla_diagnose import DIAGNOSE
from mha_rosetta.core.variants.mla_heads import Rotation, latent_entries, query_stages
from mha_rosetta.core.variants.qk_norm_after_rope import LLAMA4_ROPE_LIKE
from mha_rosetta.core.variants.temperature import NOPE_LIKE
from mha_rosetta.diagnose import (
    DECODE_CAUSE_CODES,
    DecodeBug,
    DiagnoseError,
    diagnose,
    diagnose_decode,
    hypotheses,
    simulate_decode,
)
from mha_rosetta.diagnose.decode import decode_hypotheses

NOPE = MHAConfig(**NOPE_LIKE)  # floor_scale 3, attn_scale 0.5: the factor steps up at positions 2, 5, 8
ROPE = MHAConfig(**LLAMA4_ROPE_LIKE)  # interleaved rotary, chunks of 4, the norm after rotary


def _linear(x, w, b):
    return x @ w.T if b is None else x @ w.T + b


def _softmax(scores):
    """Over the keys; a row with no allowed key gives NaN (this port's convention, never compared)."""
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def _rotate(x, positions, cfg):
    """Meta's ``apply_rotary_emb``: (B, N, n, d) features (2i, 2i + 1) as complex numbers times ``e^(i p theta_i)``."""
    r = cfg.rope_dims
    angles = positions[:, None] * cfg.rope_base ** (-np.arange(0, r, 2) / r)  # (N, r/2)
    pairs = x[..., :r].reshape(*x.shape[:-1], r // 2, 2)  # (B, N, n, r/2, 2) view
    turned = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)[None, :, None]  # (B, N, n, r/2)
    rotated = np.stack([turned.real, turned.imag], axis=-1).reshape(*x.shape[:-1], r)  # (B, N, n, r) copy
    return np.concatenate([rotated, x[..., r:]], axis=-1)


def _l2_norm(x, eps, across_heads=False):
    """``Llama4TextL2Norm`` per head (the last axis), or across the heads of each token (axes 2 and 3)."""
    axes = (2, 3) if across_heads else -1
    return x * (1.0 / np.sqrt(np.mean(x**2, axis=axes, keepdims=True) + eps))


def _temper(q, positions, cfg, mistake=None):
    """``q * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1)``, (B, N, H, d) at ``positions`` (B|1, N)."""
    numerator = positions if mistake == "off by one" else positions + 1
    attn_scales = np.log1p(np.floor(numerator / cfg.floor_scale)) * cfg.attn_scale + 1  # (B|1, N)
    return q * attn_scales[:, :, None, None]


def llama4_port(cfg: MHAConfig, temperature: str | None = None, qk_norm: str | None = None):
    """A user's port of ``Llama4TextAttention``: candidate(params, query, key, value, mask) -> (B, Nq, D).

    ``temperature``: None (right), "forgotten" or "off by one"; ``qk_norm``: None (right, per head after rotary),
    "forgotten", "across heads" or "before rotary".
    """
    H, Hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_k

    def candidate(params, query, key, value, mask):
        B, N, Nk = query.shape[0], query.shape[1], key.shape[1]
        q = _linear(query, params.w_q, params.b_q).reshape(B, N, H, d)  # (B, N, H, d) view
        k = _linear(key, params.w_k, params.b_k).reshape(B, Nk, Hkv, d)  # (B, Nk, Hkv, d) view
        v = _linear(value, params.w_v, params.b_v).reshape(B, Nk, Hkv, cfg.d_v)  # (B, Nk, Hkv, dv) view
        normed = cfg.qk_norm_after_rope and qk_norm != "forgotten"
        if normed and qk_norm == "before rotary":
            q, k = _l2_norm(q, cfg.norm_eps), _l2_norm(k, cfg.norm_eps)
        if cfg.rope is not None:
            q, k = _rotate(q, np.arange(N), cfg), _rotate(k, np.arange(Nk), cfg)
        if normed and qk_norm != "before rotary":
            across = qk_norm == "across heads"
            q, k = _l2_norm(q, cfg.norm_eps, across), _l2_norm(k, cfg.norm_eps, across)
        if cfg.attn_temperature_tuning and temperature != "forgotten":
            q = _temper(q, np.arange(N)[None], cfg, temperature)
        k, v = np.repeat(k, H // Hkv, axis=2), np.repeat(v, H // Hkv, axis=2)  # (B, Nk, H, d): repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) * cfg.scale  # (B, H, N, Nk)
        i, j = np.arange(N)[:, None], np.arange(Nk)[None, :]
        allowed = (j <= i) if cfg.causal else np.ones((N, Nk), bool)
        if cfg.attention_chunk_size is not None:
            allowed = allowed & (i // cfg.attention_chunk_size == j // cfg.attention_chunk_size)
        if mask is not None:
            allowed = allowed & mask
        weights = _softmax(np.where(allowed, scores, -np.inf))
        context = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, N, H * cfg.d_v)  # (B, N, H*dv) copy
        return _linear(context, params.w_o, params.b_o)

    return candidate


@pytest.mark.parametrize("cfg", [NOPE, ROPE], ids=["nope", "rope"])
def test_the_port_done_right_agrees(cfg):
    result = diagnose(llama4_port(cfg), cfg)
    assert result.agrees and result.causes == [] and result.max_error < 1e-12, result.summary()


@pytest.mark.parametrize(
    "cfg, mistake, code, detail",
    [
        (NOPE, dict(temperature="forgotten"), "temperature",
         "the temperature forgotten: no query multiplied by 1 + 0.5 * log1p(floor((p + 1) / 3))"),
        (NOPE, dict(temperature="off by one"), "temperature",
         "the temperature's floor one position early: floor(p / 3) where Llama 4 has floor((p + 1) / 3)"),
        (ROPE, dict(qk_norm="across heads"), "qk_norm_after_rope",
         "the QK-norm across the heads: each token's whole projection (H*d_k features) normed at once"),
        (ROPE, dict(qk_norm="forgotten"), "qk_norm_after_rope", "the QK-norm after rotary forgotten: q and k unnormed"),
    ],
    ids=["temperature forgotten", "temperature off by one", "qk-norm across heads", "qk-norm forgotten"],
)  # fmt: skip
def test_each_mistake_in_the_port_is_named_first(cfg, mistake, code, detail):
    """The temperature forgotten or its floor off by one; the QK-norm after rotary across the heads or forgotten."""
    result = diagnose(llama4_port(cfg, **mistake), cfg)
    assert not result.agrees and result.max_error > 1e-3
    first = result.causes[0]
    assert (first.code, first.detail[: len(detail)]) == (code, detail), result.summary()
    assert first.residual <= 1.0 and "Llama4Text" in first.fix  # Llama4TextAttention, Llama4TextL2Norm


def test_at_llama4s_floor_scale_the_probes_cannot_see_the_temperature_and_say_so():
    """floor_scale 8192: the factor is 1 up to position 8190, so five probe queries cannot show it forgotten."""
    cfg = replace(NOPE, floor_scale=8192.0)
    result = diagnose(llama4_port(cfg, temperature="forgotten"), cfg)
    assert result.agrees and result.max_error < 1e-12  # this port's rounding, no more
    assert any(
        note.startswith("the temperature is 1 at every probe position 0..4 (floor_scale 8192") for note in result.notes
    )
    assert not any("temperature" in note for note in diagnose(llama4_port(NOPE), NOPE).notes)


def test_the_norm_before_rotary_is_no_mistake_any_output_shows():
    """Rotation keeps each head's sum of squares, so the weightless norm before rotary gives the same numbers."""
    result = diagnose(llama4_port(ROPE, qk_norm="before rotary"), ROPE)
    assert result.agrees and result.max_error < 1e-12, result.summary()


def test_a_wrong_scale_under_the_weightless_norm_has_no_repair_to_feed():
    """The norm after rotary undoes any rescaled w_q: the scale cause names the fix in words only."""
    scale = [h for h in hypotheses(ROPE) if h.code == "scale"]
    assert scale and all(h.repair is None and "undoes any rescaled weight" in h.fix for h in scale)
    assert all(h.repair is not None for h in hypotheses(NOPE) if h.code == "scale")  # no norm: w_q rescaled


# -- decode: the temperature's positions restart at 0 on every call ------------------------------------------------
def nope_decode_loop(cfg: MHAConfig, offset: bool = True):
    """A user's decode loop of the NoPE layer with a growing cache: loop(params, x, prefill, step, mask, positions).

    ``offset=False``: the temperature's factors from ``arange(s)`` of each call (the cache offset left out).
    """
    H, Hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_k

    def loop(params, x, prefill, step, mask, positions):
        B, N, _ = x.shape
        valid_all = np.ones((B, N), bool) if mask is None else mask
        K, V = np.zeros((B, 0, Hkv, d)), np.zeros((B, 0, Hkv, cfg.d_v))  # (B, T, Hkv, d): the cache
        cached_positions, cached_valid = np.zeros((B, 0), np.int64), np.zeros((B, 0), bool)
        bounds = [0, *range(prefill, N, step), N]
        outputs = []
        for start, stop in pairwise(bounds):
            xs, s, pos = x[:, start:stop], stop - start, positions[:, start:stop]  # (B, s, D), (B, s)
            q = _linear(xs, params.w_q, params.b_q).reshape(B, s, H, d)  # (B, s, H, d) view
            K = np.concatenate([K, _linear(xs, params.w_k, params.b_k).reshape(B, s, Hkv, d)], axis=1)
            V = np.concatenate([V, _linear(xs, params.w_v, params.b_v).reshape(B, s, Hkv, cfg.d_v)], axis=1)
            cached_positions = np.concatenate([cached_positions, pos], axis=1)
            cached_valid = np.concatenate([cached_valid, valid_all[:, start:stop]], axis=1)
            q = _temper(q, pos if offset else np.broadcast_to(np.arange(s), (B, s)), cfg)
            keys, values = np.repeat(K, H // Hkv, axis=2), np.repeat(V, H // Hkv, axis=2)  # (B, T, H, d)
            scores = np.einsum("bqhd,bkhd->bhqk", q, keys) * cfg.scale  # (B, H, s, T)
            allowed = (cached_positions[:, None, :] <= pos[:, :, None]) & cached_valid[:, None, :]  # (B, s, T)
            weights = _softmax(np.where(allowed[:, None], scores, -np.inf))
            context = np.einsum("bhqk,bkhd->bqhd", weights, values).reshape(B, s, H * cfg.d_v)  # (B, s, H*dv) copy
            outputs.append(_linear(context, params.w_o, params.b_o))
        return np.concatenate(outputs, axis=1)  # (B, N, D)

    return loop


def test_a_decode_loop_with_the_temperature_positions_not_offset_is_named():
    assert diagnose_decode(nope_decode_loop(NOPE), NOPE).agrees
    result = diagnose_decode(nope_decode_loop(NOPE, offset=False), NOPE)
    assert not result.agrees and result.max_error > 1e-3
    assert [c.code for c in result.causes] == ["decode_temperature_not_offset"], result.summary()
    first = result.causes[0]
    assert first.detail.startswith("the temperature's positions restart at 0 on each call") and first.residual <= 1.0
    assert "get_seq_length" in first.fix and first.code in DECODE_CAUSE_CODES
    assert "decode_temperature_not_offset" not in {h.code for h in hypotheses(NOPE)}  # a decode mistake only


# -- MLA: a user's absorbed form, and the softmax scale without YaRN's mscale or with the wrong one ------------------
V3 = MHAConfig(**DEEPSEEK_V3_LIKE)  # YaRN factor 4, mscale 0.8, mscale_all_dim 0.9
ABSORBED = MHAConfig(**dict(DIAGNOSE.settings)["deepseek-absorbed"])  # d_nope == kv_lora_rank == 4


def absorbed_port(cfg: MHAConfig, transposed: bool = False):
    """A user's absorbed MLA (the package's own pieces, `mla_algebra`): every head against the one key head
    ``[c | k_rope]``, W_UV folded into the output; ``transposed``: W_UK read the other way round."""

    def candidate(params, query, key, value, mask):
        p, (Nq, Nk) = params.as_dict(), (query.shape[1], key.shape[1])
        tables = rotary_tables(cfg, SimpleNamespace(positions=np.arange(Nq)[None], kv_positions=np.arange(Nk)[None]))
        rotate = Rotation(tables, apply_rotary)
        kv_latent, k_rope = latent_entries(cfg, p, key, rotate)  # (B, Nk, R), (B, Nk, dr)
        queries = absorbed_queries(cfg, p["w_k"], query_stages(cfg, p, query, rotate)["q_rotated"], transposed)
        scores = absorbed_scores(cfg, queries, latent_keys(kv_latent, k_rope))  # (B, H, Nq, Nk)
        allowed = np.tril(np.ones((Nq, Nk), bool)) if cfg.causal else np.ones((Nq, Nk), bool)
        allowed = allowed if mask is None else allowed & mask
        return absorbed_output(cfg, p, _softmax(np.where(allowed, scores, -np.inf)), kv_latent)

    return candidate


def test_a_users_absorbed_mla_is_diagnosed_and_w_uk_transposed_named():
    assert diagnose(absorbed_port(ABSORBED), ABSORBED).agrees
    result = diagnose(absorbed_port(ABSORBED, transposed=True), ABSORBED)
    assert not result.agrees and result.max_error > 1e-3
    first = result.causes[0]
    assert (first.code, first.residual <= 1.0) == ("mla", True), result.summary()
    assert first.detail.startswith("W_UK transposed in the absorbed form") and "mlx-lm #1715" in first.fix


@pytest.mark.parametrize(
    "mistake, scale, detail",
    [
        ("mscale_missing", 10**-0.5, "YaRN's m(f, mscale_all_dim)^2 = 1.265 missing from the softmax scale"),
        ("mscale_for_all_dim", 10**-0.5 * (0.08 * np.log(4) + 1) ** 2, "m(f, mscale)^2 = 1.234 on the softmax scale"),
    ],
)
def test_the_softmax_scale_without_yarns_mscale_or_with_the_wrong_one_is_named(mistake, scale, detail):
    """A port computing the spec's MLA with its own scale: (nope + rope)^-1/2, or m(4, 0.8)^2 for m(4, 0.9)^2."""
    assert V3.scale == pytest.approx(10**-0.5 * (0.09 * np.log(4) + 1) ** 2, rel=1e-15)
    assert diagnose(lambda p, q, k, v, m: mla_forward(V3, p, q, mask=m), V3).agrees
    wrong = replace(V3, scale=scale)
    result = diagnose(lambda p, q, k, v, m: mla_forward(wrong, p, q, mask=m), V3)
    first = result.causes[0]
    assert (first.code, first.detail[: len(detail)]) == ("mla", detail), result.summary()
    assert "probe 'cross' left out" in " ".join(result.notes)  # self-attention only: its key and value ignored


# -- MLA's decode loop: its latent cache, and what it must hold -----------------------------------------------------
V2_LITE = MHAConfig(**DEEPSEEK_V2_LITE_LIKE)  # interleaved rotary of 4 features, no YaRN, biases on kv_a and o


@pytest.mark.parametrize("cfg", [V3, V2_LITE, ABSORBED], ids=["v3", "v2-lite", "absorbed"])
def test_the_decode_simulator_keeps_mlas_latent_cache_and_equals_its_forward_and_decode(cfg):
    """No mistake: the simulated loop over the latent cache equals the full forward and `core.mla_forms.mla_decode`."""
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 9, cfg.d_model))
    mask = np.ones((2, 9), bool)
    mask[0, :2] = False  # item 0 left-padded by two
    for prefill, step, pad in [(1, 1, None), (3, 2, None), (9, 1, None), (3, 2, mask)]:
        got = simulate_decode(cfg, params, x, prefill=prefill, step=step, mask=pad)
        rows = np.ones((2, 9), bool) if pad is None else pad
        want = reference_decode(cfg, params, x, prefill=prefill, step=step, mask=pad)
        assert np.abs(got - want)[rows].max() < 1e-12, (prefill, step)
        forms = mla_decode(cfg, params, x, prefill=prefill, step=step, mask=pad, form="absorbed")
        assert np.abs(got - forms)[rows].max() < 1e-12, (prefill, step)
    # The two cache mistakes change every token's output but the first's, which attends to itself alone (weight 1,
    # whatever the key); the prefill too, since it reads the cache as cache.update does.
    right = reference_decode(cfg, params, x, prefill=9)
    for mistake in ("unnormed_latent", "unrotated_k_rope"):
        wrong = simulate_decode(cfg, params, x, prefill=9, bug=DecodeBug(mistakes=(("mla", mistake),)))
        assert (np.abs(wrong - right).max(axis=-1)[:, 1:] > 1e-6).all(), mistake


def _rotate_at(x, positions, cfg):
    """Meta's complex rotary of (B, s, n, d) features (2i, 2i + 1) at (B, s) positions (a pad's -1 included)."""
    r = cfg.rope_dims
    angles = positions[..., None] * cfg.rope_base ** (-np.arange(0, r, 2) / r)  # (B, s, r/2)
    pairs = x[..., :r].reshape(*x.shape[:-1], r // 2, 2)  # (B, s, n, r/2, 2) view
    turned = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)[:, :, None]  # (B, s, n, r/2)
    return np.concatenate([np.stack([turned.real, turned.imag], axis=-1).reshape(*x.shape[:-1], r), x[..., r:]], -1)


def mla_decode_loop(cfg: MHAConfig, cached: str | None = None):
    """A user's decode loop of DeepSeek V2-Lite's attention with a latent cache: loop(params, x, prefill, step, mask,
    positions). ``cached``: None (the normalised latent and the rotated k_pe, as DeepseekV3Attention caches them),
    "raw latent" (kv_a_proj_with_mqa's c, before kv_a_layernorm) or "raw k_pe" (before rotary)."""
    H, dn, dr, dv, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.d_v, cfg.kv_lora_rank

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.norm_eps)

    def loop(params, x, prefill, step, mask, positions):
        B, N, _ = x.shape
        valid_all = np.ones((B, N), bool) if mask is None else mask
        latent, k_pe_cache = np.zeros((B, 0, R)), np.zeros((B, 0, dr))  # the cache: (B, T, R), (B, T, dr)
        cached_positions, cached_valid = np.zeros((B, 0), np.int64), np.zeros((B, 0), bool)
        outputs = []
        for start, stop in pairwise([0, *range(prefill, N, step), N]):
            xs, s, pos = x[:, start:stop], stop - start, positions[:, start:stop]  # (B, s, D), (B, s)
            q = _linear(xs, params.w_q, None).reshape(B, s, H, dn + dr)  # q_proj, (B, s, H, Dk) view
            q = np.concatenate([q[..., :dn], _rotate_at(q[..., dn:], pos, cfg)], axis=-1)
            kv = _linear(xs, params.w_kv_a, params.b_kv_a)  # (B, s, R + dr): kv_a_proj_with_mqa
            c, k_pe = kv[..., :R], kv[..., R:]
            k_rot = _rotate_at(k_pe[:, :, None], pos, cfg)[:, :, 0]  # (B, s, dr)
            latent = np.concatenate([latent, c if cached == "raw latent" else rms(c, params.kv_a_norm)], axis=1)
            k_pe_cache = np.concatenate([k_pe_cache, k_pe if cached == "raw k_pe" else k_rot], axis=1)
            cached_positions = np.concatenate([cached_positions, pos], axis=1)
            cached_valid = np.concatenate([cached_valid, valid_all[:, start:stop]], axis=1)
            k_nope = np.einsum("btr,hdr->bthd", latent, params.w_k.reshape(H, dn, R))  # (B, T, H, dn)
            values = np.einsum("btr,hdr->bthd", latent, params.w_v.reshape(H, dv, R))  # (B, T, H, dv)
            scores = np.einsum("bqhd,bkhd->bhqk", q[..., :dn], k_nope)  # (B, H, s, T)
            scores = (scores + np.einsum("bqhd,bkd->bhqk", q[..., dn:], k_pe_cache)) * cfg.scale
            allowed = (cached_positions[:, None, :] <= pos[:, :, None]) & cached_valid[:, None, :]  # (B, s, T)
            weights = _softmax(np.where(allowed[:, None], scores, -np.inf))
            context = np.einsum("bhqk,bkhd->bqhd", weights, values).reshape(B, s, H * dv)  # (B, s, H*dv) copy
            outputs.append(_linear(context, params.w_o, params.b_o))
        return np.concatenate(outputs, axis=1)  # (B, N, D)

    return loop


@pytest.mark.parametrize(
    "cached, code, detail",
    [
        ("raw latent", "decode_latent_not_normed", "the cache holds the un-normalised latent"),
        ("raw k_pe", "decode_k_rope_not_rotated", "k_rope cached before rotary"),
    ],
)
def test_a_users_mla_decode_loop_caching_the_wrong_entries_is_named(cached, code, detail):
    right = diagnose_decode(mla_decode_loop(V2_LITE), V2_LITE)
    assert right.agrees and right.max_error < 1e-12, right.summary()
    result = diagnose_decode(mla_decode_loop(V2_LITE, cached), V2_LITE)
    assert not result.agrees and result.max_error > 1e-3
    assert [c.code for c in result.causes] == [code], result.summary()
    first = result.causes[0]
    assert first.detail.startswith(detail) and first.residual <= 1.0 and "DeepseekV3Attention" in first.fix
    assert code in DECODE_CAUSE_CODES and code not in {h.code for h in hypotheses(V2_LITE)}  # decode only


@pytest.mark.parametrize("cfg", [V3, V2_LITE], ids=["v3", "v2-lite"])
def test_every_decode_mistake_of_mla_is_named_as_itself_the_confusion_diagonal(cfg):
    """Each decode hypothesis of an MLA layer, simulated, is named first by itself alone: 7 of 7 cells diagonal."""
    found = decode_hypotheses(cfg)
    assert [h.code for h in found] == [
        "decode_positions_not_offset", "decode_top_left_causal", "decode_top_left_causal",
        "decode_empty_slots_attended", "decode_rotated_twice", "decode_latent_not_normed", "decode_k_rope_not_rotated",
    ]  # fmt: skip
    named = []
    for h in found:

        def loop(params, x, prefill, step, mask, positions, bug=h.bug):  # the simulated mistake as a candidate
            return simulate_decode(cfg, params, x, prefill=prefill, step=step, mask=mask, positions=positions, bug=bug)

        result = diagnose_decode(loop, cfg)
        assert not result.agrees and result.max_error > 1e-3, h.label
        named.append([(c.code, c.detail) for c in result.causes])
    assert named == [[(h.code, h.detail)] for h in found]  # one cause each, its own: the diagonal


def test_diagnose_decode_refuses_a_latent_form_whose_entry_says_nothing_of_its_cache(monkeypatch):
    from mha_rosetta.core.variants import VARIANT_REGISTRY

    entry = VARIANT_REGISTRY["mla"]
    simulated = replace(entry.diagnose.simulated, cached=None)
    monkeypatch.setitem(VARIANT_REGISTRY, "mla", replace(entry, diagnose=replace(entry.diagnose, simulated=simulated)))
    with pytest.raises(DiagnoseError, match="diagnose_decode cannot probe mla yet: its loop keeps no cache of that"):
        diagnose_decode(lambda *args: None, V3)
