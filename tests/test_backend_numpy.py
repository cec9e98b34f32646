"""The NumPy column-sample adapter against the float64 oracle, stage by stage."""

from __future__ import annotations

import numpy as np
import pytest
from adapter_cases import CASES, empty_rows_case

from mha_rosetta.backends import DIRECT_RESHAPE, PER_HEAD, SLICING, STANDARD, UnsupportedCase, get_backend
from mha_rosetta.backends.frameworks.ops import score_steps
from mha_rosetta.backends.frameworks.ops_numpy import NumpyOps, softmax_inplace
from mha_rosetta.backends.numpy.common import MaskArrays, NumpyPrecision
from mha_rosetta.core import MHAConfig, init_params, reference_mha

CORRECT_STRATEGIES = (STANDARD, PER_HEAD, SLICING)


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


def test_direct_reshape_gives_each_head_a_block_of_tokens(backend):
    """The mistake's head 0 holds tokens 0..N/H-1 with all their features, as the column/row-sample article says."""
    cfg = MHAConfig(d_model=6, n_heads=2)  # 3 features per head
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(0).standard_normal((1, 4, 6))  # 4 tokens
    _, stages = backend.run(cfg, params, x, strategy=DIRECT_RESHAPE, return_stages=True)
    q = stages["q"][0]  # (4, 6) canonical rows
    wrong_head0 = stages["q_heads"][0, 0]  # (4 rows, 3)
    # Row-major (4, 6) read as (2, 4, 3): head 0 is the first 12 numbers, tokens 0 and 1.
    np.testing.assert_array_equal(wrong_head0, q[:2].reshape(4, 3))
    _, good = backend.run(cfg, params, x, return_stages=True)
    np.testing.assert_array_equal(good["q_heads"][0, 0], q[:, :3])  # every token, features 0..2


def test_column_layout_of_native_stages(backend):
    """q is W @ X + b with tokens as columns; heads split by a reshape that is a view."""
    case = CASES[0]
    query = case.inputs().query
    params = case.params()
    prepared, _ = backend.prepare(case.cfg, params, query)
    native = prepared.native_stages()
    H, Dk = case.cfg.n_heads, case.cfg.d_k
    q = native["q"]
    assert q.axes == ("B", "H*Dk", "Nq")
    expected_q0 = params.w_q @ query[0].T + params.b_q[:, None]  # the column/row-sample article's convention A, by hand
    np.testing.assert_allclose(q.value[0], expected_q0, rtol=1e-12, atol=1e-12)
    heads = native["q_heads"]
    assert heads.axes == ("B", "H", "Dk", "Nq")
    assert (heads.relation, heads.parent) == ("view", "q")
    # Head h is rows h*Dk:(h+1)*Dk of q: no transpose anywhere.
    for h in range(H):
        np.testing.assert_array_equal(heads.value[:, h], q.value[:, h * Dk : (h + 1) * Dk])
    assert native["scores"].axes == ("B", "H", "Nk", "Nq")  # one column per query
    merged = native["merged"]
    assert merged.axes == ("B", "H*Dv", "Nq") and (merged.relation, merged.parent) == ("view", "context")
    assert native["output"].axes == ("B", "D", "Nq")
    # The timed result is still in columns; only to_numpy turns it into rows.
    result = prepared.forward()
    assert result.shape == (2, case.cfg.d_model, 7)
    np.testing.assert_allclose(prepared.to_numpy(result), reference_mha(case.cfg, params, query), atol=1e-12)


def test_empty_rows_give_b_o_without_nan_or_warnings(backend):
    # Query 5 of batch item 1 may attend to nothing in any head; query 3 of batch item 0
    # to nothing in head 1 only (see adapter_cases.empty_rows_case).
    cfg = MHAConfig(d_model=15, n_heads=3, bias=True)  # with bias, so the answer is b_o
    params = init_params(cfg, seed=5)
    query, key, value, mask = empty_rows_case(cfg).inputs().arrays
    for strategy in CORRECT_STRATEGIES:
        prepared, _ = backend.prepare(cfg, params, query, key, value, mask, dtype="float32", strategy=strategy)
        with np.errstate(over="raise", invalid="raise", divide="raise"):  # 0/0 or inf - inf would raise
            output = prepared.to_numpy(prepared.forward())
            weights = backend.canonical_stages(prepared)["weights"]
        assert np.isfinite(output).all()
        np.testing.assert_allclose(output[1, 5], params.b_o, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(weights[0, 1, 3], 0.0)
        np.testing.assert_array_equal(weights[1, :, 5], 0.0)
        np.testing.assert_allclose(weights[0, 0, 3].sum(), 1.0, rtol=1e-6)


def test_half_precision_policy_is_recorded(backend):
    case = CASES[0]
    query = case.inputs().query
    for dtype in ("float16", "bfloat16"):
        prepared, _ = backend.prepare(case.cfg, case.params(), query, dtype=dtype)
        assert prepared.info["storage_dtype"] == dtype
        assert prepared.info["compute_dtype"] == "float32"
        assert "rounded" in prepared.info["rounding"]
        stages = prepared.native_stages()
        assert str(stages["weights"].value.dtype) == dtype  # stages are stored in the half type
    prepared, _ = backend.prepare(case.cfg, case.params(), query, dtype="float32")
    assert prepared.info["compute_dtype"] == "float32" and "rounding" not in prepared.info


def test_forward_results_do_not_share_the_workspace(backend):
    case = CASES[0]
    query = case.inputs().query
    prepared, _ = backend.prepare(case.cfg, case.params(), query, dtype="float32")
    assert prepared.info["workspace"]
    first = prepared.forward()
    kept = first.copy()
    second = prepared.forward()
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_array_equal(first, second)


def test_unknown_strategy_is_refused(backend):
    case = CASES[0]
    assert "no strategy 'heads_first'" in backend.unsupported_reason(case.cfg, "float32", "cpu", "heads_first")
    with pytest.raises(UnsupportedCase, match="numpy has no strategy"):
        backend.prepare(case.cfg, case.params(), case.inputs().query, strategy="heads_first")
    assert backend.devices() == ("cpu",)
    assert "no gpu device" in backend.unsupported_reason(case.cfg, "float32", "gpu", STANDARD)


# -- the softmax helpers ------------------------------------------------------------------


def _spec_softmax(scores: np.ndarray, allowed: np.ndarray, axis: int) -> np.ndarray:
    masked = np.where(allowed, scores, -np.inf)
    peak = masked.max(axis=axis, keepdims=True)
    empty = np.isneginf(peak)
    exp = np.exp(masked - np.where(empty, 0.0, peak))
    return np.where(empty, 0.0, exp / np.where(empty, 1.0, exp.sum(axis=axis, keepdims=True)))


@pytest.mark.parametrize("mask_shape", [(1, 1, 6, 5), (3, 1, 6, 5), (1, 4, 6, 5), (3, 4, 6, 5)])
@pytest.mark.parametrize("block_bytes", [1 << 20, 4 * 6 * 5 * 8, 1])  # one block, per batch item, per head
def test_blocked_softmax_equals_whole_tensor_softmax(mask_shape, block_bytes):
    rng = np.random.default_rng(11)
    scores = rng.standard_normal((3, 4, 6, 5)) * 30  # (B, H, Nk, Nq): keys on axis -2
    allowed_qk = rng.random(mask_shape) > 0.5  # (.., Nk=6, Nq=5) in key-major order below
    allowed_qk[..., 0, :] = True
    allowed_qk[0, 0, :, 2] = False  # query 2 of the first block sees nothing
    allowed = allowed_qk.swapaxes(-1, -2)  # caller's (.., Nq, Nk) orientation
    mask = MaskArrays.from_allowed(allowed, keys_axis=-2)
    assert mask.empty_rows is not None
    ops = NumpyOps("float64", keys_axis=-2, block_bytes=block_bytes)
    cfg = MHAConfig(d_model=8, n_heads=4)  # no variant: the mask and the softmax only
    blocked = score_steps(ops, cfg, scores.copy(), blocked=mask.blocked, empty_rows=mask.empty_rows)
    whole = ops.softmax(
        ops.positional_mask(scores.copy(), mask.blocked), mask.empty_rows
    )  # the steps on the whole tensor
    np.testing.assert_array_equal(blocked, whole)
    np.testing.assert_allclose(whole, _spec_softmax(scores, allowed_qk, axis=-2), rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(blocked[0, 0, :, 2], 0.0)


def test_softmax_survives_huge_logits():
    scores = np.array([[1e4, -1e4, 0.0], [3e38, 3e38, 0.0]], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        weights = softmax_inplace(scores.copy(), None, axis=-1)
    np.testing.assert_allclose(weights, [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])


def test_precision_matmul_rounds_only_in_mixed_mode():
    half = NumpyPrecision.for_dtype("float16")
    assert half.mixed and half.compute == np.float32
    a = np.full((1, 4096), 1.0, dtype=np.float16)
    product = half.matmul(a, a.T)  # float32 accumulation: 4096 exactly (float16 would stall at 2048)
    assert product.dtype == np.float32 and product[0, 0] == 4096
    assert half.store(product).dtype == np.float16
    full = NumpyPrecision.for_dtype("float64")
    assert not full.mixed
    out = np.empty((1, 1))
    assert full.matmul(np.ones((1, 3)), np.ones((3, 1)), out=out) is out
