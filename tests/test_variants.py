"""The variants of 2024-26 attention in the spec (issue 24): hand-computed values, finite differences, bad input.

Every formula of `core.variants` is checked by hand on a case small enough to write down,
then against the library function it copies where that library is installed (BLOOM's
ALiBi slopes, T5's bucket function), and the backward oracle against central differences
on every variant case of the check.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mha_rosetta.checks.cases import SPEC_CASES
from mha_rosetta.core import (
    BASE_STAGE_NAMES,
    VARIANTS,
    MHAConfig,
    alibi_slopes,
    default_cotangent,
    grad_stage_names,
    init_params,
    reference_mha,
    reference_mha_vjp,
    reference_stages,
    rms_norm,
    softmax_with_sinks,
    stage_names,
    t5_buckets,
    validate_params,
)
from mha_rosetta.core.variants import VARIANT_REGISTRY

VARIANT_CASES = [name for name, case in SPEC_CASES.items() if case.cfg.variants]


def test_every_variant_has_a_check_case():
    covered = {v for name in VARIANT_CASES for v in SPEC_CASES[name].cfg.variants}
    assert covered == set(VARIANTS)


# -- ALiBi ----------------------------------------------------------------------------------
def test_alibi_slopes_by_hand():
    # A power of two: 2**(-8k/n), k = 1..n.
    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_array_equal(alibi_slopes(4), 2.0 ** -(2.0 * np.arange(1, 5)))
    # 6 heads: the 4-head series, then the odd terms 1 and 3 of the 8-head series (2**-1, 2**-3).
    np.testing.assert_array_equal(alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    # The mistake diagnose knows: the power-of-two formula for 6 heads gives other slopes.
    assert not np.allclose(alibi_slopes(6), 2.0 ** (-8.0 * np.arange(1, 7) / 6))


@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 6, 7, 8, 12, 16, 17, 24])
def test_alibi_slopes_equal_bloom(n_heads):
    torch = pytest.importorskip("torch", reason="BLOOM's build_alibi_tensor needs torch")
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom", reason="needs transformers")
    mask = torch.ones(1, 3)
    # build_alibi_tensor returns slope * key position, (heads, 1, keys): position 1 is the slope itself.
    alibi = bloom.build_alibi_tensor(mask, n_heads, torch.float64).reshape(n_heads, 3)
    # BLOOM rounds the base to float32 and raises it to integer powers in float32: a few float32 ulps
    # (exactly equal when the slopes are powers of two, up to 8 heads and for 6).
    np.testing.assert_allclose(alibi[:, 1].numpy(), alibi_slopes(n_heads), rtol=4e-7)


def test_alibi_bias_is_slope_times_key_minus_query_and_sits_after_the_softcap():
    cfg = MHAConfig(d_model=12, n_heads=2, alibi=True, softcap=0.5)
    params = init_params(cfg)
    x = np.random.default_rng(0).standard_normal((1, 4, 12))
    stages = reference_stages(cfg, params, x)
    slopes = alibi_slopes(2)  # 2**-4, 2**-8
    distance = np.arange(4)[None, :] - np.arange(4)[:, None]  # p_j - p_i
    expected = stages["capped_scores"] + slopes[:, None, None] * distance
    np.testing.assert_allclose(stages["biased_scores"][0], expected[0], rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(stages["capped_scores"], 0.5 * np.tanh(stages["scores"] / 0.5), rtol=1e-15)


# -- T5 buckets -----------------------------------------------------------------------------
def test_t5_buckets_by_hand():
    # 8 buckets bidirectional: 4 per sign, 2 exact (0, 1), 2 log-spaced up to 5, then the last one.
    d = np.array([-7, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 9])
    # |d| < 2 exact; 2 + int(log(|d|/2)/log(5/2)*2): |d|=2 -> 2, 3 -> 2, 4 -> 3, 5 -> 4 -> capped at 3.
    expected_abs = np.array([3, 3, 3, 2, 2, 1, 0, 1, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(t5_buckets(d, 8, 5, True), expected_abs + 4 * (d > 0))
    # Unidirectional: future keys share bucket 0 with the query itself; the past counts backwards.
    d = np.array([3, 1, 0, -1, -2, -3, -4, -6, -20])
    # 6 buckets, max_exact 3: 0..2 exact; 3 + int(log(n/3)/log(7/3)*3): 3 -> 3, 4 -> 4, 6 -> 5, 20 -> 5.
    np.testing.assert_array_equal(t5_buckets(d, 6, 7, False), [0, 0, 0, 1, 2, 3, 4, 5, 5])


@pytest.mark.parametrize(
    ("buckets", "max_distance", "bidirectional"), [(32, 128, True), (32, 128, False), (8, 5, True)]
)
def test_t5_buckets_equal_t5s_own_function(buckets, max_distance, bidirectional):
    torch = pytest.importorskip("torch", reason="T5's bucket function needs torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5", reason="needs transformers")
    # Every distance up to 300 either way, including the exact bucket edges (16, 32, 64 and 128 for 32 buckets up to 128).
    d = np.arange(-300, 301)
    theirs = t5.T5Attention._relative_position_bucket(
        torch.from_numpy(d), bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance
    )
    np.testing.assert_array_equal(t5_buckets(d, buckets, max_distance, bidirectional), theirs.numpy())


def test_relative_bias_reads_the_table_by_bucket_and_head():
    cfg = MHAConfig(d_model=8, n_heads=2, rel_buckets=8, rel_max_distance=5, bias=False)
    params = init_params(cfg)
    x = np.random.default_rng(1).standard_normal((1, 5, 8))
    stages = reference_stages(cfg, params, x)
    bias = stages["biased_scores"] - stages["scores"]  # (1, H, Nq, Nk)
    for i in range(5):
        for j in range(5):
            bucket = t5_buckets(np.array(j - i), 8, 5, True)
            np.testing.assert_allclose(bias[0, :, i, j], params.rel_bias[bucket], rtol=1e-14)


# -- window ---------------------------------------------------------------------------------
def _weights(cfg, tokens=6, **kwargs):
    x = np.random.default_rng(2).standard_normal((1, tokens, cfg.d_model))
    return reference_mha(cfg, init_params(cfg), x, return_weights=True, **kwargs)[1][0]  # (H, Nq, Nk)


def test_causal_window_sees_w_keys_including_its_own():
    visible = _weights(MHAConfig(d_model=8, n_heads=2, causal=True, window=3))[0] > 0
    expected = np.array([[0 <= i - j < 3 for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(visible, expected)


def test_two_sided_window_without_causal():
    visible = _weights(MHAConfig(d_model=8, n_heads=2, window=2))[0] > 0
    np.testing.assert_array_equal(visible, np.abs(np.arange(6)[:, None] - np.arange(6)[None, :]) < 2)


def test_window_reads_positions_not_indices():
    # Queries at positions 10..15 over keys at 0..5 (non-causal): |p_i - p_j| < 8 keeps few pairs.
    cfg = MHAConfig(d_model=8, n_heads=2, window=8)
    x = np.random.default_rng(3).standard_normal((1, 6, 8))
    kv = np.random.default_rng(4).standard_normal((1, 6, 8))
    w = reference_mha(cfg, init_params(cfg), x, kv, positions=np.arange(10, 16), return_weights=True)[1][0, 0]
    expected = np.abs(np.arange(10, 16)[:, None] - np.arange(6)[None, :]) < 8
    np.testing.assert_array_equal(w > 0, expected)


def test_a_window_longer_than_the_sequence_is_plain_causal():
    long = MHAConfig(d_model=8, n_heads=2, causal=True, window=50)
    plain = dataclasses.replace(long, window=None)
    np.testing.assert_array_equal(_weights(long), _weights(plain))


# -- softcap, sinks, QK-norm, bias="qkv" ----------------------------------------------------
def test_softcap_by_hand():
    cfg = MHAConfig(d_model=2, n_heads=1, softcap=2.0, bias=False, scale=1.0)
    eye = np.eye(2)
    params = dataclasses.replace(init_params(cfg), w_q=3 * eye, w_k=eye, w_v=eye, w_o=eye)
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    stages = reference_stages(cfg, params, x)
    # q = 3x, k = x: scores 3 on the diagonal, 0 off it; capped 2 tanh(3/2) on the diagonal.
    np.testing.assert_allclose(stages["capped_scores"][0, 0], [[2 * math.tanh(1.5), 0], [0, 2 * math.tanh(1.5)]])
    a = math.exp(2 * math.tanh(1.5))
    np.testing.assert_allclose(stages["weights"][0, 0, 0], [a / (a + 1), 1 / (a + 1)])


def test_sinks_by_hand_and_rows_sum_to_less_than_one():
    scores = np.log(np.array([[[[1.0, 3.0]]]]))  # (1, 1, 1, 2): exp gives 1 and 3
    weights = softmax_with_sinks(scores, np.array([np.log(4.0)]))  # the sink adds exp = 4
    np.testing.assert_allclose(weights[0, 0, 0], [1 / 8, 3 / 8], rtol=1e-15)
    # A row with no allowed key stays all zeros (the spec's rule), sink or not.
    blocked = np.full((1, 1, 1, 2), -np.inf)
    np.testing.assert_array_equal(softmax_with_sinks(blocked, np.array([0.3])), 0.0)
    case = SPEC_CASES["sinks"]
    w = reference_mha(case.cfg, case.params(), case.inputs().query, return_weights=True)[1]
    assert np.all(w.sum(-1) < 1) and np.all(w.sum(-1) > 0.3)


def test_rms_norm_by_hand():
    x = np.array([3.0, 4.0])  # mean(x**2) = 12.5
    np.testing.assert_allclose(rms_norm(x, np.array([1.0, 2.0]), 0.0), [3 / math.sqrt(12.5), 8 / math.sqrt(12.5)])


def test_head_and_projection_qk_norm_differ_and_take_their_statistics_where_they_say():
    head = SPEC_CASES["qk_norm_head"]
    x = head.inputs().query
    stages = reference_stages(head.cfg, head.params(), x)
    # Over each head: every head's normed queries have mean square 1 before the weight.
    unweighted = stages["q_normed"] / head.params().q_norm
    np.testing.assert_allclose(np.mean(unweighted**2, axis=-1), 1.0, rtol=1e-4)  # eps 1e-6 against O(1) values
    proj_cfg = dataclasses.replace(head.cfg, qk_norm="projection")
    proj = init_params(proj_cfg, seed=head.seed)
    proj_stages = reference_stages(proj_cfg, proj, x)
    merged = np.concatenate(list(proj_stages["q_normed"][:, h] for h in range(4)), axis=-1) / proj.q_norm
    np.testing.assert_allclose(np.mean(merged**2, axis=-1), 1.0, rtol=1e-4)  # over the whole projection
    per_head = np.mean((proj_stages["q_normed"] / proj.q_norm.reshape(4, 1, 8)) ** 2, axis=-1)
    assert np.abs(per_head - 1).max() > 0.05  # but not over each head


def test_qkv_bias_has_no_output_bias():
    cfg = MHAConfig(d_model=12, n_heads=3, bias="qkv")
    params = init_params(cfg)
    assert params.b_o is None and params.b_q is not None and params.b_v is not None
    with pytest.raises(ValueError, match=r"params.b_o must be None because cfg.bias is 'qkv'"):
        validate_params(cfg, dataclasses.replace(params, b_o=np.zeros(12)))


# -- parameters, stages ----------------------------------------------------------------------
def test_variant_params_are_nontrivial_and_leave_the_others_unchanged():
    plain = MHAConfig(d_model=12, n_heads=3, n_kv_heads=1)
    every = dataclasses.replace(plain, qk_norm="head", sinks=True, rel_buckets=8)
    a, b = init_params(plain, seed=5), init_params(every, seed=5)
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert b.q_norm.shape == b.k_norm.shape == (4,) and np.abs(b.q_norm - 1).min() > 0
    assert b.sinks.shape == (3,) and np.all(b.sinks != 0)
    assert b.rel_bias.shape == (8, 3)
    proj = init_params(dataclasses.replace(plain, qk_norm="projection"))
    assert proj.q_norm.shape == (12,) and proj.k_norm.shape == (4,)


@pytest.mark.parametrize(
    ("cfg_kwargs", "name", "shape", "fragment"),
    [
        ({"qk_norm": "head"}, "q_norm", (12,), r"params.q_norm has shape \(12,\), expected \(4,\)"),
        ({"qk_norm": "projection"}, "k_norm", (4,), r"params.k_norm has shape \(4,\), expected \(12,\)"),
        ({"sinks": True}, "sinks", (4,), r"params.sinks has shape \(4,\), expected \(3,\)"),
        ({"rel_buckets": 8}, "rel_bias", (3, 8), r"params.rel_bias has shape \(3, 8\), expected \(8, 3\)"),
        ({}, "sinks", (3,), r"params.sinks must be None because cfg.sinks is False"),
        ({"sinks": True}, "sinks", None, r"params.sinks is None but cfg.sinks is True"),
    ],
)
def test_wrong_variant_params_are_named(cfg_kwargs, name, shape, fragment):
    cfg = MHAConfig(d_model=12, n_heads=3, **cfg_kwargs)
    bad = dataclasses.replace(init_params(cfg), **{name: None if shape is None else np.ones(shape)})
    with pytest.raises(ValueError, match=fragment):
        validate_params(cfg, bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"window": 0}, ValueError, "MHAConfig.window must be a positive int, got 0"),
        ({"window": 2.5}, TypeError, "MHAConfig.window must be an int"),
        ({"softcap": -1}, ValueError, "MHAConfig.softcap must be a finite positive number, got -1"),
        ({"softcap": float("inf")}, ValueError, "MHAConfig.softcap"),
        ({"qk_norm": "layer"}, ValueError, "MHAConfig.qk_norm must be None or one of 'head', 'projection'"),
        ({"qk_norm": "head", "norm_eps": 0.0}, ValueError, "MHAConfig.norm_eps must be a finite positive number"),
        ({"bias": "qk"}, TypeError, "MHAConfig.bias must be True, False or 'qkv'"),
        ({"alibi": 1}, TypeError, "MHAConfig.alibi must be a bool"),
        ({"sinks": "yes"}, TypeError, "MHAConfig.sinks must be a bool"),
        ({"rel_buckets": 3}, ValueError, "MHAConfig.rel_buckets must be an even number of at least 4"),
        ({"rel_buckets": 1, "rel_bidirectional": False}, ValueError, "MHAConfig.rel_buckets must be at least 2"),
        ({"rel_buckets": 8, "rel_max_distance": 2}, ValueError, "MHAConfig.rel_max_distance must exceed the 2"),
        ({"rel_buckets": 8, "rel_bidirectional": 1}, TypeError, "MHAConfig.rel_bidirectional must be a bool"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ValueError, "needs rope='half' or 'interleaved'"),
    ],
)
def test_bad_variant_fields_name_the_rule(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        MHAConfig(d_model=12, n_heads=3, **kwargs)


def test_stage_lists_follow_the_variants():
    assert stage_names(MHAConfig(d_model=12, n_heads=3)) == BASE_STAGE_NAMES
    every = MHAConfig(d_model=12, n_heads=3, qk_norm="head", softcap=5.0, alibi=True)
    names = stage_names(every)
    assert names.index("k_heads") < names.index("q_normed") < names.index("q_rotated")
    assert names.index("scores") < names.index("capped_scores") < names.index("biased_scores")
    assert names.index("biased_scores") < names.index("masked_scores")
    grads = grad_stage_names(every)
    assert grads.index("d_biased_scores") < grads.index("d_capped_scores") < grads.index("d_scores")
    assert grads.index("d_q_rotated") < grads.index("d_q_normed") < grads.index("d_q_heads")


# -- the backward oracle against finite differences on every variant case --------------------
@pytest.mark.parametrize("name", VARIANT_CASES)
def test_vjp_of_every_variant_case_matches_central_differences(name):
    case = SPEC_CASES[name]
    cfg, params, data = case.cfg, case.params(), case.inputs()
    args = (data.query, data.key, data.value, data.mask)
    cotangent = default_cotangent(reference_mha(cfg, params, *args).shape)
    grads = reference_mha_vjp(cfg, params, *args, cotangent=cotangent)
    assert tuple(grads.stages) == grad_stage_names(cfg)

    def loss(p, query):
        return float(np.sum(cotangent * reference_mha(cfg, p, query, *args[1:])))

    rng = np.random.default_rng(7)
    eps = 1e-6
    # A tied parameter (k_eq_v: w_v is w_k) is one weight: it moves with the one it is tied to, whose derivative
    # is the sum of both gradients.
    tied = {name: same for variant in cfg.variants for name, same in VARIANT_REGISTRY[variant].tied.items()}
    for pname, array in params.as_dict().items():
        if array is None or pname in tied:
            continue
        together = [pname, *(name for name, same in tied.items() if same == pname)]
        grad = sum(getattr(grads.d_params, name) for name in together)
        assert grad.shape == array.shape, pname
        for flat in rng.choice(array.size, size=min(4, array.size), replace=False):
            idx = np.unravel_index(flat, array.shape)
            plus, minus = array.copy(), array.copy()
            plus[idx] += eps
            minus[idx] -= eps
            numeric = (
                loss(dataclasses.replace(params, **dict.fromkeys(together, plus)), data.query)
                - loss(dataclasses.replace(params, **dict.fromkeys(together, minus)), data.query)
            ) / (2 * eps)
            assert abs(numeric - grad[idx]) <= 1e-6 * (1 + abs(numeric)), (pname, idx, numeric, grad[idx])
    for flat in rng.choice(data.query.size, size=4, replace=False):
        idx = np.unravel_index(flat, data.query.shape)
        plus, minus = data.query.copy(), data.query.copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric = (loss(params, plus) - loss(params, minus)) / (2 * eps)
        assert abs(numeric - grads.d_query[idx]) <= 1e-6 * (1 + abs(numeric)), (idx, numeric)


@pytest.mark.parametrize("name", ["gemma2", "qk_norm_projection", "t5_encoder", "gpt_oss"])
def test_rounded_backward_runs_the_variants_too(name):
    # The half-precision gradient rule's baseline: the same formulas in float32, every stage rounded.
    case = SPEC_CASES[name]
    data = case.inputs()
    exact = reference_mha_vjp(case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    rounded = reference_mha_vjp(
        case.cfg, case.params(), data.query, data.key, data.value, data.mask, rounding="float32"
    )
    for pname, value in exact.d_params.as_dict().items():
        if value is not None:
            np.testing.assert_allclose(getattr(rounded.d_params, pname), value, rtol=2e-3, atol=2e-4, err_msg=pname)


def test_the_variants_page_example_prints_what_the_page_says(capsys):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "variants.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    printed = page.split("```text\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/variants.md", "exec"), {})
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("qk_norm", ["head", "projection"])
def test_rotary_conversion_carries_the_qk_norm_weights(qk_norm):
    from mha_rosetta.core import to_interleaved_params, to_rotate_half_params

    cfg = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, d_k=6, rope="interleaved", qk_norm=qk_norm, causal=True)
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(5).standard_normal((2, 5, 24))
    half_cfg, half = to_rotate_half_params(cfg, params)
    np.testing.assert_allclose(reference_mha(half_cfg, half, x), reference_mha(cfg, params, x), rtol=1e-12, atol=1e-13)
    back_cfg, back = to_interleaved_params(half_cfg, half)
    assert back_cfg == cfg
    np.testing.assert_array_equal(back.q_norm, params.q_norm)
    np.testing.assert_array_equal(back.k_norm, params.k_norm)
    assert not np.array_equal(half.q_norm, params.q_norm)  # the weights did move
