"""Scaled rotary frequencies (`core.rope_scaling`): every type by hand, against transformers, and every bad input.

Hand-computed (no framework): the plain frequencies, linear's ``inv / factor``, dynamic's
base below and above the original length (``100 * 3**2 = 900``), Llama 3.1's three bands
with one smoothed pair worked out in scalars, YaRN's correction range and mscale
``0.1 ln(32) + 1`` for gpt-oss's settings. Against transformers' ``ROPE_INIT_FUNCTIONS``
(a tiny ``LlamaConfig`` per case, several head dims, partial rotary, dynamic below and above
the original length, and the real ``GptOssConfig`` defaults and Llama 3.1 settings).
Transformers computes its tables in float32 and the spec in float64, so those comparisons
are at float32 tolerance. Every error names its key.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import python_stdout
from mha_rosetta.core.rope_scaling import (
    ROPE_SCALING_TYPES,
    describe_rope_scaling,
    scaled_frequencies,
    validate_rope_scaling,
    yarn_attention_factor,
    yarn_correction_range,
)

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Phi-3-style longrope on 4 pairs (rope_dims 8), original length 8, factor 4
PHI3 = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.0, 2.0, 4.0],
    "long_factor": [1.0, 2.0, 8.0, 16.0],
    "original_max_position_embeddings": 8,
    "factor": 4.0,
}
GPT_OSS = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# Float32 tables (transformers) against float64 (the spec), relative, no atol (frequencies go
# down to 1e-6). Measured worst relative differences over the cases below: linear 3.2e-7,
# dynamic 4.4e-7, llama3 3.4e-7 (a few float32 ulps of `base ** (2i/r)`), yarn 1.9e-6 (its ramp
# `(i - low) / (high - low)` is also taken in float32). 1e-5 is 84 float32 eps.
HF_RTOL = 1e-5


def _plain(rope_dims: int, base: float) -> np.ndarray:
    return base ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)


# -- the normalised form ------------------------------------------------------------------------


def test_the_types():
    assert ROPE_SCALING_TYPES == ("linear", "dynamic", "llama3", "yarn", "proportional", "longrope")


def test_none_is_none():
    assert validate_rope_scaling(None) is None


def test_normalised_form_floats_defaults_and_the_legacy_key():
    assert validate_rope_scaling({"type": "linear", "factor": 2}) == {"rope_type": "linear", "factor": 2.0}
    assert isinstance(validate_rope_scaling({"rope_type": "linear", "factor": 2})["factor"], float)
    assert validate_rope_scaling({"rope_type": "dynamic", "factor": 2, "original_max_position_embeddings": 2048}) == {
        "rope_type": "dynamic",
        "factor": 2.0,
        "original_max_position_embeddings": 2048,
    }
    yarn_64 = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64}
    # yarn's optional keys filled in: transformers' defaults, and None for the factors not given
    filled = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True} | dict.fromkeys(
        ("attention_factor", "mscale", "mscale_all_dim")
    )
    assert validate_rope_scaling(yarn_64) == {**yarn_64, "factor": 4.0, **filled}
    # Both keys, agreeing, are one type; None on an optional yarn key is "not given", as in transformers.
    assert validate_rope_scaling({"rope_type": "linear", "type": "linear", "factor": 3.0})["rope_type"] == "linear"
    yarn = validate_rope_scaling({**GPT_OSS, "beta_fast": None, "attention_factor": None})
    assert yarn["beta_fast"] == 32.0 and yarn["attention_factor"] is None


@pytest.mark.parametrize("value", [LLAMA31, GPT_OSS, {"type": "linear", "factor": 0.5}])
def test_normalising_is_idempotent_and_copies(value):
    once = validate_rope_scaling(value)
    assert validate_rope_scaling(once) == once
    assert once is not value and "type" not in once


def test_describe():
    assert describe_rope_scaling(None) == "none"
    assert describe_rope_scaling({"rope_type": "linear", "factor": 4}) == "linear(factor=4)"
    assert describe_rope_scaling(LLAMA31) == "llama3(factor=8, low=1, high=4, orig=8192)"
    assert describe_rope_scaling(GPT_OSS) == "yarn(factor=32, orig=4096, truncate=False)"
    assert (
        describe_rope_scaling(
            {
                "rope_type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "mscale": 1,
                "mscale_all_dim": 1,
            }
        )
        == "yarn(factor=40, orig=4096, mscale=1, mscale_all_dim=1)"
    )


# -- by hand ------------------------------------------------------------------------------------


def test_no_scaling_is_the_plain_frequencies():
    inv, attention = scaled_frequencies(4, 100.0, None, seq_len=7)
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-15)
    assert inv.dtype == np.float64 and attention == 1.0


def test_linear_divides_every_frequency_by_factor():
    inv, attention = scaled_frequencies(4, 100.0, {"rope_type": "linear", "factor": 4.0}, seq_len=3)
    np.testing.assert_allclose(inv, [0.25, 0.025], rtol=1e-15)
    assert attention == 1.0
    inv, _ = scaled_frequencies(6, 10000.0, {"rope_type": "linear", "factor": 3}, seq_len=3)
    np.testing.assert_array_equal(inv, _plain(6, 10000.0) / 3.0)


def test_dynamic_grows_the_base_only_past_the_original_length():
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 10}
    for seq_len in (1, 9, 10):  # up to L: the plain frequencies
        inv, attention = scaled_frequencies(4, 100.0, dynamic, seq_len)
        np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-15)
        assert attention == 1.0
    # S = 20 = 2L: base' = 100 * (2 * 20 / 10 - 1) ** (4 / 2) = 100 * 9 = 900; pair 1 = 900 ** (-1/2) = 1/30.
    inv, attention = scaled_frequencies(4, 100.0, dynamic, 20)
    np.testing.assert_allclose(inv, [1.0, 1 / 30], rtol=1e-14)
    assert attention == 1.0
    # r = 2: the one pair has frequency base ** 0 = 1 at every length (transformers divides by r - 2 = 0).
    np.testing.assert_array_equal(scaled_frequencies(2, 100.0, dynamic, 1000)[0], [1.0])


def test_llama3_three_bands_by_hand():
    # Llama 3.1: r = 128, base 500000, L = 8192. Wavelength 2 pi / inv_i; pairs with a wavelength
    # under L / 4 = 2048 are kept (i <= 28), over L / 1 = 8192 divided by 8 (i >= 35), between smoothed.
    inv, attention = scaled_frequencies(128, 500000.0, LLAMA31, seq_len=1)
    plain = _plain(128, 500000.0)
    assert attention == 1.0
    np.testing.assert_array_equal(inv[:29], plain[:29])
    np.testing.assert_allclose(inv[35:], plain[35:] / 8, rtol=1e-15)
    assert np.all((inv[29:35] < plain[29:35]) & (inv[29:35] > plain[29:35] / 8))
    # Pair 30 in scalars: s = (L / w - low) / (high - low), then (1 - s) inv / 8 + s inv.
    inv30 = 500000.0 ** (-60 / 128)
    wavelength = 2 * math.pi / inv30
    assert 2048 < wavelength < 8192
    s = (8192 / wavelength - 1) / (4 - 1)
    assert math.isclose(inv[30], (1 - s) * inv30 / 8 + s * inv30, rel_tol=1e-14)


def test_yarn_gpt_oss_correction_range_blend_and_mscale_by_hand():
    # gpt-oss: r = 64, base 150000, L = 4096, beta 32 / 1, not truncated.
    # d(n) = 64 ln(4096 / (2 pi n)) / (2 ln 150000): d(32) = 8.0928, d(1) = 17.3980.
    yarn = validate_rope_scaling(GPT_OSS)
    low = 64 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(150000.0))
    high = 64 * math.log(4096 / (2 * math.pi)) / (2 * math.log(150000.0))
    assert yarn_correction_range(64, 150000.0, yarn) == (low, high)
    assert math.isclose(low, 8.0928, abs_tol=1e-4) and math.isclose(high, 17.3980, abs_tol=1e-4)
    inv, attention = scaled_frequencies(64, 150000.0, GPT_OSS, seq_len=1)
    plain = _plain(64, 150000.0)
    np.testing.assert_array_equal(inv[:9], plain[:9])  # i <= 8 < low: kept
    np.testing.assert_allclose(inv[18:], plain[18:] / 32, rtol=1e-15)  # i >= 18 > high: interpolated
    ramp = (12 - low) / (high - low)
    assert math.isclose(inv[12], plain[12] / 32 * ramp + plain[12] * (1 - ramp), rel_tol=1e-14)
    # The attention factor on cos and sin: m(32) = 0.1 ln 32 + 1.
    assert math.isclose(attention, 0.1 * math.log(32) + 1, rel_tol=1e-15)
    assert math.isclose(attention, 1.3465735902799727, rel_tol=1e-15)


def test_yarn_truncate_rounds_the_range_outwards():
    yarn = validate_rope_scaling({**GPT_OSS, "truncate": True})
    assert yarn_correction_range(64, 150000.0, yarn) == (8.0, 18.0)  # floor(8.09), ceil(17.40)
    inv, _ = scaled_frequencies(64, 150000.0, yarn, seq_len=1)
    plain = _plain(64, 150000.0)
    np.testing.assert_allclose(inv[13], plain[13] / 32 * 0.5 + plain[13] * 0.5, rtol=1e-15)  # ramp (13-8)/10
    # Clamped to [0, r - 1]: a tiny L puts d(32) below 0, a huge one d(1) past r - 1.
    assert (
        yarn_correction_range(8, 10000.0, validate_rope_scaling({**GPT_OSS, "original_max_position_embeddings": 16}))[0]
        == 0.0
    )
    assert (
        yarn_correction_range(8, 10.0, validate_rope_scaling({**GPT_OSS, "original_max_position_embeddings": 10**9}))[1]
        == 7.0
    )


def test_yarn_attention_factor_choices_by_hand():
    base = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    assert yarn_attention_factor(validate_rope_scaling({**base, "attention_factor": 0.75})) == 0.75
    # DeepSeek-style: m(40, 0.707) / m(40, 1) = (0.0707 ln 40 + 1) / (0.1 ln 40 + 1).
    paired = validate_rope_scaling({**base, "mscale": 0.707, "mscale_all_dim": 1.0})
    expected = (0.1 * 0.707 * math.log(40) + 1) / (0.1 * math.log(40) + 1)
    assert math.isclose(yarn_attention_factor(paired), expected, rel_tol=1e-15)
    assert scaled_frequencies(16, 10000.0, paired, 1)[1] == yarn_attention_factor(paired)
    # factor <= 1: m = 1, so no factor on cos and sin.
    assert yarn_attention_factor(validate_rope_scaling({**base, "factor": 1.0})) == 1.0


def test_yarn_factor_on_cos_and_sin_scales_rotated_scores_by_its_square():
    # What the docstring says the factor does once the tables carry it (core.rotary.apply_rotary):
    # the rotated features of q and k each grow by it, the passed-through ones do not.
    from mha_rosetta.core import apply_rotary

    inv, attention = scaled_frequencies(4, 150000.0, GPT_OSS, seq_len=9)
    angles = np.arange(9.0)[:, None] * inv  # (N=9, r/2=2)
    q, k = np.random.default_rng(0).standard_normal((2, 9, 6))  # (N, d_k=6): rope_dims 4 of 6
    for style in ("half", "interleaved"):
        plain = [apply_rotary(x, np.cos(angles), np.sin(angles), style) for x in (q, k)]
        scaled = [apply_rotary(x, attention * np.cos(angles), attention * np.sin(angles), style) for x in (q, k)]
        for p, s in zip(plain, scaled, strict=True):
            np.testing.assert_allclose(s[:, :4], attention * p[:, :4], rtol=1e-14)
            np.testing.assert_array_equal(s[:, 4:], p[:, 4:])
        rotated_scores = scaled[0][:, :4] @ scaled[1][:, :4].T  # (N, N)
        np.testing.assert_allclose(rotated_scores, attention**2 * (plain[0][:, :4] @ plain[1][:, :4].T), rtol=1e-13)
    assert math.isclose(attention**2, 1.8132604, rel_tol=1e-7)


def test_module_imports_no_framework():
    code = (
        "import sys, mha_rosetta.core.rope_scaling\n"
        "frameworks = ('torch', 'jax', 'einops', 'flax', 'equinox', 'keras', 'transformers')\n"
        "print(','.join(sorted(m for m in frameworks if m in sys.modules)))\n"
    )
    assert python_stdout(code) == ""


# -- against transformers' ROPE_INIT_FUNCTIONS --------------------------------------------------


def _hf():
    pytest.importorskip("torch", reason="transformers' rope tables are torch tensors: torch is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'mha-rosetta[models]'")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return LlamaConfig, ROPE_INIT_FUNCTIONS


def _ours(hf_parameters: dict, max_position_embeddings: int) -> tuple[dict, float, float]:
    """(rope_scaling, rope_base, partial_rotary_factor) from transformers' rope_parameters."""
    scaling = {k: v for k, v in hf_parameters.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling["rope_type"] == "dynamic":  # dynamic's L is config.max_position_embeddings in transformers
        scaling["original_max_position_embeddings"] = max_position_embeddings
    return scaling, hf_parameters["rope_theta"], hf_parameters.get("partial_rotary_factor", 1.0)


def _compare(hf_config, rope_dims: int, seq_len: int | None = None):
    _, functions = _hf()
    parameters = hf_config.rope_parameters
    hf_inv, hf_attention = functions[parameters["rope_type"]](hf_config, "cpu", seq_len=seq_len)
    scaling, base, _ = _ours(parameters, hf_config.max_position_embeddings)
    inv, attention = scaled_frequencies(rope_dims, base, scaling, seq_len or 1)
    assert hf_inv.shape == (rope_dims // 2,)
    np.testing.assert_allclose(inv, hf_inv.double().numpy(), rtol=HF_RTOL, atol=0)
    assert math.isclose(attention, hf_attention, rel_tol=1e-15)  # a Python float on both sides
    return inv


# (head_dim, partial_rotary_factor): full and partial rotary, rope_dims = head_dim * factor.
HEADS = [(8, 1.0), (16, 0.5), (48, 1.0), (64, 0.25), (128, 1.0)]
TYPES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 3.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"factor": 8.0, "original_max_position_embeddings": 64},
    "yarn-untruncated": {"factor": 8.0, "original_max_position_embeddings": 64, "truncate": False, "beta_fast": 16.0},
    "yarn-mscale": {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("head_dim,partial", HEADS)
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("name", list(TYPES))
def test_against_transformers(name, head_dim, partial, base):
    LlamaConfig, _ = _hf()
    rope_type = name.split("-")[0]
    extra = TYPES[name]
    max_positions = int(extra.get("factor", 1) * extra.get("original_max_position_embeddings", 128))
    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": rope_type, "rope_theta": base, "partial_rotary_factor": partial, **extra},
    )
    rope_dims = int(head_dim * partial)
    if rope_type == "dynamic":
        below, above = max_positions // 2, 5 * max_positions  # below L: plain; above: a grown base
        np.testing.assert_allclose(_compare(config, rope_dims, below), _plain(rope_dims, base), rtol=1e-15)
        assert np.all(_compare(config, rope_dims, above)[1:] < _plain(rope_dims, base)[1:])
    else:
        _compare(config, rope_dims)


def test_legacy_type_key_against_transformers():
    LlamaConfig, functions = _hf()
    config = LlamaConfig(
        hidden_size=32, num_attention_heads=2, rope_parameters={"type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    )
    hf_inv, _ = functions["linear"](config, "cpu")
    inv, _ = scaled_frequencies(16, 10000.0, {"type": "linear", "factor": 2.0}, 1)
    np.testing.assert_allclose(inv, hf_inv.double().numpy(), rtol=HF_RTOL, atol=0)


def test_gpt_oss_defaults_against_transformers():
    _hf()
    from transformers import GptOssConfig

    config = GptOssConfig()
    parameters = config.rope_parameters
    scaling, base, partial = _ours(parameters, config.max_position_embeddings)
    # The real defaults, as this test's GPT_OSS states them (rope_theta 150000 lives in MHAConfig.rope_base).
    assert validate_rope_scaling(scaling) == validate_rope_scaling(GPT_OSS)
    assert (base, partial, config.head_dim) == (150000.0, 1.0, 64)
    inv = _compare(config, 64)
    np.testing.assert_allclose(inv, scaled_frequencies(64, 150000.0, GPT_OSS, 1)[0], rtol=1e-15)


def test_llama31_settings_against_transformers():
    LlamaConfig, _ = _hf()
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters={**LLAMA31, "rope_theta": 500000.0},
    )
    _compare(config, 128)


# -- bad input: one test per error, each naming its key -----------------------------------------


def _raises(value, kind, *fragments):
    with pytest.raises(kind) as caught:
        validate_rope_scaling(value)
    message = str(caught.value)
    assert message.startswith("MHAConfig.rope_scaling"), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_not_a_dict():
    _raises("linear", TypeError, "must be None or a dict", "'linear'", "str")


def test_no_rope_type():
    _raises({"factor": 2.0}, ValueError, "'rope_type'", "'linear', 'dynamic', 'llama3', 'yarn'", "['factor']")


def test_unknown_rope_type_lists_the_known_ones():
    _raises(
        {"rope_type": "mrope", "factor": 2.0},
        ValueError,
        "['rope_type']",
        "'mrope'",
        "'linear', 'dynamic', 'llama3', 'yarn'",
    )


def test_default_rope_type_is_none():
    _raises({"rope_type": "default"}, ValueError, "'default'", "rope_scaling=None")


def test_rope_type_and_legacy_type_disagree():
    _raises(
        {"rope_type": "linear", "type": "dynamic", "factor": 2.0},
        ValueError,
        "'rope_type'='linear'",
        "'type'='dynamic'",
    )


def _without(value: dict, key: str) -> dict:
    return {k: v for k, v in value.items() if k != key}


MISSING = [
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, "original_max_position_embeddings"),
    *[(_without(LLAMA31, key), key) for key in ("factor", "low_freq_factor", "high_freq_factor")],
    (_without(LLAMA31, "original_max_position_embeddings"), "original_max_position_embeddings"),
    *[(_without(GPT_OSS, key), key) for key in ("factor", "original_max_position_embeddings")],
    *[(_without(PHI3, key), key) for key in ("short_factor", "long_factor", "original_max_position_embeddings")],
]


@pytest.mark.parametrize("value,key", MISSING)
def test_missing_key_for_its_type(value, key):
    message = _raises(value, ValueError, f"[{key!r}] is required", f"rope_type={value['rope_type']!r}", "missing")
    if value["rope_type"] == "dynamic":  # where transformers keeps dynamic's length
        assert "config.max_position_embeddings" in message


def test_unknown_extra_key():
    _raises(
        {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
        ValueError,
        "unknown key 'low_freq_factor'",
        "'factor'",
    )


@pytest.mark.parametrize(
    "key,home", [("rope_theta", "MHAConfig.rope_base"), ("partial_rotary_factor", "MHAConfig.rope_dims")]
)
def test_keys_mhaconfig_holds_elsewhere(key, home):
    _raises({"rope_type": "linear", "factor": 2.0, key: 0.5}, ValueError, repr(key), home)


@pytest.mark.parametrize(
    "factor,kind",
    [
        (0.0, ValueError),
        (-2.0, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        ("8", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_factor_must_be_finite_and_positive(factor, kind):
    _raises({"rope_type": "linear", "factor": factor}, kind, "['factor']", "a finite number > 0", repr(factor))


@pytest.mark.parametrize(
    "length,kind", [(0, ValueError), (-4096, ValueError), (4096.0, TypeError), (True, TypeError), ("4096", TypeError)]
)
def test_original_length_must_be_a_positive_int(length, kind):
    _raises(
        {**GPT_OSS, "original_max_position_embeddings": length},
        kind,
        "['original_max_position_embeddings']",
        "positive int",
        repr(length),
    )


@pytest.mark.parametrize("low,high", [(4.0, 4.0), (4.0, 1.0)])
def test_llama3_low_freq_factor_below_high(low, high):
    _raises(
        {**LLAMA31, "low_freq_factor": low, "high_freq_factor": high},
        ValueError,
        "['low_freq_factor']",
        "'high_freq_factor'",
        f"low_freq_factor={low:g}",
    )


@pytest.mark.parametrize("key", ["low_freq_factor", "high_freq_factor"])
def test_llama3_band_factors_positive(key):
    _raises({**LLAMA31, key: 0.0}, ValueError, f"[{key!r}]", "a finite number > 0", "0.0")


def test_yarn_beta_fast_at_least_beta_slow():
    _raises(
        {**GPT_OSS, "beta_fast": 1.0, "beta_slow": 32.0},
        ValueError,
        "['beta_fast']",
        "'beta_slow'",
        "beta_fast=1, beta_slow=32",
    )


@pytest.mark.parametrize("key", ["beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"])
def test_yarn_zero_option_is_refused_not_read_as_a_default(key):
    # mscale and mscale_all_dim come as a pair; the other one of the pair is a valid 1.0.
    pair = {"mscale": 1.0, "mscale_all_dim": 1.0} if key in ("mscale", "mscale_all_dim") else {}
    value = {**GPT_OSS, **pair, key: 0}
    _raises(value, ValueError, f"[{key!r}]", "a finite number > 0", "got 0.0")


@pytest.mark.parametrize("lone,other", [("mscale", "mscale_all_dim"), ("mscale_all_dim", "mscale")])
def test_yarn_mscale_without_its_pair(lone, other):
    _raises({**GPT_OSS, lone: 1.0}, ValueError, f"[{lone!r}] is given without {other!r}", "pass both")


@pytest.mark.parametrize("truncate", [None, 1, "False"])
def test_yarn_truncate_must_be_a_bool(truncate):
    _raises({**GPT_OSS, "truncate": truncate}, TypeError, "['truncate']", "True or False", repr(truncate))


def test_yarn_base_one():
    with pytest.raises(ValueError, match=r"^MHAConfig.rope_scaling: rope_type='yarn' needs MHAConfig.rope_base != 1"):
        scaled_frequencies(8, 1.0, GPT_OSS, 1)


@pytest.mark.parametrize(
    "args,name,kind",
    [
        ((3, 10000.0, None, 1), "rope_dims", ValueError),
        ((0, 10000.0, None, 1), "rope_dims", ValueError),
        ((4.0, 10000.0, None, 1), "rope_dims", TypeError),
        ((4, 0.0, None, 1), "base", ValueError),
        ((4, math.nan, None, 1), "base", ValueError),
        ((4, "1e4", None, 1), "base", TypeError),
        ((4, 10000.0, None, 0), "seq_len", ValueError),
        ((4, 10000.0, None, 2.5), "seq_len", TypeError),
        ((4, 10000.0, None, True), "seq_len", TypeError),
    ],
)
def test_scaled_frequencies_arguments(args, name, kind):
    with pytest.raises(kind, match=rf"^scaled_frequencies: {name} must be"):
        scaled_frequencies(*args)


def test_scaled_frequencies_takes_numpy_numbers():
    # seq_len = 1 + positions.max() is a NumPy integer; the result is the same as with Python numbers.
    inv, _ = scaled_frequencies(np.int64(8), np.float64(100.0), LLAMA31 | {"factor": 2}, np.int64(5))
    np.testing.assert_array_equal(inv, scaled_frequencies(8, 100.0, LLAMA31 | {"factor": 2}, 5)[0])


def test_scaled_frequencies_validates_a_raw_dict():
    with pytest.raises(ValueError, match=r"^MHAConfig.rope_scaling\['rope_type'\] must be one of"):
        scaled_frequencies(8, 10000.0, {"rope_type": "ntk", "factor": 2.0}, 1)


# -- transformers' rotary module: attention_factor on cos and sin, dynamic's seq_len from the positions --


def _rotary_module(rope_type: str, extra: dict, max_positions: int):
    LlamaConfig, _ = _hf()
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **extra},
    )
    return LlamaRotaryEmbedding(config)


def _module_tables(module, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The first copy of each pair's cos and sin, (tokens, r/2): the module returns them cat'ed twice (rotate_half)."""
    import torch

    cos, sin = module(torch.zeros(1, tokens, 64), torch.arange(tokens)[None])  # (1, tokens, r) each
    return cos[0, :, :8].double().numpy(), sin[0, :, :8].double().numpy()  # r = 16: (tokens, 8)


def _spec_tables(scaling: dict, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    inv, attention = scaled_frequencies(16, 10000.0, scaling, seq_len=tokens)  # positions 0 .. tokens-1
    angles = np.arange(tokens)[:, None] * inv  # (tokens, 8)
    return attention * np.cos(angles), attention * np.sin(angles)


# float32 angles up to 300 rad: 300 * 1.2e-7 = 3.6e-5 at worst; measured 6.7e-6.
MODULE_ATOL = 5e-5

MODULE_CASES = {
    "linear": ({"factor": 4.0}, 512),
    "llama3": (
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        512,
    ),
    "yarn": ({"factor": 8.0, "original_max_position_embeddings": 64}, 512),
    "dynamic": ({"factor": 3.0}, 128),
    # 100 tokens take the short table, 300 the long one (L = 200); factor 4: cos and sin times sqrt(1 + ln 4 / ln 200)
    "longrope": (
        {
            "short_factor": [1.0, 1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0],
            "long_factor": [1.0, 1.4, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0],
            "original_max_position_embeddings": 200,
            "factor": 4.0,
        },
        800,
    ),
}


@pytest.mark.parametrize("rope_type", list(MODULE_CASES))
@pytest.mark.parametrize("tokens", [100, 300])
def test_transformers_rotary_module_cos_and_sin(rope_type, tokens):
    extra, max_positions = MODULE_CASES[rope_type]
    module = _rotary_module(rope_type, extra, max_positions)
    scaling, _, _ = _ours({"rope_type": rope_type, "rope_theta": 10000.0, **extra}, max_positions)
    hf_cos, hf_sin = _module_tables(module, tokens)
    cos, sin = _spec_tables(scaling, tokens)
    np.testing.assert_allclose(cos, hf_cos, rtol=0, atol=MODULE_ATOL)
    np.testing.assert_allclose(sin, hf_sin, rtol=0, atol=MODULE_ATOL)
    if rope_type == "yarn":  # the factor on cos and sin is really there: m(8) = 0.1 ln 8 + 1
        assert math.isclose(module.attention_scaling, 0.1 * math.log(8) + 1, rel_tol=1e-15)
        assert np.abs(hf_cos[0]).max() == pytest.approx(0.1 * math.log(8) + 1, rel=1e-6)  # position 0: cos = 1


def test_transformers_dynamic_module_caches_the_longest_call_and_the_spec_does_not():
    # The module docstring's claim: after a call of 300 tokens, a call of 200 (still past L = 128) keeps
    # the 300-token frequencies in transformers; the spec, a function of the call, gives the 200-token ones.
    extra, max_positions = MODULE_CASES["dynamic"]
    scaling, _, _ = _ours({"rope_type": "dynamic", "rope_theta": 10000.0, **extra}, max_positions)
    module = _rotary_module("dynamic", extra, max_positions)
    _module_tables(module, 300)
    cached_cos, _ = _module_tables(module, 200)
    inv_300, _ = scaled_frequencies(16, 10000.0, scaling, seq_len=300)
    np.testing.assert_allclose(cached_cos, np.cos(np.arange(200)[:, None] * inv_300), rtol=0, atol=MODULE_ATOL)
    assert np.abs(cached_cos - _spec_tables(scaling, 200)[0]).max() > 100 * MODULE_ATOL
    # A fresh module at 200 tokens is the spec's 200-token table.
    fresh_cos, _ = _module_tables(_rotary_module("dynamic", extra, max_positions), 200)
    np.testing.assert_allclose(fresh_cos, _spec_tables(scaling, 200)[0], rtol=0, atol=MODULE_ATOL)


def test_the_docs_page_example_runs_and_prints_what_it_says():
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "rope-scaling.md").read_text(encoding="utf-8")
    example = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "yarn(factor=32, orig=4096, truncate=False)"


# -- longrope (core.longrope) ---------------------------------------------------------------------


def test_longrope_normalised_form_tables_as_tuples_and_idempotent():
    once = validate_rope_scaling({**_without(PHI3, "rope_type"), "type": "longrope"})  # the legacy key
    assert once == {
        "rope_type": "longrope",
        "short_factor": (1.0, 1.0, 2.0, 4.0),
        "long_factor": (1.0, 2.0, 8.0, 16.0),
        "original_max_position_embeddings": 8,
        "factor": 4.0,
        "attention_factor": None,
    }
    assert validate_rope_scaling(once) == once and hash(tuple(sorted(once.items())))  # tuples: hashable
    assert validate_rope_scaling({**_without(PHI3, "factor"), "attention_factor": 1.5})["factor"] is None
    assert validate_rope_scaling({**PHI3, "short_factor": np.array([1, 1, 2, 4])})["short_factor"] == (
        1.0,
        1.0,
        2.0,
        4.0,
    )


def test_longrope_by_hand_the_short_table_up_to_the_original_length_the_long_one_past_it():
    plain = 100.0 ** (-np.arange(0, 8, 2) / 8)  # base 100, r = 8: 1, 0.316, 0.1, 0.0316
    attention = math.sqrt(1 + math.log(4) / math.log(8))  # sqrt(1 + 2/3)
    short, a = scaled_frequencies(8, 100.0, PHI3, 8)  # positions 0..7: S = 8, not past L = 8
    np.testing.assert_allclose(short, plain / [1, 1, 2, 4], rtol=1e-15)
    assert a == pytest.approx(math.sqrt(5 / 3), rel=1e-15) and a == attention
    long, a = scaled_frequencies(8, 100.0, PHI3, 9)  # one more position: the long table, the same factor
    np.testing.assert_allclose(long, plain / [1, 2, 8, 16], rtol=1e-15)
    assert a == attention
    # factor <= 1: no factor on cos and sin; attention_factor given: it, whatever the factor
    assert scaled_frequencies(8, 100.0, {**PHI3, "factor": 1.0}, 9)[1] == 1.0
    assert scaled_frequencies(8, 100.0, {**PHI3, "attention_factor": 1.25}, 1)[1] == 1.25


def test_longrope_describe():
    assert (
        describe_rope_scaling(PHI3) == "longrope(orig=8, factor=4, short=[1, 1, 2, ...], long=[1, 2, 8, ...], pairs=4)"
    )


def test_longrope_through_mhaconfig_and_the_reference():
    from mha_rosetta.core import MHAConfig, init_params, reference_mha

    cfg = MHAConfig(d_model=16, n_heads=2, d_k=8, rope="half", causal=True, rope_scaling=PHI3)
    assert "longrope(orig=8" in cfg.describe()
    params = init_params(cfg, seed=1)
    x = np.random.default_rng(2).standard_normal((1, 9, 16))
    full = reference_mha(cfg, params, x)  # 9 tokens: the long table for every position
    swapped = MHAConfig(**{**cfg.__dict__, "rope_scaling": {**PHI3, "long_factor": PHI3["short_factor"]}})
    assert not np.allclose(full, reference_mha(swapped, params, x), atol=1e-3)
    # the first 8 tokens alone are a call within L: the short table, so the same rows differ from the 9-token call's
    assert not np.allclose(reference_mha(cfg, params, x[:, :8]), full[:, :8], atol=1e-3)
    np.testing.assert_allclose(reference_mha(cfg, params, x[:, :8]), reference_mha(swapped, params, x[:, :8]))


LONGROPE_BAD = [
    ({**PHI3, "short_factor": "1, 1, 2, 4"}, TypeError, ["['short_factor']", "a list of finite numbers > 0", "str"]),
    ({**PHI3, "long_factor": [1.0, -2.0, 8.0, 16.0]}, ValueError, ["['long_factor'][1]", "> 0", "-2.0"]),
    ({**PHI3, "long_factor": [1.0, True, 8.0, 16.0]}, TypeError, ["['long_factor'][1]", "bool"]),
    ({**PHI3, "short_factor": [1.0, float("nan"), 2.0, 4.0]}, ValueError, ["['short_factor'][1]", "nan"]),
    ({**PHI3, "short_factor": []}, ValueError, ["['short_factor']", "0 entries"]),
    ({**PHI3, "short_factor": [1.0, 2.0]}, ValueError, ["same length", "got 2 and 4"]),
    (_without(PHI3, "factor"), ValueError, ["'factor'", "'attention_factor'", "config.max_position_embeddings"]),
    ({**PHI3, "original_max_position_embeddings": 1}, ValueError, ["ln(1) = 0", "'attention_factor'"]),
    ({**PHI3, "mscale": 1.0}, ValueError, ["unknown key 'mscale'", "'short_factor'"]),
]


@pytest.mark.parametrize("value,kind,fragments", LONGROPE_BAD, ids=[str(i) for i in range(len(LONGROPE_BAD))])
def test_longrope_bad_input_names_the_key(value, kind, fragments):
    _raises(value, kind, *fragments)


def test_longrope_tables_need_one_number_per_rotated_pair():
    from mha_rosetta.core import MHAConfig

    with pytest.raises(
        ValueError, match=r"^MHAConfig.rope_scaling\['short_factor'\] has 4 numbers; .* rope_dims / 2 = 2"
    ):
        MHAConfig(d_model=16, n_heads=2, d_k=8, rope="half", rope_dims=4, rope_scaling=PHI3)
    with pytest.raises(ValueError, match=r"\['short_factor'\] has 4 numbers; .* rope_dims / 2 = 3 \(rope_dims=6\)"):
        scaled_frequencies(6, 100.0, PHI3, 1)


def test_longrope_against_transformers_compute_function_both_tables():
    LlamaConfig, functions = _hf()
    extra, max_positions = MODULE_CASES["longrope"]
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **extra},
    )
    for seq_len in (None, 200, 201):  # None: the module's built table (short); 201 > L: long
        hf_inv, hf_attention = functions["longrope"](config, "cpu", seq_len=seq_len)
        inv, attention = scaled_frequencies(16, 10000.0, {"rope_type": "longrope", **extra}, seq_len or 1)
        np.testing.assert_allclose(inv, hf_inv.double().numpy(), rtol=HF_RTOL, atol=0)
        assert math.isclose(attention, hf_attention, rel_tol=1e-15)
    # without factor, transformers takes max_position_embeddings / original (what models.hf_rope reads into factor)
    config.rope_parameters.pop("factor")
    assert math.isclose(functions["longrope"](config, "cpu")[1], math.sqrt(1 + math.log(4) / math.log(200)))
