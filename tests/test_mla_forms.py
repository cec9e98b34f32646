"""MLA's two forms (naive, absorbed) and its latent cache in NumPy float64 (`core.mla_forms`): they agree with the
oracle and with each other to about 1e-12, decode through the latent cache equals the full forward, and the cache
holds ``kv_lora_rank + d_rope`` numbers a token.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, init_params, reference_mha
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.mla_forms import FORMS, cache_bytes_per_token, decode_step_costs, mla_decode, mla_forward
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE, V3_SIZES, cache_numbers_per_token
from mha_rosetta.core.variants.mla_algebra import absorbed_output, absorbed_queries, absorbed_scores, latent_keys
from mha_rosetta.core.variants.qk_norm import rms_norm

CONFIGS = {
    "v3": MHAConfig(**DEEPSEEK_V3_LIKE),
    "v2_lite": MHAConfig(**DEEPSEEK_V2_LITE_LIKE),
    "v3_half_window": MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_interleave=False, window=3)),
}


def _x(cfg, shape, seed=1):
    return np.random.default_rng(seed).standard_normal((*shape, cfg.d_model))


@pytest.mark.parametrize("name", CONFIGS)
def test_both_forms_agree_with_the_oracle_and_each_other_to_1e_12(name):
    cfg = CONFIGS[name]
    params = init_params(cfg, seed=4)
    x = _x(cfg, (2, 9))
    ref = reference_mha(cfg, params, x)
    naive, absorbed = (mla_forward(cfg, params, x, form=form) for form in FORMS)
    scale = np.abs(ref).max()
    assert np.abs(naive - ref).max() <= 1e-12 * scale
    assert np.abs(absorbed - ref).max() <= 1e-12 * scale
    assert np.abs(absorbed - naive).max() <= 1e-12 * scale
    assert np.abs(absorbed - naive).max() > 0 or name == ""  # re-associated products: equal to rounding, not bits


def test_the_forms_take_a_mask_positions_and_unbatched_input():
    cfg = CONFIGS["v2_lite"]
    params = init_params(cfg, seed=0)
    x = _x(cfg, (6,))
    mask = np.random.default_rng(3).random((6, 6)) < 0.7
    positions = np.array([0, 2, 3, 5, 8, 9])
    ref = reference_mha(cfg, params, x, mask=mask, positions=positions)
    for form in FORMS:
        out = mla_forward(cfg, params, x, form=form, mask=mask, positions=positions)
        assert out.shape == (6, 20)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


def test_the_absorbed_form_is_mqa_over_the_latent_written_out():
    """Each head's query through W_UK_h against [c | k_rope]; the latent context through W_O_h W_UV_h, by hand."""
    cfg = CONFIGS["v2_lite"]
    p = init_params(cfg, seed=2)
    x = _x(cfg, (1, 5))
    stages = reference_mha(cfg, p, x, return_stages=True)[1]
    H, dn, R = 4, 3, 6
    q = stages["q_rotated"][0]  # (H, N, Dk)
    c, k_rope = stages["kv_latent"][0], stages["k_rope"][0]
    out = np.zeros((5, 20))
    for h in range(H):
        w_uk, w_uv = p.w_k[h * dn : (h + 1) * dn], p.w_v[h * 5 : (h + 1) * 5]  # (dn, R), (dv, R)
        s = cfg.scale * (q[h, :, :dn] @ w_uk @ c.T + q[h, :, dn:] @ k_rope.T)
        s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        out += (a @ c) @ (p.w_o[:, h * 5 : (h + 1) * 5] @ w_uv).T
    np.testing.assert_allclose(out + p.b_o, stages["output"][0], rtol=1e-12, atol=1e-13)
    queries = absorbed_queries(cfg, p.w_k, stages["q_rotated"])
    assert queries.shape == (1, H, 5, R + 4)  # kv_lora_rank + d_rope: one key head for every query head
    weights = stages["weights"]
    np.testing.assert_allclose(absorbed_output(cfg, p.as_dict(), weights, stages["kv_latent"])[0], out + p.b_o)
    scores = absorbed_scores(cfg, queries, latent_keys(stages["kv_latent"], stages["k_rope"]))
    np.testing.assert_allclose(scores, stages["scores"], rtol=1e-12, atol=1e-13)


def test_w_uk_read_transposed_in_the_absorbed_form_changes_the_answer():
    """The absorbed form's bug (mlx-lm #1715): W_UK_h read (R, dn); it runs only when dn == R, and is wrong."""
    cfg = MHAConfig(**dict(DEEPSEEK_V2_LITE_LIKE, kv_lora_rank=3))  # dn == R == 3
    p = init_params(cfg, seed=1)
    stages = reference_mha(cfg, p, _x(cfg, (1, 4)), return_stages=True)[1]
    right, wrong = (absorbed_queries(cfg, p.w_k, stages["q_rotated"], transposed=t) for t in (False, True))
    keys = latent_keys(stages["kv_latent"], stages["k_rope"])
    np.testing.assert_allclose(absorbed_scores(cfg, right, keys), stages["scores"], rtol=1e-12, atol=1e-13)
    assert np.abs(absorbed_scores(cfg, wrong, keys) - stages["scores"]).max() > 0.1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill, step", [(1, 1), (3, 2), (5, 4)])
def test_decode_through_the_latent_cache_equals_the_full_forward(form, name, prefill, step):
    cfg = CONFIGS[name]
    params = init_params(cfg, seed=6)
    x = _x(cfg, (2, 8), seed=2)
    out, cache = mla_decode(cfg, params, x, prefill=prefill, step=step, form=form, return_cache=True)
    ref = reference_decode(cfg, params, x, prefill=prefill, step=step)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    # The cache holds the oracle's own kv_latent and k_rope stages: the normalised latent and the rotated key.
    stages = reference_mha(cfg, params, x, return_stages=True)[1]
    np.testing.assert_allclose(cache.kv_latent, stages["kv_latent"], rtol=0, atol=1e-14)
    np.testing.assert_allclose(cache.k_rope, stages["k_rope"], rtol=0, atol=1e-14)
    assert cache.numbers_per_token == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_decode_with_left_padding_equals_the_full_forward():
    cfg = CONFIGS["v3"]
    params = init_params(cfg, seed=2)
    x = _x(cfg, (2, 6), seed=5)
    mask = np.array([[False, False, True, True, True, True], [True] * 6])
    for form in FORMS:
        out = mla_decode(cfg, params, x, prefill=3, step=1, form=form, mask=mask)
        np.testing.assert_allclose(out, reference_decode(cfg, params, x, prefill=3, mask=mask), rtol=1e-12, atol=1e-13)


def test_the_latent_cache_bytes_per_token_against_per_head_keys_and_values():
    cfg = CONFIGS["v3"]  # R 10 + dr 6 = 16 numbers; H 3 * (d_k 10 + d_v 5) = 45
    assert cache_bytes_per_token(cfg) == dict(latent=16 * 8, expanded=45 * 8, ratio=45 / 16)
    assert cache_bytes_per_token(cfg, itemsize=2)["latent"] == 32
    # DeepSeek V3 (config.json): 512 + 64 = 576 numbers a token against 128 * (192 + 128) = 40960.
    assert cache_numbers_per_token(**V3_SIZES) == dict(latent=576, expanded=40960, ratio=40960 / 576)


def test_the_cache_is_the_normalised_latent_not_the_projection():
    cfg = CONFIGS["v2_lite"]
    p = init_params(cfg, seed=3)
    x = _x(cfg, (1, 4))
    _, cache = mla_decode(cfg, p, x, prefill=2, return_cache=True)
    c = (x @ p.w_kv_a.T + p.b_kv_a)[..., : cfg.kv_lora_rank]
    np.testing.assert_allclose(cache.kv_latent, rms_norm(c, p.kv_a_norm, cfg.norm_eps), rtol=1e-14)


@pytest.mark.parametrize(
    "cfg, form, words",
    [
        (CONFIGS["v3"], "fast", "form must be one of 'naive', 'absorbed', got 'fast'"),
        (MHAConfig(d_model=12, n_heads=3), "naive", "the MLA forms need MHAConfig.kv_lora_rank"),
        (MHAConfig(**dict(DEEPSEEK_V3_LIKE, softcap=5.0)), "absorbed", "softcap is refused here"),
        (MHAConfig(**dict(DEEPSEEK_V3_LIKE, sinks=True)), "naive", "sinks is refused here"),
    ],
)
def test_bad_forms_are_refused_by_name(cfg, form, words):
    params = init_params(cfg, seed=0)
    with pytest.raises(ValueError, match=words):
        mla_forward(cfg, params, _x(cfg, (1, 3)), form=form)


def test_a_decode_step_reads_the_latent_once_in_the_absorbed_form_and_expands_it_in_the_naive():
    """DeepSeek V3's sizes (128 heads, R 512, nope 128 + rope 64, v 128) at 32k context, bfloat16, by hand."""
    cfg = MHAConfig(d_model=7168, n_heads=128, d_k=192, **{k: v for k, v in V3_SIZES.items() if k != "n_heads"})
    T, weights = 32768, 128 * (128 + 128) * 512  # W_UK and W_UV
    naive, absorbed = (decode_step_costs(cfg, T, form) for form in FORMS)
    assert absorbed["bytes"] == 2 * (T * 576 + weights)
    assert naive["bytes"] == 2 * (T * 576 + weights + T * 128 * (192 + 128))
    assert naive["macs"] == T * 128 * 256 * 512 + T * 128 * 320
    assert absorbed["macs"] == 128 * 128 * 512 + T * 128 * 576 + T * 128 * 512 + 128 * 128 * 512
    assert 38 < naive["bytes"] / absorbed["bytes"] < 39  # 38.6x: the expanded keys and values dominate at 32k
