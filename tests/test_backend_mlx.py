"""MLX: the framework layer, the `mlx` adapter's conventions (mlx-lm's idiom), its backward, and the two oracles.

What every implementation must do (the spec cases, stage by stage) is `tests/test_adapters.py`;
here is what is MLX's own: the float64 traps, nn.Linear's (out, in), nn.RoPE's ``traditional`` flag,
``mask="causal"`` aligned bottom-right, the fully masked row's mean of V, GQA without tiling, ``mx.vjp``.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")
nn = pytest.importorskip("mlx.nn")

from mha_rosetta.backends import UnsupportedCase, get_backend  # noqa: E402
from mha_rosetta.backends.frameworks import (  # noqa: E402
    array_library,
    contiguity,
    get_framework,
    strides_in_elements,
    to_numpy,
)
from mha_rosetta.backends.frameworks.mlx import FLOAT64_LIMIT, TOLERANCE_LEVELS, to_mlx  # noqa: E402
from mha_rosetta.backends.mlx.layer import rotate  # noqa: E402
from mha_rosetta.backends.oracles.mlx import bottom_right_causal  # noqa: E402
from mha_rosetta.core import (  # noqa: E402
    MHAConfig,
    compare,
    grad_tolerance,
    init_params,
    prepare_inputs,
    reference_mha,
    reference_mha_vjp,
    rotary_tables,
)

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 7, 15))  # (B, N, D): distinct sizes


# -- the framework layer ------------------------------------------------------------------------
def test_the_layer_recognises_mlx_arrays_and_says_what_it_cannot_read():
    a = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    assert array_library(a) == "mlx"
    assert strides_in_elements(a) is None  # MLX exposes no strides: an answer, never a guess
    assert contiguity(a) == get_framework("mlx").layout_unknown
    np.testing.assert_array_equal(to_numpy(a), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_float64_needs_the_dtype_argument_and_to_mlx_passes_it():
    data = np.array([1 / 3], dtype=np.float64)
    assert mx.array(data).dtype == mx.float32  # the trap: a float64 NumPy array silently becomes float32
    converted = to_mlx(data, "float64")
    assert converted.dtype == mx.float64
    assert to_numpy(converted)[0] == data[0]  # exact round trip


def test_bfloat16_rounds_from_float64_once_and_comes_back_exactly():
    import ml_dtypes

    data = RNG.standard_normal(50)
    converted = to_mlx(data, "bfloat16")
    assert converted.dtype == mx.bfloat16
    back = to_numpy(converted)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, data.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_gemm_program_computes_the_product_when_synchronised():
    launch, sync, facts = get_framework("mlx").gemm_program(16, "float64", "cpu")
    launch()
    sync()
    assert facts["operand_dtype"] == "float64"
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 16))  # the same draws as the program
    module, sync_result, make = get_framework("mlx").kernel_arrays("cpu", "float32")
    assert module is mx and make(3, 4).shape == (3, 4) and make(3, 4).dtype == mx.float32
    product = mx.matmul(to_mlx(a, "float64"), to_mlx(b, "float64"))
    np.testing.assert_allclose(to_numpy(sync_result(product)), a @ b, rtol=1e-12)
    assert get_framework("mlx").peak_memory_mb() >= 0.0


# -- float64's declared precision limit -----------------------------------------------------------
def test_float64_is_about_4e8_off_and_declared_so():
    cfg = MHAConfig(d_model=15, n_heads=3, causal=True)
    params = init_params(cfg, seed=0)
    expected = reference_mha(cfg, params, X)
    prepared, _ = get_backend("mlx").prepare(cfg, params, X, dtype="float64")
    output = prepared.output()
    assert output.dtype == np.float64
    # Beyond float64's tolerance (the exp is float32-accurate), within float32's: that is the declaration.
    assert not compare(output, expected, "float64").ok
    assert compare(output, expected, "float32").ok
    assert 1e-9 < np.abs(output - expected).max() < 1e-6
    assert prepared.info["tolerance_dtype"] == TOLERANCE_LEVELS["float64"] == "float32"
    assert prepared.info["precision_limit"] == FLOAT64_LIMIT
    assert get_backend("mlx").tolerance_levels == TOLERANCE_LEVELS
    assert FLOAT64_LIMIT in get_backend("mlx").known_differences


def test_float32_is_not_declared_below_itself():
    cfg = MHAConfig(d_model=15, n_heads=3)
    prepared, _ = get_backend("mlx").prepare(cfg, init_params(cfg, seed=0), X, dtype="float32")
    assert "tolerance_dtype" not in prepared.info
    assert compare(prepared.output(), reference_mha(cfg, init_params(cfg, seed=0), X), "float32").ok


# -- mlx-lm's conventions ------------------------------------------------------------------------
def test_weights_are_out_in_as_nn_linear_holds_them():
    cfg = MHAConfig(d_model=15, n_heads=3)
    params = init_params(cfg, seed=1)
    linear = nn.Linear(15, 15)
    linear.load_weights([("weight", to_mlx(params.w_q, "float64")), ("bias", to_mlx(params.b_q, "float64"))])
    from mha_rosetta.backends.mlx.layer import MlxAttention

    layer = MlxAttention(cfg, params, "float64")
    x = to_mlx(X, "float64")
    np.testing.assert_allclose(to_numpy(linear(x)), to_numpy(layer.linear(layer.params, x, "q")), rtol=1e-12)
    np.testing.assert_allclose(to_numpy(linear(x)), X @ params.w_q.T + params.b_q, rtol=1e-12)


@pytest.mark.parametrize(("style", "traditional"), [("interleaved", True), ("half", False)])
def test_rope_style_is_nn_rope_traditional_flag(style, traditional):
    """The spec's rope="interleaved" is nn.RoPE(traditional=True); "half" is traditional=False; the other flag is wrong."""
    cfg = MHAConfig(d_model=24, n_heads=2, rope=style)  # d_k 12
    x = RNG.standard_normal((1, 2, 9, 12)).astype(np.float32)  # (B, H, N, Dk)
    inputs = prepare_inputs(cfg, np.zeros((1, 9, 24)))  # positions 0 .. 8
    tables = rotary_tables(cfg, inputs)
    cos, sin = (mx.array(t[:, None].astype(np.float32)) for t in (tables.q_cos, tables.q_sin))  # (1, 1, N, r/2)
    ours = to_numpy(rotate(mx.array(x), cos, sin, traditional))
    theirs = to_numpy(nn.RoPE(12, traditional=traditional, base=cfg.rope_base)(mx.array(x)))
    np.testing.assert_allclose(ours, theirs, atol=2e-6)
    wrong = to_numpy(nn.RoPE(12, traditional=not traditional, base=cfg.rope_base)(mx.array(x)))
    assert np.abs(ours - wrong).max() > 0.1  # the classic porting bug is visible, not a rounding


def test_sdpa_causal_string_is_bottom_right_and_torch_is_causal_top_left():
    torch = pytest.importorskip("torch")
    q = RNG.standard_normal((1, 1, 2, 4)).astype(np.float32)  # 2 queries
    k, v = (RNG.standard_normal((1, 1, 5, 4)).astype(np.float32) for _ in range(2))  # 5 keys
    mlx_out = to_numpy(
        mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.5, mask="causal")
    )
    bottom_right = np.tril(np.ones((2, 5), dtype=bool), k=3)  # query i sees keys j <= i + 3
    explicit = to_numpy(
        mx.fast.scaled_dot_product_attention(
            mx.array(q), mx.array(k), mx.array(v), scale=0.5, mask=mx.array(bottom_right)
        )
    )
    np.testing.assert_allclose(mlx_out, explicit, atol=1e-6)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    torch_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.5).numpy()
    top_left = np.tril(np.ones((2, 5), dtype=bool))  # query i sees keys j <= i
    by_hand = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(top_left), scale=0.5
    )
    np.testing.assert_allclose(torch_out, by_hand.numpy(), atol=1e-6)
    assert np.abs(mlx_out - torch_out).max() > 0.1  # the two libraries' "causal" differ when Nq != Nk


def test_the_oracle_passes_causal_only_where_it_is_the_spec_rule():
    cfg = MHAConfig(d_model=15, n_heads=3, causal=True)
    assert bottom_right_causal(cfg, prepare_inputs(cfg, X))  # Nq == Nk: both alignments agree
    cross = prepare_inputs(cfg, X, RNG.standard_normal((2, 9, 15)))  # 7 queries, 9 keys: the spec's rule is top-left
    assert not bottom_right_causal(cfg, cross)
    step = prepare_inputs(cfg, X[:, :2], X, positions=np.array([5, 6]))  # a decode step: bottom-right on positions
    assert bottom_right_causal(cfg, step)


def test_sdpa_gives_a_fully_masked_row_the_mean_of_v():
    q, k, v = (RNG.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    allowed = np.ones((4, 4), dtype=bool)
    allowed[0] = False
    out = to_numpy(
        mx.fast.scaled_dot_product_attention(
            mx.array(q), mx.array(k), mx.array(v), scale=8**-0.5, mask=mx.array(allowed)
        )
    )
    np.testing.assert_allclose(out[0, :, 0], v[0].mean(axis=1), atol=1e-5)  # (H, Dv): each head's mean of V


def test_gqa_runs_without_tiling_the_keys():
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True)
    params = init_params(cfg, seed=3)
    x = RNG.standard_normal((2, 6, 16))
    _, stages = get_backend("mlx").run(cfg, params, x, dtype="float32", return_stages=True)
    assert stages["k_rotated"].shape == (2, 2, 6, 4)  # Hkv heads, never repeated
    assert compare(stages["output"], reference_mha(cfg, params, x), "float32").ok


# -- the backward through mx.vjp ------------------------------------------------------------------
def test_vjp_matches_the_reference_with_variants():
    cfg = MHAConfig(
        d_model=18,
        n_heads=3,
        n_kv_heads=1,
        causal=True,
        rope="half",
        window=4,
        softcap=5.0,
        sinks=True,
        alibi=True,
        qk_norm="head",
    )
    params = init_params(cfg, seed=2)
    x = RNG.standard_normal((2, 7, 18))
    cotangent = RNG.standard_normal((2, 7, 18))
    grads = get_backend("mlx").run_vjp(cfg, params, x, cotangent=cotangent, dtype="float32")
    expected = reference_mha_vjp(cfg, params, x, cotangent=cotangent)
    for name, value in expected.tensors().items():
        tol = grad_tolerance("float32", value)
        assert compare(grads.tensors()[name], value, "float32", atol=tol.atol, rtol=tol.rtol).ok, name


def test_vjp_gives_each_input_slot_its_own_gradient():
    cfg = MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=13)
    params = init_params(cfg, seed=4)
    query, key, value = (
        RNG.standard_normal((2, 5, 15)),
        RNG.standard_normal((2, 6, 11)),
        RNG.standard_normal((2, 6, 13)),
    )
    cotangent = RNG.standard_normal((2, 5, 15))
    grads = get_backend("mlx").run_vjp(cfg, params, query, key, value, cotangent=cotangent, dtype="float64")
    expected = reference_mha_vjp(cfg, params, query, key, value, cotangent=cotangent)
    assert grads.d_key.shape == (2, 6, 11) and grads.d_value.shape == (2, 6, 13)
    for name, value in expected.tensors().items():
        assert compare(grads.tensors()[name], value, "float32").ok, name  # float64 at its declared level


# -- the oracles --------------------------------------------------------------------------------
def test_sdpa_oracle_refuses_softcap_with_the_reason_and_runs_sinks():
    sdpa = get_backend("mlx-sdpa")
    cfg = MHAConfig(d_model=15, n_heads=3, softcap=30.0)
    with pytest.raises(UnsupportedCase, match="no softcap"):
        sdpa.run(cfg, init_params(cfg, seed=0), X, dtype="float32")
    cfg = MHAConfig(d_model=15, n_heads=3, sinks=True, causal=True)
    params = init_params(cfg, seed=0)
    assert compare(sdpa.run(cfg, params, X, dtype="float32"), reference_mha(cfg, params, X), "float32").ok


def test_sdpa_oracle_backward_refuses_t5_bias_whose_mask_gradient_metal_refuses():
    cfg = MHAConfig(d_model=15, n_heads=3, rel_buckets=8)
    with pytest.raises(UnsupportedCase, match="refuses a gradient with respect to its additive mask"):
        get_backend("mlx-sdpa").run_vjp(cfg, init_params(cfg, seed=0), X, cotangent=X, dtype="float32")


def test_mha_oracle_agrees_and_refuses_what_the_module_cannot_express():
    mha = get_backend("mlx-mha")
    cfg = MHAConfig(d_model=15, n_heads=3, causal=True)
    params = init_params(cfg, seed=5)
    assert compare(mha.run(cfg, params, X, dtype="float32"), reference_mha(cfg, params, X), "float32").ok
    gqa = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2)
    assert "no GQA" in mha.unsupported_reason(gqa, "float32", "cpu", "standard")
    rope = MHAConfig(d_model=16, n_heads=4, rope="half")
    assert "no rotary" in mha.unsupported_reason(rope, "float32", "cpu", "standard")
    scaled = MHAConfig(d_model=15, n_heads=3, scale=0.1)
    assert "fixes the scale" in mha.unsupported_reason(scaled, "float32", "cpu", "standard")


# -- the chunked strategy ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [{"causal": True}, {"n_kv_heads": 1, "window": 3, "causal": True}, {"softcap": 5.0, "alibi": True, "sinks": True}],
    ids=lambda f: ",".join(f),
)
def test_chunked_agrees_with_the_oracle_and_skips_tiles_outside_the_window(fields):
    cfg = MHAConfig(d_model=18, n_heads=3, **fields)
    params = init_params(cfg, seed=6)
    x = RNG.standard_normal((2, 11, 18))
    mask = np.ones((2, 1, 1, 11), dtype=bool)
    mask[1, ..., :4] = False  # padding: item 1's first four keys
    prepared, _ = get_backend("mlx").prepare(
        cfg, params, x, mask=mask, dtype="float32", strategy="chunked", chunk=(3, 4)
    )
    assert compare(prepared.output(), reference_mha(cfg, params, x, mask=mask), "float32").ok
    counts = prepared.info["tiles_planned"]
    assert counts["total"] == 4 * 3  # ceil(11 / 3) query blocks x ceil(11 / 4) key blocks
    if cfg.causal:
        assert counts["above_diagonal"] > 0
    if cfg.window is not None:
        assert counts["outside_window"] > 0
    assert prepared.info["tiles_visited"] == counts["planned"] - prepared.info["tiles_skipped"]


def test_chunked_exposes_no_scores_and_says_why():
    cfg = MHAConfig(d_model=15, n_heads=3, causal=True)
    _, stages = get_backend("mlx").run(
        cfg, init_params(cfg, seed=0), X, dtype="float32", strategy="chunked", chunk=3, return_stages=True
    )
    assert "weights" not in stages and "scores" not in stages and stages["context"].shape == (2, 3, 7, 5)
    with pytest.raises(UnsupportedCase, match="does not expose attention weights"):
        get_backend("mlx").run(
            cfg, init_params(cfg, seed=0), X, dtype="float32", strategy="chunked", return_weights=True
        )


# -- explain's MLX section ---------------------------------------------------------------------
def test_explain_shows_mlx_causal_bottom_right_against_torch_top_left():
    pytest.importorskip("torch")
    from mha_rosetta.explain.differences import run_differences

    section = run_differences(keys=["mlx_conventions"])[0]
    assert section.status == "demonstrated"
    rows = dict(section.rows)
    mlx_row = next(out for run, out in rows.items() if 'mask="causal"' in run and "mx.fast" in run)
    torch_row = next(out for run, out in rows.items() if "is_causal=True" in run)
    assert mlx_row == "query 0 sees keys [0, 1, 2, 3]; query 1 sees keys [0, 1, 2, 3, 4]"  # the last query, last key
    assert torch_row == "query 0 sees keys [0]; query 1 sees keys [0, 1]"  # the first query, first key
    rope = next(out for run, out in rows.items() if "nn.RoPE" in run)
    import re

    rounding, order_one = r"max error \d\.\de-0[5-8]", r"max error \d\.\de\+00"  # float32 rounding; a wrong rotation
    assert re.search(rf"traditional=True vs spec 'interleaved': {rounding}", rope), rope
    assert re.search(rf"traditional=False vs spec 'half': {rounding}", rope), rope
    assert re.search(rf"traditional=False vs spec 'interleaved': {order_one}", rope), rope
    assert next(out for run, out in rows.items() if "no allowed key" in run).startswith("the mean of V")
    assert "mx.array(np_float64): float32" in next(out for run, out in rows.items() if "float64" in run)
