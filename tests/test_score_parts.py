"""The score parts read from core's registry (`backends.frameworks.score_parts`): what every adapter lays out
instead of naming the sinks or ALiBi. NumPy only: the layouts the adapters pass are their own business, checked
by the check suites; here, that the registry hands out the right parameters, heads and slopes."""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends.frameworks.score_parts import (
    distance_slopes,
    head_params,
    head_slice,
    part_names,
    part_params,
    picked_parts,
    score_parts,
    softmax_part,
)
from mha_rosetta.core import MHAConfig, init_params
from mha_rosetta.core.variants import alibi_slopes

SINKS = MHAConfig(d_model=20, n_heads=5, sinks=True)  # d_k = 4
PLAIN = MHAConfig(d_model=20, n_heads=5)


def test_the_sinks_are_the_one_part_and_feed_the_softmax():
    assert part_names() == ("sinks",)
    assert [spec.name for spec in part_params(SINKS)] == ["sinks"]
    assert part_params(PLAIN) == ()
    assert softmax_part(SINKS).name == "sinks"
    assert softmax_part(PLAIN) is None


def test_score_parts_lay_out_the_parameter_from_params_or_a_dict():
    params = init_params(SINKS, seed=3)
    laid = score_parts(SINKS, params, lambda v: v[None, :, None, None])
    assert list(laid) == ["sinks"]
    assert laid["sinks"].shape == (1, 5, 1, 1)
    np.testing.assert_array_equal(laid["sinks"][0, :, 0, 0], params.sinks)
    by_name = score_parts(SINKS, {"sinks": params.sinks * 2}, lambda v: v)
    np.testing.assert_array_equal(by_name["sinks"], params.sinks * 2)
    assert score_parts(PLAIN, init_params(PLAIN, seed=3), lambda v: v) == {}
    # JAX's per-head dict holds other entries beside the parts: only the parts are picked.
    assert picked_parts(SINKS, {"sinks": 1.5, "slope": 0.25}) == {"sinks": 1.5}


def test_head_params_cut_each_parameter_along_its_own_head_axis():
    cfg = MHAConfig(d_model=20, n_heads=5, sinks=True, rel_buckets=6)
    params = init_params(cfg, seed=4)
    specs = {spec.name: spec for spec in head_params()}
    assert set(specs) == {"sinks", "rel_bias"}
    heads = slice(1, 3)
    np.testing.assert_array_equal(params.sinks[head_slice(specs["sinks"], heads)], params.sinks[1:3])
    rel = params.rel_bias[head_slice(specs["rel_bias"], heads)]  # (buckets, 2): columns 1 and 2
    assert rel.shape == (6, 2)
    np.testing.assert_array_equal(rel, params.rel_bias[:, 1:3])


@pytest.mark.parametrize("heads", [4, 6])
def test_distance_slopes_are_alibis_and_none_without_it(heads):
    cfg = MHAConfig(d_model=3 * heads, n_heads=heads, causal=True, alibi=True)
    slopes = distance_slopes(cfg)
    np.testing.assert_array_equal(slopes, alibi_slopes(heads))
    # 6 heads: the 4-head series 2**(-2k), then terms 1 and 3 of the 8-head series 2**(-k): not a power of two
    if heads == 6:
        np.testing.assert_allclose(slopes, [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125], rtol=0, atol=0)
    assert distance_slopes(MHAConfig(d_model=3 * heads, n_heads=heads)) is None
