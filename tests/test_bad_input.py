"""Bad input and numerical edge cases, walked through the oracle and every installed backend.

Each row of ERROR_CASES must raise the documented exception with a message naming the
argument; each row of VALUE_CASES must give the documented value (the float64 oracle's,
which defines the spec) on every implementation. Frameworks that are not installed
drop out of the parametrisation and are reported as skips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import library_absent
from mha_rosetta.backends import (
    REGISTRY,
    BackendNotInstalled,
    UnsupportedCase,
    available_backends,
    get_backend,
    missing_backends,
)
from mha_rosetta.checks.agreement import backend_level
from mha_rosetta.core import MHAConfig, MHAParams, compare, init_params, reference_mha

CFG = MHAConfig(d_model=15, n_heads=3)
CROSS = MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=13)
RNG = np.random.default_rng(99)
X = RNG.standard_normal((2, 7, 15))
KEY = RNG.standard_normal((2, 5, 11))
VALUE = RNG.standard_normal((2, 5, 13))


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    id: str
    error: type[Exception]
    match: str  # a regular expression the message must contain
    call: Callable[[Callable], object]  # receives run(cfg, params, q, k, v, mask, **kw)


def _run_with(cfg=CFG, params=None, query=X, key=None, value=None, mask=None, **kw):
    params = init_params(cfg, seed=0) if params is None else params
    return lambda run: run(cfg, params, query, key, value, mask, **kw)


def _params_with(**changes) -> MHAParams:
    return dataclasses.replace(init_params(CFG, seed=0), **changes)


ERROR_CASES = [
    ErrorCase(
        "query-wrong-width",
        ValueError,
        r"query must have shape \(batch, tokens, d_model=15\)",
        _run_with(query=X[..., :14]),
    ),
    ErrorCase("query-1d", ValueError, r"query must have shape", _run_with(query=np.zeros(15))),
    ErrorCase("query-4d", ValueError, r"query must have shape", _run_with(query=X[None])),
    ErrorCase(
        "key-wrong-kdim",
        ValueError,
        r"key must have shape \(batch, tokens, kdim=11\)",
        _run_with(CROSS, query=X, key=VALUE, value=VALUE),
    ),
    ErrorCase(
        "value-wrong-vdim",
        ValueError,
        r"value must have shape \(batch, tokens, vdim=13\)",
        _run_with(CROSS, query=X, key=KEY, value=KEY),
    ),
    ErrorCase(
        "key-unbatched-query-batched",
        ValueError,
        r"key must have shape \(batch, tokens, kdim=15\)",
        _run_with(key=X[0]),
    ),
    ErrorCase(
        "key-value-token-mismatch",
        ValueError,
        r"key and value must have the same batch and token counts",
        _run_with(CROSS, key=KEY, value=VALUE[:, :4]),
    ),
    ErrorCase(
        "query-key-batch-mismatch",
        ValueError,
        r"query and key must have the same batch size, got 2 and 1",
        _run_with(key=X[:1]),
    ),
    ErrorCase(
        "query-int",
        TypeError,
        r"query must hold floating-point numbers, got dtype int64",
        _run_with(query=np.ones((2, 7, 15), dtype=np.int64)),
    ),
    ErrorCase(
        "query-bool",
        TypeError,
        r"query must hold floating-point numbers, got dtype bool",
        _run_with(query=np.ones((2, 7, 15), dtype=bool)),
    ),
    ErrorCase("query-complex", TypeError, r"query must be real, got complex dtype complex128", _run_with(query=X + 1j)),
    ErrorCase(
        "query-strings",
        TypeError,
        r"query must be a floating-point array, got dtype <U1",
        _run_with(query=np.full((2, 7, 15), "a")),
    ),
    ErrorCase(
        "key-int",
        TypeError,
        r"key must hold floating-point numbers",
        _run_with(key=np.ones((2, 7, 15), dtype=np.int32)),
    ),
    ErrorCase("query-none", TypeError, r"query must be an array", _run_with(query=None)),
    ErrorCase(
        "zero-query-tokens",
        ValueError,
        r"query has a zero-length axis \(shape \(2, 0, 15\)\)",
        _run_with(query=X[:, :0]),
    ),
    ErrorCase("zero-batch", ValueError, r"query has a zero-length axis", _run_with(query=X[:0])),
    ErrorCase("zero-kv-tokens", ValueError, r"key has a zero-length axis", _run_with(key=X[:, :0])),
    ErrorCase(
        "mask-int",
        TypeError,
        r"mask must be boolean with True = may attend, got dtype int64",
        _run_with(mask=np.ones((7, 7), dtype=np.int64)),
    ),
    ErrorCase("mask-float", TypeError, r"mask must be boolean", _run_with(mask=np.zeros((7, 7)))),
    ErrorCase(
        "mask-no-broadcast",
        ValueError,
        r"mask of shape \(7, 6\) does not broadcast to \(batch, heads, q_tokens, kv_tokens\) = \(2, 3, 7, 7\)",
        _run_with(mask=np.ones((7, 6), dtype=bool)),
    ),
    ErrorCase(
        "mask-would-grow",
        ValueError,
        r"mask of shape \(4, 1, 7, 7\) does not broadcast",
        _run_with(mask=np.ones((4, 1, 7, 7), dtype=bool)),
    ),
    ErrorCase(
        "mask-5d",
        ValueError,
        r"mask must broadcast to .* got 5 dims",
        _run_with(mask=np.ones((1, 2, 3, 7, 7), dtype=bool)),
    ),
    ErrorCase(
        "mask-unbatched-4d",
        ValueError,
        r"mask must broadcast to \(heads, q_tokens, kv_tokens\)",
        _run_with(query=X[0], mask=np.ones((1, 3, 7, 7), dtype=bool)),
    ),
    ErrorCase(
        "params-other-config",
        ValueError,
        r"params.w_k has shape \(15, 15\), expected \(15, 11\)",
        _run_with(CROSS, params=init_params(CFG), key=KEY, value=VALUE),
    ),
    ErrorCase(
        "params-missing-bias",
        ValueError,
        r"params.b_q is None but cfg.bias is True",
        _run_with(params=_params_with(b_q=None)),
    ),
    ErrorCase(
        "params-unexpected-bias",
        ValueError,
        r"params.b_q must be None because cfg.bias is False",
        _run_with(MHAConfig(d_model=15, n_heads=3, bias=False), params=init_params(CFG)),
    ),
    ErrorCase(
        "params-int-weights",
        TypeError,
        r"params.w_q must hold floating-point numbers",
        _run_with(params=_params_with(w_q=np.ones((15, 15), dtype=np.int64))),
    ),
    ErrorCase(
        "params-list-weights",
        TypeError,
        r"params.w_v must be a NumPy array, got list",
        _run_with(params=_params_with(w_v=[[0.0] * 15] * 15)),
    ),
    ErrorCase(
        "params-dict", TypeError, r"params must be MHAParams", lambda run: run(CFG, {"w_q": None}, X, None, None, None)
    ),
    ErrorCase(
        "cfg-dict",
        TypeError,
        r"cfg must be an MHAConfig, got dict",
        lambda run: run({"d_model": 15}, init_params(CFG), X, None, None, None),
    ),
]

# Arguments only a backend's run() takes.
BACKEND_ERROR_CASES = [
    ErrorCase(
        "dtype-int8",
        ValueError,
        r"dtype must be one of float64, float32, float16, bfloat16; got 'int8'",
        _run_with(dtype="int8"),
    ),
    ErrorCase("dtype-float128", ValueError, r"dtype must be one of", _run_with(dtype="float128")),
    ErrorCase(
        "device-tpu",
        ValueError,
        r"device must be one of cpu, gpu \('cuda' means 'gpu'\); got 'tpu'",
        _run_with(device="tpu"),
    ),
    ErrorCase(
        "strategy-unknown",
        UnsupportedCase,
        r"has no strategy 'diagonal'",
        _run_with(strategy="diagonal", dtype="float32"),
    ),
]

CONFIG_ERRORS = [
    ({"d_model": 15, "n_heads": 0}, ValueError, r"MHAConfig.n_heads must be a positive int, got 0"),
    ({"d_model": 10, "n_heads": 3}, ValueError, r"d_model=10 is not divisible by n_heads=3; pass d_k"),
    ({"d_model": 12, "n_heads": 6, "n_kv_heads": 4}, ValueError, r"n_heads=6 is not divisible by n_kv_heads=4"),
    ({"d_model": "12", "n_heads": 3}, TypeError, r"MHAConfig.d_model must be an int, got '12'"),
]


def _oracle_run(cfg, params, q, k, v, mask):
    return reference_mha(cfg, params, q, k, v, mask)


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: c.id)
def test_oracle_rejects_bad_input(case):
    with pytest.raises(case.error, match=case.match):
        case.call(_oracle_run)


@pytest.mark.parametrize("backend_name", available_backends())
@pytest.mark.parametrize("case", ERROR_CASES + BACKEND_ERROR_CASES, ids=lambda c: c.id)
def test_every_backend_rejects_bad_input_with_the_same_message(case, backend_name):
    backend = get_backend(backend_name)

    def run(cfg, params, q, k, v, mask, **kw):
        return backend.run(cfg, params, q, k, v, mask, **kw)

    with pytest.raises(case.error, match=case.match):
        case.call(run)


@pytest.mark.parametrize(("kwargs", "error", "match"), CONFIG_ERRORS, ids=[str(c[0]) for c in CONFIG_ERRORS])
def test_invalid_configs(kwargs, error, match):
    with pytest.raises(error, match=match):
        MHAConfig(**kwargs)


def test_unknown_backend_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'tensorflow'; registered backends: numpy, torch"):
        get_backend("tensorflow")


@pytest.mark.parametrize(("backend", "library"), [("torch", "torch"), ("mlx-sdpa", "mlx")])
def test_missing_backend_gives_the_install_command(monkeypatch, backend, library):
    with library_absent(monkeypatch, library):
        assert backend not in available_backends()
        assert (
            missing_backends()[backend]
            == f"backend '{backend}' needs {library}, which is not installed: pip install 'mha-rosetta[{library}]'"
        )
        with pytest.raises(BackendNotInstalled, match=rf"pip install 'mha-rosetta\[{library}\]'"):
            get_backend(backend)


def test_gpu_asked_for_where_there_is_none():
    for name in available_backends():
        backend = get_backend(name)
        if "gpu" in backend.devices():
            continue
        with pytest.raises(UnsupportedCase, match=rf"^{name}: .*no (gpu|CUDA) device"):
            backend.run(CFG, init_params(CFG), X, device="gpu", dtype="float32")


# --- numerical edge cases: every implementation gives the oracle's answer -----------------


@dataclasses.dataclass(frozen=True)
class ValueCase:
    id: str
    cfg: MHAConfig
    dtype: str
    query: np.ndarray
    key: np.ndarray | None = None
    value: np.ndarray | None = None
    mask: np.ndarray | None = None
    params_scale: float = 1.0  # multiplies every weight, to push logits to extremes


def _tokens(*shape, scale=1.0, seed=0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def _with(array, index, value):
    array = array.copy()
    array[index] = value
    return array


def _cross_with_one_bad(case_id: str, which: str, index: tuple, value: float) -> ValueCase:
    """A float32 cross-attention case whose query, key or value (``which``) holds one non-finite entry."""
    inputs = {"query": _tokens(2, 7, 15), "key": _tokens(2, 5, 11, seed=1), "value": _tokens(2, 5, 13, seed=2)}
    inputs[which] = _with(inputs[which], index, value)
    return ValueCase(case_id, CROSS, "float32", **inputs)


def _causal_cross(case_id: str, *, q_tokens: int, kv_tokens: int) -> ValueCase:
    """A float64 causal case whose keys (the values default to them) have another token count than the queries."""
    return ValueCase(
        case_id,
        MHAConfig(d_model=15, n_heads=3, causal=True),
        "float64",
        _tokens(2, q_tokens, 15),
        _tokens(2, kv_tokens, 15, seed=1),
    )


_fully_masked_row = np.ones((7, 7), dtype=bool)
_fully_masked_row[3] = False

VALUE_CASES = [
    ValueCase(
        "logits-1e4-float32",
        MHAConfig(d_model=4, n_heads=1, bias=False, scale=1.0),
        "float32",
        _tokens(2, 5, 4, scale=50.0),
        params_scale=2.0,
    ),
    # Unscaled q.k here reaches 9.8e4 > 65504 (float16's largest); scaled by 1/sqrt(64) it is
    # 1.2e4. An implementation that forms q @ k.T before scaling overflows to inf.
    ValueCase(
        "float16-scale-before-product",
        MHAConfig(d_model=64, n_heads=1, bias=False),
        "float16",
        np.full((1, 3, 64), 5.0) + _tokens(1, 3, 64, scale=0.1),
        params_scale=24.0,
    ),
    _cross_with_one_bad("nan-in-one-query-token", "query", (0, 2, 4), np.nan),
    _cross_with_one_bad("nan-in-one-key-token", "key", (1, 3, 0), np.nan),
    _cross_with_one_bad("inf-in-one-value-token", "value", (0, 1, 5), np.inf),
    ValueCase("row-with-nothing-to-attend", CFG, "float32", _tokens(7, 15), mask=_fully_masked_row),
    ValueCase("all-rows-masked", CFG, "float64", _tokens(2, 7, 15), mask=np.zeros((2, 1, 1, 7), dtype=bool)),
    _causal_cross("causal-more-kv-than-q", q_tokens=3, kv_tokens=6),
    _causal_cross("causal-more-q-than-kv", q_tokens=6, kv_tokens=3),
    ValueCase("single-token", CFG, "float64", _tokens(1, 1, 15)),
    ValueCase("single-head", MHAConfig(d_model=15, n_heads=1), "float64", _tokens(2, 7, 15)),
    ValueCase("width-one", MHAConfig(d_model=1, n_heads=1), "float64", _tokens(2, 7, 1)),
    ValueCase("mask-all-true-equals-none", CFG, "float64", _tokens(2, 7, 15), mask=np.ones((1, 1, 1, 1), dtype=bool)),
    ValueCase("unbatched-with-head-mask", CFG, "float64", _tokens(7, 15), mask=np.tril(np.ones((3, 7, 7), dtype=bool))),
]


def _scaled_params(case: ValueCase) -> MHAParams:
    params = init_params(case.cfg, seed=11)
    return dataclasses.replace(params, **{n: params.as_dict()[n] * case.params_scale for n in ("w_q", "w_k")})


# NaN and inf inputs propagate (documented); NumPy's warnings about them are expected here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)


@pytest.mark.parametrize("case", VALUE_CASES, ids=lambda c: c.id)
def test_oracle_documented_values(case):
    params = _scaled_params(case)
    out = reference_mha(case.cfg, params, case.query, case.key, case.value, case.mask)
    if case.id == "row-with-nothing-to-attend":
        np.testing.assert_allclose(out[3], params.b_o, rtol=0, atol=1e-12)
    if case.id == "all-rows-masked":
        np.testing.assert_allclose(out, np.broadcast_to(params.b_o, out.shape), rtol=0, atol=1e-12)
    if case.id.startswith("nan-in-one-query"):
        # NaN propagates to that token's output row only: no other query reads it.
        assert np.isnan(out[0, 2]).all() and np.isfinite(np.delete(out[0], 2, axis=0)).all()
    if case.id.startswith("nan-in-one-key"):
        # Every query of batch item 1 attends the NaN key, so all its outputs are NaN.
        assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()
    if case.id in ("logits-1e4-float32", "float16-scale-before-product"):
        assert np.isfinite(out).all()
    if case.id == "float16-scale-before-product":
        scores = reference_mha(case.cfg, params, case.query, return_stages=True)[1]["scores"]
        largest = np.abs(scores).max()
        assert largest / case.cfg.scale > np.finfo(np.float16).max > largest  # the case is a real trap
    if case.id == "logits-1e4-float32":
        assert np.abs(reference_mha(case.cfg, params, case.query, return_stages=True)[1]["scores"]).max() > 1e4


@pytest.mark.parametrize("backend_name", available_backends(kind="implementation"))
@pytest.mark.parametrize("case", VALUE_CASES, ids=lambda c: c.id)
def test_every_implementation_gives_the_documented_value(case, backend_name):
    backend = get_backend(backend_name)
    params = _scaled_params(case)
    if backend.unsupported_reason(case.cfg, case.dtype, "cpu", "standard"):
        pytest.skip(backend.unsupported_reason(case.cfg, case.dtype, "cpu", "standard"))
    expected = reference_mha(case.cfg, params, case.query, case.key, case.value, case.mask)
    actual = backend.run(case.cfg, params, case.query, case.key, case.value, case.mask, dtype=case.dtype)
    if case.id == "nan-in-one-query-token" and any("NaN in one query token" in d for d in backend.known_differences):
        # A declared difference (torch-best: CPU SDPA's fused kernel zeroes a NaN query's row), held to what
        # it declares: that token's output is the output bias, the others follow the spec.
        np.testing.assert_allclose(actual[0, 2], params.b_o, rtol=0, atol=1e-5)
        expected[0, 2] = actual[0, 2]
    # NaN positions must match exactly (compare treats NaN as equal only to NaN).
    level = backend_level(backend, case.dtype)  # a declared limit (MLX's float64)
    result = compare(actual, expected, level, rtol=5e-2 if case.dtype == "float16" else None)
    assert result.ok, f"{backend_name} on {case.id}: {result.summary()}"


# --- random invalid configurations raise the documented exceptions, nothing else -----------

_size = st.one_of(st.integers(-3, 40), st.none(), st.floats(-2, 40), st.sampled_from(["8", True, 2.0]))


@settings(max_examples=200, deadline=None)
@given(
    d_model=_size,
    n_heads=_size,
    d_k=_size,
    n_kv_heads=_size,
    kdim=_size,
    scale=st.one_of(st.none(), st.floats(allow_nan=True)),
)
def test_random_configs_either_validate_or_raise_documented_errors(d_model, n_heads, d_k, n_kv_heads, kdim, scale):
    try:
        cfg = MHAConfig(d_model=d_model, n_heads=n_heads, d_k=d_k, n_kv_heads=n_kv_heads, kdim=kdim, scale=scale)
    except (ValueError, TypeError) as error:
        assert "MHAConfig" in str(error)  # every message names the class and the field
        return
    # A config that validates is fully usable: sizes are positive ints and consistent.
    assert cfg.d_k > 0 and cfg.n_heads % cfg.n_kv_heads == 0 and cfg.scale > 0
    assert init_params(cfg).w_q.shape == (cfg.n_heads * cfg.d_k, cfg.d_model)


def test_registry_has_every_documented_backend():
    assert {"numpy", "torch", "jax", "einops-numpy", "torch-mha", "torch-sdpa", "jax-dpa"} <= set(REGISTRY)
