"""diagnose takes a port written in MLX: mlx-lm's classic nn.RoPE(traditional=...) bug is named, with its repair.

The candidate (examples/my_mlx_attention.py) returns lazy MLX arrays, built in the diagnosis's worker thread:
MLX's streams are per thread, so the result is evaluated there (`diagnose.calling`), then read through the
framework layer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")

from conftest import load_example
from mha_rosetta.core import MHAConfig
from mha_rosetta.diagnose import diagnose

EXAMPLE = load_example("my_mlx_attention")
candidate, fixed_candidate = EXAMPLE.candidate, EXAMPLE.fixed_candidate

CFG = MHAConfig(d_model=16, n_heads=4, rope="half")


def test_the_traditional_flag_bug_is_named_rope_convention():
    result = diagnose(candidate, CFG, dtype="float32")
    assert not result.agrees and result.max_error > 0.5
    assert result.causes[0].code == "rope_convention"
    assert "rope='half'" in result.causes[0].fix


def test_the_fixed_port_agrees_and_its_empty_row_is_a_known_difference():
    result = diagnose(fixed_candidate, CFG, dtype="float32")
    assert result.agrees, result.summary()
    assert any("average of all values" in note for note in result.known_differences)  # MLX SDPA: the mean of V
