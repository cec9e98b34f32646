"""MHAConfig: defaults, derived sizes and the errors for invalid combinations."""

import math

import pytest

from mha_rosetta.core import MHAConfig


def test_defaults_follow_the_contract():
    cfg = MHAConfig(d_model=12, n_heads=3)
    assert (cfg.d_k, cfg.d_v, cfg.n_kv_heads, cfg.kdim, cfg.vdim) == (4, 4, 3, 12, 12)
    assert cfg.bias is True and cfg.causal is False
    assert cfg.scale == pytest.approx(0.5)


def test_explicit_head_sizes_are_independent_of_d_model():
    cfg = MHAConfig(d_model=10, n_heads=3, d_k=7, d_v=2, kdim=9, vdim=11)
    assert (cfg.q_width, cfg.k_width, cfg.v_width, cfg.context_width) == (21, 21, 6, 6)
    assert cfg.scale == pytest.approx(1 / math.sqrt(7))


def test_gqa_grouping_matches_torch_and_jax():
    cfg = MHAConfig(d_model=24, n_heads=6, n_kv_heads=2)
    assert cfg.group_size == 3
    assert [cfg.kv_head_of(h) for h in range(6)] == [0, 0, 0, 1, 1, 1]


def test_resolved_configs_compare_equal():
    assert MHAConfig(d_model=12, n_heads=3) == MHAConfig(d_model=12, n_heads=3, d_k=4, d_v=4, n_kv_heads=3)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"d_model": 10, "n_heads": 3}, ValueError, "d_model=10 is not divisible by n_heads=3; pass d_k"),
        ({"d_model": 12, "n_heads": 4, "n_kv_heads": 3}, ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"d_model": 0, "n_heads": 1}, ValueError, "MHAConfig.d_model must be a positive int, got 0"),
        ({"d_model": 12, "n_heads": 0}, ValueError, "MHAConfig.n_heads must be a positive int, got 0"),
        ({"d_model": 12.0, "n_heads": 3}, TypeError, "MHAConfig.d_model must be an int, got 12.0"),
        ({"d_model": True, "n_heads": 1}, TypeError, "MHAConfig.d_model must be an int"),
        ({"d_model": 12, "n_heads": 3, "d_k": -1}, ValueError, "MHAConfig.d_k must be a positive int, got -1"),
        ({"d_model": 12, "n_heads": 3, "scale": 0.0}, ValueError, "MHAConfig.scale must be a finite positive number"),
        ({"d_model": 12, "n_heads": 3, "scale": float("nan")}, ValueError, "MHAConfig.scale"),
        ({"d_model": 12, "n_heads": 3, "bias": 1}, TypeError, "MHAConfig.bias must be True, False or"),
    ],
)
def test_invalid_configs_name_field_value_and_rule(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        MHAConfig(**kwargs)


def test_config_is_frozen():
    cfg = MHAConfig(d_model=12, n_heads=3)
    with pytest.raises(AttributeError):
        cfg.d_model = 24
