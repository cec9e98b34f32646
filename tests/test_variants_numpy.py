"""The variants in the NumPy column-sample adapter: its layout checked by hand, its hand-written backward
proved by central differences of its own forward, and its helpers against the spec's formulas.

`tests/test_adapters.py` and `tests/test_grad.py` run every variant case against the oracle; this
module checks what is specific to column samples (statistics down each token's column, scores
with one column per query) and the variant parameters' gradients without the oracle in between.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_rosetta.backends import PER_HEAD, SLICING, STANDARD, get_backend
from mha_rosetta.backends.frameworks.ops import score_steps
from mha_rosetta.backends.frameworks.ops_numpy import NumpyOps
from mha_rosetta.backends.numpy.common import MaskArrays
from mha_rosetta.checks.cases import SPEC_CASES
from mha_rosetta.core import (
    MHAConfig,
    MHAParams,
    compare,
    default_cotangent,
    grad_stage_names,
    grad_tolerance,
    init_params,
    reference_mha,
    reference_mha_vjp,
    softmax_with_sinks,
)
from mha_rosetta.core.grad import output_shape
from mha_rosetta.core.variants import NORM_PLACES, VARIANT_REGISTRY, adapted_variants

STRATEGIES = (STANDARD, PER_HEAD, SLICING)
# The variant cases NumPy runs (the gate's, which no adapter applies yet, is refused: tests/test_gate.py).
VARIANT_CASES = [
    case
    for case in SPEC_CASES.values()
    # MLA runs in numpy's own naive and absorbed strategies only: tests/test_mla_numpy.py
    if case.cfg.variants and set(case.cfg.variants) <= adapted_variants("numpy", strategy=STANDARD)
]


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


def _native(backend, cfg, params, x, strategy=STANDARD, **options):
    prepared, _ = backend.prepare(cfg, params, x, strategy=strategy, **options)
    return {name: stage.value for name, stage in prepared.native_stages().items()}, prepared


# -- the forward, in column samples ----------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_qk_norm_over_the_head_gives_every_head_block_unit_rms_down_each_column(backend, strategy):
    cfg = MHAConfig(d_model=12, n_heads=3, n_kv_heads=1, d_k=4, qk_norm="head", norm_eps=1e-6)
    params = init_params(cfg, seed=1)
    x = np.random.default_rng(1).standard_normal((2, 5, 12))
    stages, _ = _native(backend, cfg, params, x, strategy)
    q, q_normed = stages["q"], stages["q_normed"]  # (B, H*Dk, Nq), (B, H, Dk, Nq): tokens are columns
    assert q_normed.shape == (2, 3, 4, 5)
    heads = q.reshape(2, 3, 4, 5)  # row block h is head h
    mean_square = np.mean(heads**2, axis=-2, keepdims=True)  # (B, H, 1, Nq): down each column of each head
    expected = heads / np.sqrt(mean_square + 1e-6) * params.q_norm[:, None]
    np.testing.assert_allclose(q_normed, expected, rtol=1e-14, atol=1e-15)
    unweighted = q_normed / params.q_norm[:, None]
    np.testing.assert_allclose(
        np.sqrt(np.mean(unweighted**2, axis=-2)), np.sqrt(mean_square / (mean_square + 1e-6))[:, :, 0]
    )
    assert stages["k_normed"].shape == (2, 1, 4, 5)  # one kv head


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_qk_norm_over_the_projection_shares_one_statistic_per_token_column(backend, strategy):
    """Over the projection the whole column of H*Dk rows has unit RMS, a single head's block does not."""
    cfg = MHAConfig(d_model=12, n_heads=3, d_k=4, qk_norm="projection", norm_eps=1e-6, bias=False)
    params = init_params(cfg, seed=2)
    x = np.random.default_rng(2).standard_normal((1, 6, 12))
    stages, _ = _native(backend, cfg, params, x, strategy)
    q = stages["q"]  # (B, 12, Nq)
    mean_square = np.mean(q**2, axis=-2, keepdims=True)  # (B, 1, Nq): all twelve rows of a token
    expected = (q / np.sqrt(mean_square + 1e-6) * params.q_norm[:, None]).reshape(1, 3, 4, 6)  # then split
    np.testing.assert_allclose(stages["q_normed"], expected, rtol=1e-14, atol=1e-15)
    per_head_rms = np.sqrt(np.mean((stages["q_normed"] / params.q_norm.reshape(3, 4, 1)) ** 2, axis=-2))
    assert not np.allclose(per_head_rms, 1.0, atol=1e-3)  # the mistake diagnose knows: over the head instead


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("place", NORM_PLACES)
def test_the_norm_before_rotary_reads_its_place_and_weights_from_the_registry(backend, monkeypatch, place, strategy):
    """The layer and its backward take the norm's weights from the registry's step (`NormStep.weight`), never from
    the parameters' names: with an entry whose step swaps the two weights the queries are normalised with the keys'
    weight (by hand here, and as the float64 oracle does), and each weight's gradient is that of the parameter the
    forward read (central differences of the adapter's forward)."""
    name = next(n for n, e in VARIANT_REGISTRY.items() if e.norm_step is not None and e.norm_step.place == place)
    entry = VARIANT_REGISTRY[name]
    assert entry.norm_step is not None
    swapped = dataclasses.replace(entry.norm_step, weights=entry.norm_step.weights[::-1])
    monkeypatch.setitem(VARIANT_REGISTRY, name, dataclasses.replace(entry, norm_step=swapped))
    cfg = MHAConfig(d_model=12, n_heads=3, d_k=4, qk_norm=place, norm_eps=1e-6)  # H = Hkv: the weights' shapes agree
    params = init_params(cfg, seed=3)
    assert params.q_norm is not None and params.k_norm is not None
    assert not np.allclose(params.q_norm, params.k_norm)
    x = np.random.default_rng(3).standard_normal((2, 5, 12))
    stages, _ = _native(backend, cfg, params, x, strategy)
    q = stages["q"]  # (B, H*Dk, Nq): tokens are columns
    # The rows one statistic is taken over: each head's block (B, H, Dk, Nq), a view, or the whole projection.
    rows = q.reshape(2, 3, 4, 5) if place == "head" else q
    normed = rows / np.sqrt(np.mean(rows**2, axis=-2, keepdims=True) + 1e-6)  # down each token's column
    weight = params.k_norm.reshape(-1, 4, 1)  # the keys' weight, as the step says: (1|H, Dk, 1), a view
    expected = normed.reshape(2, 3, 4, 5) * weight  # (B, H, Dk, Nq), a view of the new array
    np.testing.assert_allclose(stages["q_normed"], expected, rtol=1e-14, atol=1e-15)
    out = backend.run(cfg, params, x, strategy=strategy)
    np.testing.assert_allclose(out, reference_mha(cfg, params, x), rtol=1e-12, atol=1e-13)  # the oracle reads it too
    cot = default_cotangent(out.shape)
    grads = backend.run_vjp(cfg, params, x, cotangent=cot, strategy=strategy)
    np.testing.assert_allclose(grads.d_query, reference_mha_vjp(cfg, params, x, cotangent=cot).d_query, rtol=1e-9)
    # Each weight's gradient on the parameter whose value the forward read: central differences of the forward.
    eps = 1e-5
    for field in ("q_norm", "k_norm"):
        value, analytic = getattr(params, field), getattr(grads.d_params, field)
        for i in range(value.size):
            moved = [
                MHAParams(**{**params.as_dict(), field: value + sign * eps * np.eye(value.size)[i]}) for sign in (1, -1)
            ]
            plus, minus = (float(np.sum(cot * backend.run(cfg, m, x, strategy=strategy))) for m in moved)
            fd = (plus - minus) / (2 * eps)
            assert abs(fd - analytic[i]) <= 1e-7 * max(1.0, abs(fd)), (field, i, fd, analytic[i])


def test_softcap_and_alibi_on_scores_with_one_column_per_query(backend):
    cfg = MHAConfig(d_model=8, n_heads=2, softcap=0.7, alibi=True)  # slopes 2**-4, 2**-8
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(3).standard_normal((1, 5, 8))
    stages, prepared = _native(backend, cfg, params, x)
    native = prepared.native_stages()
    assert native["capped_scores"].axes == native["biased_scores"].axes == ("B", "H", "Nk", "Nq")
    np.testing.assert_allclose(stages["capped_scores"], 0.7 * np.tanh(stages["scores"] / 0.7), rtol=1e-15)
    assert np.abs(stages["capped_scores"]).max() < 0.7
    j, i = np.arange(5)[:, None], np.arange(5)[None, :]  # key rows, query columns
    for h, slope in enumerate((2.0**-4, 2.0**-8)):
        added = stages["biased_scores"][0, h] - stages["capped_scores"][0, h]
        np.testing.assert_allclose(added, slope * (j - i), rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sinks_take_their_share_of_each_query_column(backend, strategy):
    cfg = MHAConfig(d_model=9, n_heads=3, sinks=True, causal=True)
    params = init_params(cfg, seed=4)
    x = np.random.default_rng(4).standard_normal((2, 4, 9))
    stages, _ = _native(backend, cfg, params, x, strategy)
    masked = stages["masked_scores"]  # (B, H, Nk, Nq), -inf above the diagonal
    exp_sum = np.exp(masked).sum(axis=-2)  # (B, H, Nq): over the keys of each column
    sink = np.exp(params.sinks)[None, :, None]
    np.testing.assert_allclose(stages["weights"].sum(axis=-2), exp_sum / (sink + exp_sum), rtol=1e-14)
    assert (stages["weights"].sum(axis=-2) < 1).all()


def test_blocked_scores_pipeline_equals_the_steps_and_the_spec():
    """NumPy's score steps per block (softcap, bias, mask and sinks): the whole-tensor steps, bit for bit."""
    rng = np.random.default_rng(11)
    scores = rng.standard_normal((3, 4, 6, 5)) * 4  # (B, H, Nk, Nq)
    bias = rng.standard_normal((1, 4, 6, 5))
    sinks = rng.standard_normal(4)[None, :, None, None]  # (1, H, 1, 1)
    allowed = rng.random((3, 1, 5, 6)) > 0.4  # (B, 1, Nq, Nk)
    allowed[0, 0, 2] = False  # query 2 of item 0 sees nothing: its column is all zeros
    mask = MaskArrays.from_allowed(allowed, keys_axis=-2)
    cfg = MHAConfig(d_model=8, n_heads=4, softcap=2.5, alibi=True, sinks=True)  # the steps on; the bias is given
    ops = NumpyOps("float64", keys_axis=-2)
    whole = ops.add_score_bias(ops.softcap(scores.copy(), 2.5), bias)
    whole = ops.softmax(ops.positional_mask(whole, mask.blocked), mask.empty_rows, sinks=sinks)
    spec_scores = np.where(allowed.swapaxes(-1, -2), 2.5 * np.tanh(scores / 2.5) + bias, -np.inf)
    spec = softmax_with_sinks(spec_scores.swapaxes(-1, -2), sinks[0, :, 0, 0]).swapaxes(-1, -2)
    np.testing.assert_allclose(whole, spec, rtol=1e-14, atol=1e-300)
    np.testing.assert_array_equal(whole[0, :, :, 2], 0.0)
    for block_bytes in (1 << 20, 4 * 6 * 5 * 8, 1):  # one block, per batch item, per (item, head)
        ops = NumpyOps("float64", keys_axis=-2, block_bytes=block_bytes)
        parts = {"bias": bias, "blocked": mask.blocked, "empty_rows": mask.empty_rows, "sinks": sinks}
        blocked = score_steps(ops, cfg, scores.copy(), **parts)
        np.testing.assert_array_equal(blocked, whole)


# -- the hand-written backward ---------------------------------------------------------------
GRAD_CASES = ("qk_norm_head", "qk_norm_projection", "sinks", "t5_encoder", "t5_decoder", "gpt_oss", "softcap")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case_name", GRAD_CASES)
def test_variant_parameter_gradients_match_central_differences_of_the_numpy_forward(backend, case_name, strategy):
    """Every entry of q_norm, k_norm, sinks and rel_bias, and a direction through the inputs, by the adapter alone."""
    case = SPEC_CASES[case_name]
    cfg, params, data = case.cfg, case.params(), case.inputs()
    where = {"positions": data.positions, "kv_positions": data.kv_positions}
    cot = default_cotangent(output_shape(cfg, data.query))
    grads = backend.run_vjp(cfg, params, data.query, data.key, data.value, data.mask, cot, strategy=strategy, **where)

    def loss(moved: MHAParams, query=data.query) -> float:
        out = backend.run(cfg, moved, query, data.key, data.value, data.mask, strategy=strategy, **where)
        return float(np.sum(cot * out))

    eps, checked = 1e-5, 0
    for name in ("q_norm", "k_norm", "sinks", "rel_bias", "b_q"):
        value, analytic = getattr(params, name), getattr(grads.d_params, name)
        if value is None:
            assert analytic is None, name
            continue
        assert analytic.shape == value.shape, name
        for index in np.ndindex(value.shape):
            step = np.zeros_like(value)
            step[index] = eps
            plus = loss(MHAParams(**{**params.as_dict(), name: value + step}))
            minus = loss(MHAParams(**{**params.as_dict(), name: value - step}))
            fd = (plus - minus) / (2 * eps)
            assert abs(fd - analytic[index]) <= 1e-7 * max(1.0, abs(fd)), (name, index, fd, analytic[index])
            checked += 1
    direction = np.random.default_rng(0).standard_normal(data.query.shape)
    fd = (loss(params, data.query + eps * direction) - loss(params, data.query - eps * direction)) / (2 * eps)
    assert abs(fd - np.sum(grads.d_query * direction)) <= 1e-7 * max(1.0, abs(fd))
    assert checked > 0


@pytest.mark.parametrize("case", VARIANT_CASES, ids=str)
def test_backward_stages_of_the_variants_are_exposed_and_match_the_oracle(backend, case):
    data = case.inputs()
    args = (case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    where = {"positions": data.positions, "kv_positions": data.kv_positions}
    expected = reference_mha_vjp(*args, **where)
    grads = backend.run_vjp(*args, **where)
    assert tuple(grads.stages) == grad_stage_names(case.cfg)  # the new ones only with their variant, in order
    for name, value in grads.stages.items():
        assert compare(value, expected.stages[name], "float64", **vars(grad_tolerance("float64", value))).ok, name


@pytest.mark.parametrize(
    ("case", "dtype"),
    [(case, dtype) for case in VARIANT_CASES for dtype in case.dtypes if dtype != "float64"],
    ids=str,
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_variant_gradients_in_each_cases_own_lower_precision(backend, case, dtype, strategy):
    """float32, float16 and bfloat16 (stored half, computed float32) within the gradient tolerance of the dtype."""
    data = case.inputs()
    args = (case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    where = {"positions": data.positions, "kv_positions": data.kv_positions}
    expected = reference_mha_vjp(*args, **where).tensors()
    actual = backend.run_vjp(*args, dtype=dtype, strategy=strategy, **where).tensors()
    assert set(actual) == set(expected)
    bad = [n for n, e in expected.items() if not compare(actual[n], e, dtype, **vars(grad_tolerance(dtype, e))).ok]
    assert not bad, bad


@st.composite
def variant_configs(draw):
    """Random sizes with every variant switched on or off at random (the window and the norms on positions)."""
    n_kv = draw(st.integers(1, 2))
    rope = draw(st.sampled_from([None, "half", "interleaved"]))
    cfg = MHAConfig(
        d_model=draw(st.integers(2, 9)),
        n_heads=n_kv * draw(st.integers(1, 3)),
        n_kv_heads=n_kv,
        d_k=2 * draw(st.integers(1, 2)) if rope else draw(st.integers(1, 4)),
        d_v=draw(st.integers(1, 4)),
        kdim=5,
        vdim=4,
        rope=rope,
        bias=draw(st.sampled_from([True, False, "qkv"])),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([None, 1, 3])),
        softcap=draw(st.sampled_from([None, 0.7])),
        qk_norm=draw(st.sampled_from([None, "head", "projection"])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        rel_buckets=draw(st.sampled_from([None, 4])),
        rel_max_distance=4,
        rel_bidirectional=draw(st.booleans()),
    )
    seed = draw(st.integers(0, 1000))
    rng = np.random.default_rng(seed)
    nq, nk = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    x, kv, value = (
        rng.standard_normal((2, nq, cfg.d_model)),
        rng.standard_normal((2, nk, 5)),
        rng.standard_normal((2, nk, 4)),
    )
    mask = rng.random((2, cfg.n_heads, nq, nk)) < 0.7 if draw(st.booleans()) else None
    return cfg, init_params(cfg, seed), x, kv, value, mask


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=variant_configs())
def test_property_numpy_variant_backward_matches_the_oracle(drawn):
    cfg, params, x, kv, value, mask = drawn
    cot = default_cotangent(output_shape(cfg, x))
    expected = reference_mha_vjp(cfg, params, x, kv, value, mask, cot).tensors()
    for strategy in STRATEGIES:
        actual = get_backend("numpy").run_vjp(cfg, params, x, kv, value, mask, cot, strategy=strategy).tensors()
        assert set(actual) == set(expected)
        for name, e in expected.items():
            assert compare(actual[name], e, "float64", **vars(grad_tolerance("float64", e))).ok, (strategy, name)
