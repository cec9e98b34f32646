"""The backward pass: the float64 oracle proved by finite differences and torch.autograd, every
backend's gradients against it, the gradient check, and bad input.

Runtime (2-core machine, one BLAS thread): the oracle and numpy tests take seconds; the
per-backend tests compile once per case and dtype for the JAX-based backends, about 10 s each.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import installed_backend
from mha_rosetta.backends import KNOWN_WRONG_STRATEGIES, REGISTRY, UnsupportedCase, get_backend, missing_backends
from mha_rosetta.checks import SPEC_CASES, Status, run_check
from mha_rosetta.checks.agreement import backend_level
from mha_rosetta.checks.grad_report import grad_report_blocks
from mha_rosetta.checks.json_report import grad_to_json
from mha_rosetta.core import MHAConfig, MHAParams, compare, grad_tolerance, init_params, reference_mha, reference_stages
from mha_rosetta.core.grad import GRAD_STAGE_NAMES, default_cotangent, grad_stage_names, output_shape, reference_mha_vjp
from mha_rosetta.core.stages import BASE_STAGE_NAMES
from mha_rosetta.core.variants import VARIANT_REGISTRY

CASES = list(SPEC_CASES.values())


def _directional_fd(cfg, params, query, key, value, mask, cotangent, seed: int, eps: float = 1e-5, **where):
    """(central difference, analytic) of <cotangent, output> along one random direction in every input.

    ``where``: the rotary positions and kv_positions, if any.
    """
    rng = np.random.default_rng(seed)
    grads = reference_mha_vjp(cfg, params, query, key, value, mask, cotangent, **where)
    p_dir = {n: None if a is None else rng.standard_normal(a.shape) for n, a in params.as_dict().items()}
    for variant in cfg.variants:  # a tied parameter (k_eq_v: w_v is w_k) is one weight: one direction for both
        p_dir.update({name: p_dir[same] for name, same in VARIANT_REGISTRY[variant].tied.items()})
    inputs = {"query": query, "key": key, "value": value}
    x_dir = {n: rng.standard_normal(a.shape) for n, a in inputs.items() if a is not None}

    def loss(t: float) -> float:
        moved = MHAParams(**{n: None if a is None else a + t * p_dir[n] for n, a in params.as_dict().items()})
        xs = {n: None if a is None else a + t * x_dir[n] for n, a in inputs.items()}
        output = reference_mha(cfg, moved, xs["query"], xs["key"], xs["value"], mask, **where)
        return float(np.sum(cotangent * output))

    fd = (loss(eps) - loss(-eps)) / (2 * eps)
    analytic = sum(float(np.sum(g * p_dir[n])) for n, g in grads.d_params.as_dict().items() if g is not None)
    by_input = {"query": grads.d_query, "key": grads.d_key, "value": grads.d_value}
    analytic += sum(float(np.sum(by_input[n] * d)) for n, d in x_dir.items())
    return fd, analytic


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_oracle_matches_central_differences_on_every_spec_case(case):
    data = case.inputs()
    cot = default_cotangent(output_shape(case.cfg, data.query))
    where = {"positions": data.positions, "kv_positions": data.kv_positions}
    for seed in range(3):  # three random directions through every parameter and input at once
        args = (case.cfg, case.params(), data.query, data.key, data.value, data.mask, cot, seed)
        # eps 1e-6: the llama3 case's curvature leaves a truncation error of 4e-7 at 1e-5 (2e-2 * eps**2 * 1e10)
        fd, analytic = _directional_fd(*args, eps=1e-6, **where)
        assert abs(fd - analytic) <= 1e-7 * max(1.0, abs(analytic)), (case.name, seed, fd, analytic)


def _torch_autograd_reference(cfg, params, query, key, value, mask, cotangent):
    """An independent float64 MHA in torch, straight from the formulas (repeat_interleave for GQA)."""
    import torch

    t = {n: None if a is None else torch.tensor(a, requires_grad=True) for n, a in params.as_dict().items()}
    xq = torch.tensor(query, requires_grad=True)
    xk = xq if key is None else torch.tensor(key, requires_grad=True)
    xv = xk if value is None else torch.tensor(value, requires_grad=True)
    batched = query.ndim == 3
    q_in, k_in, v_in = (x if batched else x[None] for x in (xq, xk, xv))

    def lin(x, w, b):
        return x @ w.T + (0 if b is None else b)

    B, Nq, Nk = q_in.shape[0], q_in.shape[1], k_in.shape[1]
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    q = lin(q_in, t["w_q"], t["b_q"]).reshape(B, Nq, H, Dk).transpose(1, 2)  # (B, H, Nq, Dk)
    k = lin(k_in, t["w_k"], t["b_k"]).reshape(B, Nk, Hkv, Dk).transpose(1, 2).repeat_interleave(cfg.group_size, 1)
    v = lin(v_in, t["w_v"], t["b_v"]).reshape(B, Nk, Hkv, Dv).transpose(1, 2).repeat_interleave(cfg.group_size, 1)
    scores = cfg.scale * q @ k.transpose(-1, -2)  # (B, H, Nq, Nk)
    allowed = np.ones((1, 1, Nq, Nk), bool) if mask is None else (mask if batched else mask[None])
    allowed = np.broadcast_to(allowed.reshape((1,) * (4 - allowed.ndim) + allowed.shape), (B, H, Nq, Nk))
    if cfg.causal:
        allowed = allowed & np.tril(np.ones((Nq, Nk), bool))
    allowed_t = torch.tensor(np.ascontiguousarray(allowed))
    nonempty = allowed_t.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~allowed_t, -torch.inf).masked_fill(~nonempty, 0.0), -1) * nonempty
    merged = (weights @ v).transpose(1, 2).reshape(B, Nq, H * Dv)
    out = lin(merged, t["w_o"], t["b_o"])
    out = out if batched else out[0]
    out.backward(torch.tensor(cotangent))
    inputs = {
        "d_query": xq.grad,
        "d_key": None if key is None else xk.grad,
        "d_value": None if value is None else xv.grad,
    }
    return {**inputs, **{n: None if a is None else a.grad for n, a in t.items()}}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
# The 2017-23 cases: this torch transcription has no variants (their backward is proved by central
# differences in tests/test_variants.py and by torch's autograd in the torch implementation's tests).
@pytest.mark.parametrize("case", [c for c in CASES if c.cfg.rope is None and not c.cfg.variants], ids=lambda c: c.name)
def test_oracle_matches_torch_autograd_in_float64(case):
    """The rotary cases are proved by finite differences above and by the torch and JAX adapters' autograd."""
    data = case.inputs()
    cot = default_cotangent(output_shape(case.cfg, data.query))
    ours = reference_mha_vjp(case.cfg, case.params(), data.query, data.key, data.value, data.mask, cot).tensors()
    theirs = _torch_autograd_reference(case.cfg, case.params(), data.query, data.key, data.value, data.mask, cot)
    assert set(ours) == {n for n, g in theirs.items() if g is not None}
    for name, value in ours.items():
        assert compare(value, theirs[name].numpy(), "float64", atol=1e-12, rtol=1e-10).ok, name


def test_backward_stages_are_exposed_in_order_with_their_forward_shapes():
    case = SPEC_CASES["gqa"]
    data = case.inputs()
    grads = reference_mha_vjp(case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    forward = reference_stages(case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    assert (
        tuple(grads.stages)
        == grad_stage_names(case.cfg)
        # every backward stage of the 2017-23 pipeline (no variant's: the gate, the capped or biased scores, the
        # norms, Llama 4's steps after rotary), in GRAD_STAGE_NAMES' order
        == tuple(name for name in GRAD_STAGE_NAMES if name[2:] in BASE_STAGE_NAMES)
        == (
            *("d_output", "d_merged", "d_context", "d_weights", "d_v_heads", "d_scores", "d_q_rotated", "d_k_rotated"),
            *("d_q_heads", "d_k_heads", "d_q", "d_k", "d_v"),
        )
    )
    for name, stage in grads.stages.items():
        assert stage.shape == forward[name[2:]].shape, name


def test_gqa_kv_gradients_are_the_sum_over_their_query_group():
    """Each kv head's gradient is the sum of what its query heads send back (not one of them)."""
    cfg = MHAConfig(d_model=12, n_heads=4, n_kv_heads=2)
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 5, 12))
    grads = reference_mha_vjp(cfg, params, x)
    # The same layer with the kv heads repeated into plain MHA: its per-head gradients, summed per group.
    repeat = np.repeat(np.arange(cfg.n_kv_heads), cfg.group_size)  # kv head of every query head
    rows_k = np.concatenate([np.arange(g * cfg.d_k, (g + 1) * cfg.d_k) for g in repeat])
    mha = MHAConfig(d_model=12, n_heads=4)
    expanded = MHAParams(
        params.w_q,
        params.w_k[rows_k],
        params.w_v[rows_k],
        params.w_o,
        params.b_q,
        params.b_k[rows_k],
        params.b_v[rows_k],
        params.b_o,
    )
    plain = reference_mha_vjp(mha, expanded, x)
    summed = np.zeros_like(params.w_k)
    np.add.at(summed, rows_k, plain.d_params.w_k)
    assert compare(grads.d_params.w_k, summed, "float64").ok
    # Dropping the sum (taking one query head's gradient per kv head) is a backward-only bug the tolerance sees.
    first_only = plain.d_params.w_k.reshape(cfg.n_heads, cfg.d_k, 12)[:: cfg.group_size].reshape(-1, 12)
    assert not compare(first_only, grads.d_params.w_k, "float32", **vars(grad_tolerance("float32", summed))).ok


def test_blocked_positions_and_fully_masked_rows_get_zero_gradient():
    case = SPEC_CASES["fully_masked_row"]
    cfg, params = case.cfg, case.params()
    data = case.inputs()
    key = np.random.default_rng(5).standard_normal(data.query.shape)  # a separate key: d_query is the query's own
    grads = reference_mha_vjp(cfg, params, data.query, key, None, data.mask)
    allowed = np.broadcast_to(data.mask, grads.stages["d_scores"].shape)
    assert np.all(grads.stages["d_scores"][~allowed] == 0)
    for b, row in case.blocked_rows:
        assert np.all(grads.d_query[b, row] == 0)
        assert np.all(grads.stages["d_weights"][b, :, row] != 0)  # the row had an upstream gradient, but no softmax


def test_defaulted_inputs_fold_into_the_input_they_stood_for():
    case = SPEC_CASES["self_attention"]
    data = case.inputs()
    x, p = data.query, case.params()
    defaulted = reference_mha_vjp(case.cfg, p, x)
    explicit = reference_mha_vjp(case.cfg, p, x, x.copy(), x.copy())
    assert defaulted.d_key is None and defaulted.d_value is None
    total = explicit.d_query + explicit.d_key + explicit.d_value
    assert compare(defaulted.d_query, total, "float64").ok
    value_only = reference_mha_vjp(case.cfg, p, x, x.copy())
    assert value_only.d_value is None and compare(value_only.d_key, explicit.d_key + explicit.d_value, "float64").ok


def test_default_cotangent_is_fixed_and_not_all_ones():
    a, b = default_cotangent((2, 3, 4)), default_cotangent((2, 3, 4))
    assert np.array_equal(a, b)
    assert len(np.unique(a)) == a.size


@pytest.mark.parametrize("backend_name", ["numpy", "torch"])
def test_bad_cotangent_gets_a_clear_error(backend_name, cfg, params):
    backend = installed_backend(backend_name)
    x = np.random.default_rng(0).standard_normal((2, 7, cfg.d_model))
    with pytest.raises(
        ValueError, match=r"cotangent must have the output's shape \(2, 7, 15\).*got shape \(2, 15, 7\)"
    ):
        backend.run_vjp(cfg, params, x, cotangent=np.ones((2, 15, 7)))
    with pytest.raises(TypeError, match="cotangent must hold floating-point numbers, got dtype int64"):
        backend.run_vjp(cfg, params, x, cotangent=np.ones((2, 7, 15), dtype=np.int64))
    with pytest.raises(TypeError, match="cotangent must be real, got complex"):
        reference_mha_vjp(cfg, params, x, cotangent=np.ones((2, 7, 15), dtype=complex))


def test_errors_come_in_a_fixed_order_chunk_then_inputs_then_cotangent(cfg, params):
    """`prepare` names a bad ``chunk`` before bad inputs; `prepare_vjp` names bad inputs before a bad cotangent
    (whose expected shape comes from the query). Each call below has two faults; only the first is reported."""
    backend = get_backend("numpy")
    bad_query = np.ones((2, 7, cfg.d_model - 1))
    bad_inputs = r"query must have shape \(batch, tokens, d_model=15\), got last axis 14"
    with pytest.raises(TypeError, match=r"chunk must be \(q_block, k_block\) or one int for both, got \(1, 2, 3\)"):
        backend.prepare(cfg, params, bad_query, strategy="chunked", chunk=(1, 2, 3))
    with pytest.raises(ValueError, match=bad_inputs):
        backend.prepare_vjp(cfg, params, bad_query, cotangent=np.ones((3, 3)))
    with pytest.raises(ValueError, match=bad_inputs):
        backend.run_vjp(cfg, params, bad_query, cotangent=np.ones((2, 7, 15), dtype=np.int64))
    good_query = np.ones((2, 7, cfg.d_model))
    with pytest.raises(ValueError, match=r"cotangent must have the output's shape \(2, 7, 15\).*got shape \(3, 3\)"):
        backend.prepare_vjp(cfg, params, good_query, cotangent=np.ones((3, 3)))


@pytest.mark.parametrize("backend_name", ["oracle", "numpy", "torch", "jax"])
def test_nan_in_the_cotangent_propagates_to_exactly_what_reads_it(backend_name, cfg, params):
    """Documented: no error; NaN reaches b_o's entry of that feature and that batch item's input gradients."""
    x = np.random.default_rng(0).standard_normal((2, 7, cfg.d_model))
    cot = default_cotangent(x.shape)
    cot[1, 3, 4] = np.nan
    run = reference_mha_vjp if backend_name == "oracle" else installed_backend(backend_name).run_vjp
    grads = run(cfg, params, x, cotangent=cot)
    assert np.isnan(grads.d_params.b_o[4]) and np.isfinite(np.delete(grads.d_params.b_o, 4)).all()
    assert np.isnan(grads.d_params.w_o[4]).all() and np.isfinite(np.delete(grads.d_params.w_o, 4, axis=0)).all()
    assert np.isfinite(grads.d_query[0]).all()  # the other batch item never read it
    assert np.isnan(grads.d_query[1]).any()


# -- every backend against the oracle, every spec case ------------------------------------------
def _vjp_strategies():
    for name in REGISTRY:
        backend_strategies = (
            ("standard", "per_head", "slicing", "direct_reshape") if name in ("numpy", "torch") else ("standard",)
        )
        for strategy in backend_strategies:
            yield pytest.param(name, strategy, id=f"{name}:{strategy}")


@pytest.mark.parametrize(("backend_name", "strategy"), list(_vjp_strategies()))
def test_every_backend_gradients_match_the_oracle_on_every_spec_case(backend_name, strategy):
    backend = installed_backend(backend_name)
    ran = 0
    for case in CASES:
        data = case.inputs()
        args = (case.cfg, case.params(), data.query, data.key, data.value, data.mask)
        where = {"positions": data.positions, "kv_positions": data.kv_positions}
        expected = reference_mha_vjp(*args, **where).tensors()
        # float64 where the backend has it (jax-dpa's softmax is float32 at best: float32 there).
        dtype = "float32" if backend.unsupported_reason(case.cfg, "float64", "cpu", strategy) else "float64"
        try:
            grads = backend.run_vjp(*args, dtype=dtype, strategy=strategy, **where)
        except UnsupportedCase as error:
            assert str(error)  # a reason, e.g. "einops-numpy has no backward: ..." or "no grouped kv heads"
            continue
        ran += 1
        actual = grads.tensors()
        assert set(actual) == set(expected), case.name
        level = backend_level(backend, dtype)  # a declared limit (MLX's float64)
        ok = {n: compare(actual[n], e, level, **vars(grad_tolerance(level, e))).ok for n, e in expected.items()}
        if strategy in KNOWN_WRONG_STRATEGIES:
            # One kv head: the wrong split is undone the same way and cancels (the check finds it at a stage).
            assert case.cfg.n_kv_heads == 1 or not all(ok.values()), case.name
        else:
            assert all(ok.values()), (case.name, [n for n, good in ok.items() if not good])
    # Oracles refuse what their library cannot express (GQA, a custom scale, d_v != d_k), never everything.
    # The sharded backends (jax-sharded, torch-tp) are forward only: every case is refused with that reason.
    # FlexAttention has no backward on the CPU (torch 2.13): torch-flex refuses every case there, with that reason.
    # hf-attention is a decode oracle (Hugging Face's layers through their caches): no backward pass.
    # ONNX's backends run inference sessions and graphs: no backward (each says so).
    forward_only = backend_name in (
        "einops-numpy",
        "torch-flex",
        "hf-attention",
        "onnx",
        "onnx-reference",
        "torch-onnx",
    ) or getattr(backend, "splits_heads", False)
    assert ran >= (0 if forward_only else 6), ran


def test_half_precision_gradients_meet_the_half_rule():
    """numpy float16 and bfloat16 against 2x the rounded spec path + 1 ulp, per tensor."""
    case = SPEC_CASES["causal_padding"]
    data = case.inputs()
    args = (case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    exact = reference_mha_vjp(*args).tensors()
    for dtype in ("float16", "bfloat16"):
        rounded = reference_mha_vjp(*args, rounding=dtype).tensors()
        grads = get_backend("numpy").run_vjp(*args, dtype=dtype).tensors()
        for name, e in exact.items():
            baseline = float(np.max(np.abs(rounded[name] - e)))
            assert 0 < baseline  # the rounded path really is rounded
            assert compare(grads[name], e, dtype, **vars(grad_tolerance(dtype, e, baseline))).ok, (dtype, name)


# -- Hypothesis: random configurations ------------------------------------------------------------
@st.composite
def configs(draw):
    n_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    rope = draw(st.sampled_from([None, "half", "interleaved"]))
    d_k = 2 * draw(st.integers(1, 3)) if rope else draw(st.integers(1, 5))  # rotary turns pairs
    cfg = MHAConfig(
        rope=rope,
        d_model=draw(st.integers(2, 14)),
        n_heads=n_kv * group,
        n_kv_heads=n_kv,
        d_k=d_k,
        d_v=draw(st.integers(1, 5)),
        kdim=draw(st.integers(2, 9)),
        vdim=draw(st.integers(2, 9)),
        bias=draw(st.booleans()),
        causal=draw(st.booleans()),
    )
    batch, nq, nk = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, cfg.n_heads, nq, nk)) < 0.7 if draw(st.booleans()) else None
    x = rng.standard_normal((batch, nq, cfg.d_model))
    k = rng.standard_normal((batch, nk, cfg.kdim))
    v = rng.standard_normal((batch, nk, cfg.vdim))
    return cfg, init_params(cfg, seed), x, k, v, mask, seed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_property_numpy_backward_matches_the_oracle_and_finite_differences(drawn):
    cfg, params, x, k, v, mask, seed = drawn
    cot = default_cotangent(output_shape(cfg, x))
    expected = reference_mha_vjp(cfg, params, x, k, v, mask, cot).tensors()
    for strategy in ("standard", "per_head", "slicing"):
        actual = get_backend("numpy").run_vjp(cfg, params, x, k, v, mask, cot, strategy=strategy).tensors()
        for name, e in expected.items():
            assert compare(actual[name], e, "float64", **vars(grad_tolerance("float64", e))).ok, (strategy, name)
    fd, analytic = _directional_fd(cfg, params, x, k, v, mask, cot, seed)
    assert abs(fd - analytic) <= 1e-7 * max(1.0, abs(analytic))


# -- the gradient check ---------------------------------------------------------------------------
def test_grad_check_passes_and_catches_the_direct_reshape_mistake():
    # torch (autograd) exposes no backward stages: its mistake on MQA is traced through the forward stages.
    backends = "numpy" if "torch" in missing_backends() else "numpy,torch"
    result = run_check(
        backends=backends, cases="self_attention,gqa,mqa", dtypes="float64,float16,bfloat16", kind="grad"
    )
    assert result.exit_status == 0, result.verdict()
    mistakes = [r for r in result.runs if r.impl.strategy == "direct_reshape"]
    assert mistakes and all(r.status is Status.CAUGHT for r in mistakes)
    on_mqa = {r.impl.backend: r.reason for r in mistakes if r.case == "mqa"}  # right gradients, a wrong stage
    assert "backward stage d_context" in on_mqa["numpy"]
    assert backends == "numpy" or "forward stage q_heads" in on_mqa["torch"]
    section = grad_to_json(result)
    assert section["exit_status"] == 0 and section["runs"] and section["pairs"]
    assert grad_report_blocks(result)
    assert grad_report_blocks(result, quiet=True) == []  # --quiet: nothing but problems, and there are none


def test_grad_check_names_a_transposed_weight_gradient():
    """A backend that hands back dW_B = X.T @ dY without transposing it to (out, in) disagrees, named."""
    from mha_rosetta.backends.numpy.adapter import NumpyBackend

    class TransposedGrad(NumpyBackend):
        def _prepare_vjp(self, *args):
            prepared = super()._prepare_vjp(*args)
            to_grads = prepared.to_grads

            def transposed(native):
                grads = to_grads(native)
                grads["w_q"] = grads["w_q"].T.copy()  # square (15, 15) in this case: only the numbers are wrong
                return grads

            prepared.to_grads = transposed
            return prepared

    bad = TransposedGrad("numpy-transposed-dw")
    result = run_check(
        backends=[bad, get_backend("numpy")],
        strategies="standard",
        cases="self_attention",
        dtypes="float64",
        kind="grad",
    )
    assert result.exit_status == 1
    run = next(r for r in result.runs if r.label == "numpy-transposed-dw")
    assert run.status is Status.DISAGREE and "w_q" in run.reason
    (quiet,) = grad_report_blocks(result, quiet=True)  # --quiet keeps the problem, and only it
    assert quiet.title == "Problems: gradients"
    assert [row[:4] for row in quiet.rows] == [["DISAGREE", "numpy-transposed-dw", "self_attention", "float64"]]


def test_cli_check_grad_writes_a_grad_section(tmp_path):
    import json

    from mha_rosetta.cli.main import main

    path = tmp_path / "check.json"
    status = main(["check", "--grad", "--plain", "--backends", "numpy", "--cases", "causal", "--json", str(path)])
    assert status == 0
    data = json.loads(path.read_text())
    assert data["grad"]["exit_status"] == 0
    assert {r["implementation"] for r in data["grad"]["runs"]} >= {"numpy", "numpy:per_head", "numpy:direct_reshape"}


def test_explainer_shows_both_conventions_and_catches_the_gqa_backward_bug():
    from mha_rosetta.explain.backward import gqa_demonstration, weight_gradient_rows

    rows = weight_gradient_rows(MHAConfig(d_model=12, n_heads=3, d_k=5), batch=2, tokens=6, seed=0)
    w_q = next(row for row in rows if row[0] == "w_q")
    assert "(15, 12)" in w_q[1] and "(12, 15)" in w_q[2]  # dW_A (out, in), dW_B (in, out)
    assert all(float(row[3]) == 0.0 and float(row[4]) < 1e-12 for row in rows)
    demo = gqa_demonstration()
    assert demo["caught"] and demo["forward_status"] == "agree" and demo["grad_status"] == "DISAGREE"
    assert "w_v" in demo["grad_reason"] and demo["divergent_stage"] == "d_v_heads"


def test_bench_cell_times_forward_plus_backward_with_three_times_the_flops():
    from mha_rosetta.benchmarks.cell import CellSpec, cell_key, measure

    sizes = dict(
        batch=2,
        tokens=16,
        d_model=24,
        heads=3,
        policy={"min_repeats": 3, "max_repeats": 3, "min_time": 0.0, "warmup": 1},
    )
    forward = measure(CellSpec("numpy:slicing", **sizes))
    training = measure(CellSpec("numpy:slicing", mode="fwdbwd", **sizes))
    assert forward["status"] == training["status"] == "ok"
    assert training["flops"] == 3 * forward["flops"]
    assert training["output_finite"] and training["backend_info"]["backward"].startswith("hand-written")
    assert CellSpec("numpy", **sizes).key() == cell_key({**CellSpec("numpy", **sizes).identity()})  # old keys kept
    assert CellSpec("numpy", mode="fwdbwd", **sizes).key() != CellSpec("numpy", **sizes).key()
    with pytest.raises(ValueError, match="mode must be one of fwd, fwdbwd; got 'backward'"):
        CellSpec("numpy", mode="backward")


def test_bench_mode_both_times_every_cell_forward_and_forward_plus_backward():
    from mha_rosetta.benchmarks.report import cell_label
    from mha_rosetta.benchmarks.sweep import expand_cells, preset_settings

    both = expand_cells(preset_settings("quick", modes=["fwd", "fwdbwd"]), ["numpy", "torch:slicing"])
    forward = expand_cells(preset_settings("quick"), ["numpy", "torch:slicing"])
    assert len(both) == 2 * len(forward) and {c.mode for c in both} == {"fwd", "fwdbwd"}
    assert {c.mode for c in forward} == {"fwd"}
    labels = {cell_label({**c.identity(), "mode": c.mode}) for c in both}
    assert {"numpy", "numpy fwd+bwd", "torch:slicing", "torch:slicing fwd+bwd"} <= labels
    with pytest.raises(ValueError, match="mode must be one of fwd, fwdbwd"):
        preset_settings("quick", modes=["train"])


def test_an_interrupted_gradient_check_exits_130_through_its_result(monkeypatch, capsys):
    """Ctrl-C during the gradient check: its result says interrupted, and the command exits with that result's
    `exit_code` (130) although the forward check before it passed."""
    from mha_rosetta.checks import grad as grad_module
    from mha_rosetta.cli.main import main

    argv = ["check", "--backends", "numpy", "--cases", "self_attention", "--dtypes", "float64", "--plain"]
    assert main(argv) == 0

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(grad_module, "_run_one", ctrl_c)
    result = run_check(backends=["numpy"], cases=["self_attention"], dtypes=["float64"], kind="grad")
    assert result.interrupted and result.exit_status == 2 and result.exit_code == 130  # nothing compared, yet 130
    assert main([*argv, "--grad", "--jobs", "0"]) == 130  # in this process, where the patch is
