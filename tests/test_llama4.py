"""Llama 4's NoPE-layer temperature and its weightless QK-norm after rotary: the two registry entries.

Hand-computed factors, the float64 stages against the formulas written out, the backward by central
differences, decode positions with the cache offset, the refusals of bad values by field, and a kernel oracle's
refusal by name (our adapters apply both: `Variant.implemented_by`, tests/test_forms_adapters.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from mha_rosetta.backends import UnsupportedCase, get_backend
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha
from mha_rosetta.core.grad import reference_mha_vjp
from mha_rosetta.core.reference import reference_stages
from mha_rosetta.core.variants import VARIANT_REGISTRY, adapted_variants, temperature_scales

NOPE = dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, bias=False)
ROPE = dict(NOPE, rope="interleaved", attention_chunk_size=4, norm_eps=1e-5)


def _x(batch: int, tokens: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, 24))


def test_the_factors_are_written_out_by_hand():
    # floor_scale 3, attn_scale 0.5: floor((p + 1) / 3) is 0, 0, 1, 1, 1, 2, 2, 2, 3 for p = 0..8.
    expected = [1, 1, *[1 + 0.5 * math.log(2)] * 3, *[1 + 0.5 * math.log(3)] * 3, 1 + 0.5 * math.log(4)]
    np.testing.assert_allclose(temperature_scales(np.arange(9), 3.0, 0.5), expected, rtol=1e-15)
    # Llama 4's defaults: 1 up to position 8190, then 1 + 0.1 ln 2 from 8191 (p + 1 = 8192).
    np.testing.assert_allclose(
        temperature_scales(np.array([0, 8190, 8191, 16383]), 8192.0, 0.1),
        [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)],
        rtol=1e-15,
    )


def test_the_tempered_queries_are_each_row_times_its_factor_and_keys_are_untouched():
    cfg = MHAConfig(**NOPE, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5)
    assert cfg.variants == ("temperature",) and cfg.floor_scale == 3.0
    params, x = init_params(cfg, seed=2), _x(2, 8)
    stages = reference_stages(cfg, params, x)
    factors = temperature_scales(np.arange(8), 3.0, 0.5)  # (8,)
    np.testing.assert_array_equal(stages["q_tempered"], stages["q_heads"] * factors[None, None, :, None])
    # The scores read the tempered queries: written out for head 3 (kv head 1).
    scores = cfg.scale * stages["q_tempered"][:, 3] @ stages["k_heads"][:, 1].transpose(0, 2, 1)
    np.testing.assert_allclose(stages["scores"][:, 3], scores, rtol=1e-14)
    # Off, the layer is plain causal attention: the first two queries (factor 1) give the same rows.
    plain = MHAConfig(**NOPE)
    off = reference_mha(plain, params, x)
    on = stages["output"]
    np.testing.assert_allclose(on[:, :2], off[:, :2], rtol=1e-13)
    assert np.abs(on[:, 2:] - off[:, 2:]).min() > 1e-6  # every later row moved


def test_the_norm_after_rotary_is_weightless_per_head_on_the_rotated_heads():
    cfg = MHAConfig(**ROPE, qk_norm_after_rope=True)
    assert cfg.variants == ("chunked", "qk_norm_after_rope")
    params = init_params(cfg, seed=3)
    assert params.q_norm is None and params.k_norm is None  # no learned weight
    stages = reference_stages(cfg, params, _x(2, 7))
    for side in "qk":
        rotated = stages[f"{side}_rotated"]
        expected = rotated / np.sqrt(np.mean(rotated**2, axis=-1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(stages[f"{side}_rotated_normed"], expected, rtol=1e-14)
    # Per head: every (batch, head, token) row has RMS 1 up to eps.
    rms = np.sqrt(np.mean(stages["q_rotated_normed"] ** 2, axis=-1))
    assert np.abs(rms - 1).max() < 1e-4
    assert tuple(stages)[6:12] == (
        "q_rotated",
        "k_rotated",
        "q_rotated_normed",
        "k_rotated_normed",
        "scores",
        "masked_scores",
    )


def _central_difference(cfg, params, x, cotangent, direction, name, eps=1e-6):
    """d/dt <cotangent, output> at t = 0 with ``name`` (the input "x" or a parameter) moved by t * direction."""

    def loss(t):
        moved_x = x + t * direction if name == "x" else x
        moved = params if name == "x" else replace(params, **{name: getattr(params, name) + t * direction})
        return float(np.sum(cotangent * reference_mha(cfg, moved, moved_x)))

    return (loss(eps) - loss(-eps)) / (2 * eps)


@pytest.mark.parametrize(
    "fields",
    [
        dict(NOPE, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.7),
        dict(ROPE, qk_norm_after_rope=True),
    ],
    ids=["temperature", "qk_norm_after_rope"],
)
def test_the_backward_matches_central_differences(fields):
    cfg = MHAConfig(**fields)
    params, x = init_params(cfg, seed=4), _x(2, 6, seed=5)
    rng = np.random.default_rng(6)
    cotangent = rng.standard_normal((2, 6, 24))
    grads = reference_mha_vjp(cfg, params, x, cotangent=cotangent)
    for name, grad in (("x", grads.d_query), ("w_q", grads.d_params.w_q), ("w_k", grads.d_params.w_k)):
        direction = rng.standard_normal(grad.shape)
        fd = _central_difference(cfg, params, x, cotangent, direction, name)
        assert abs(fd - float(np.sum(grad * direction))) < 1e-7 * max(1.0, abs(fd)), name


def test_decode_positions_include_the_cache_offset():
    """A step's queries at positions 5, 6 over the cached keys 0..6: the factors of 5 and 6, not of 0 and 1."""
    cfg = MHAConfig(**NOPE, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5)
    params, x = init_params(cfg, seed=7), _x(1, 7)
    full = reference_mha(cfg, params, x)
    step = reference_mha(cfg, params, x[:, 5:], key=x, positions=np.arange(5, 7), kv_positions=np.arange(7))
    assert_close(step, full[:, 5:], "float64")
    restarted = reference_mha(
        cfg,
        params,
        x[:, 5:],
        key=x,
        positions=np.arange(2),
        kv_positions=np.arange(7),
        mask=np.tril(np.ones((2, 7), bool), 5),
    )
    assert np.abs(restarted - full[:, 5:]).max() > 1e-3  # the mistake diagnose names: positions without the offset


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(attn_temperature_tuning=True, floor_scale=0), "floor_scale"),
        (dict(attn_temperature_tuning=True, floor_scale=-8192), "floor_scale"),
        (dict(floor_scale=float("inf")), "floor_scale"),
        (dict(attn_temperature_tuning=True, attn_scale=-0.1), "attn_scale"),
        (dict(attn_scale="0.1"), "attn_scale"),
        (dict(attn_temperature_tuning=1), "attn_temperature_tuning"),
        (dict(qk_norm_after_rope=True), "rope=None"),
        (dict(qk_norm_after_rope="yes", rope="half"), "qk_norm_after_rope"),
        (dict(qk_norm_after_rope=True, rope="half", norm_eps=0), "norm_eps"),
    ],
)
def test_bad_values_are_refused_by_field(fields, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MHAConfig(**dict(NOPE, **fields))


@pytest.mark.parametrize("variant", ["temperature", "qk_norm_after_rope"])
def test_our_adapters_apply_the_forms_and_a_kernel_oracle_refuses_them_by_name(variant):
    """Every convention applies them (tests/test_forms_adapters.py); a third-party kernel says it lacks them."""
    entry = VARIANT_REGISTRY[variant]
    assert entry.implemented_by == ("numpy", "torch", "jax", "mlx") and variant not in adapted_variants()
    assert variant in adapted_variants("numpy")
    cfg = MHAConfig(
        **(
            dict(NOPE, attn_temperature_tuning=True, floor_scale=2)
            if variant == "temperature"
            else dict(ROPE, qk_norm_after_rope=True)
        )
    )
    params, x = init_params(cfg), _x(1, 5)
    assert_close(get_backend("numpy").run(cfg, params, x), reference_mha(cfg, params, x), "float64")
    oracle = get_backend("numpy-best")
    assert variant not in oracle.variants
    with pytest.raises(UnsupportedCase, match=variant):
        oracle.run(cfg, params, x)


@pytest.mark.parametrize(
    "fields",
    [dict(NOPE, attn_temperature_tuning=True, floor_scale=2), dict(ROPE, qk_norm_after_rope=True)],
    ids=["temperature", "qk_norm_after_rope"],
)
def test_diagnose_agrees_with_the_forms_done_right(fields):
    """diagnose's simulator has their steps (their entries' DiagnoseSpec): the oracle's forward and decode loop are
    diagnosed "agrees" (their mistakes named: tests/test_diagnose_forms.py)."""
    from mha_rosetta.core.decode import reference_decode
    from mha_rosetta.diagnose import diagnose, diagnose_decode

    cfg = MHAConfig(**fields)

    def candidate(params, query, key, value, mask):
        return reference_mha(cfg, params, query, key, value, mask)

    def loop(params, x, prefill, step, mask, positions):
        return reference_decode(cfg, params, x, prefill=prefill, step=step, mask=mask, positions=positions)

    forward, decode = diagnose(candidate, cfg), diagnose_decode(loop, cfg)
    assert forward.agrees and decode.agrees, (forward.summary(), decode.summary())
