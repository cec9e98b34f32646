"""torch.nn.MultiheadAttention and F.scaled_dot_product_attention as oracles of the spec.

Besides agreement where torch can express the configuration, these tests pin down what
torch 2.13 actually returns where its convention differs from the spec (a query that
may attend to no key), so a change in torch shows up here rather than as a mystery in
the agreement matrix.
"""

from __future__ import annotations

import numpy as np
import pytest

# The case table below asks the oracles what they support at import time.
pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")

from adapter_cases import CASE_BY_NAME, CASES, DTYPES, assert_stages_close, empty_rows_case

from mha_rosetta.backends import UnsupportedCase, get_backend
from mha_rosetta.checks.cases import SpecCase
from mha_rosetta.core import (
    MHAConfig,
    assert_close,
    init_params,
    reference_mha,
    reference_mha_vjp,
    reference_stages,
    stage_names,
)
from mha_rosetta.core.variants import adapted_variants

MHA_ORACLES = ("torch-mha", "torch-mha-seqfirst")


def _supported(name: str, case: SpecCase) -> bool:
    return get_backend(name).unsupported_reason(case.cfg, "float32", "cpu", "standard") is None


# Cases the fused oracles can hold (the module: no GQA, d_v = d_k = d_model / h, default scale).
# Rows with no allowed key are left out: the module's NaN there is a known difference (test_known_differences).
EVEN_HEADS = SpecCase("self-4-heads", "4 heads of 4", MHAConfig(d_model=16, n_heads=4))
MHA_CASES = [case for case in CASES if _supported("torch-mha", case) and not case.empty_rows().any()] + [EVEN_HEADS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MHA_CASES, ids=str)
@pytest.mark.parametrize("name", MHA_ORACLES)
def test_multihead_attention_matches_reference(name, case, dtype):
    assert_close(case.run(get_backend(name), dtype), case.reference(), dtype, what=f"{name}/{dtype} on {case}")


@pytest.mark.parametrize("case", MHA_CASES, ids=str)
@pytest.mark.parametrize("name", MHA_ORACLES)
def test_multihead_attention_exposes_output_and_per_head_weights(name, case):
    _, stages = case.run(get_backend(name), return_stages=True)
    assert_stages_close(stages, case.reference_stages(), "float64", ("weights", "output"))


def test_multihead_attention_covers_the_spec_cases_it_can():
    names = {case.name for case in MHA_CASES}
    assert {"self_attention", "causal", "padding", "causal_padding", "unbatched", "self-4-heads"} <= names
    assert not names & {"gqa", "mqa", "dv_ne_dk", "rope_half", "fully_masked_row"}


def test_cross_attention_with_kdim_vdim_uses_separate_projections():
    cfg = MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=9)
    case = SpecCase("cross-kdim-vdim", "cross-attention with padding", cfg, kv_tokens=5, key_lengths=(5, 3))
    for name in MHA_ORACLES:
        assert_close(case.run(get_backend(name), "float32"), case.reference(), "float32")


@pytest.mark.parametrize(
    "cfg, words",
    [
        (MHAConfig(d_model=18, n_heads=6, n_kv_heads=2), "grouped kv heads"),
        (MHAConfig(d_model=15, n_heads=3, d_v=4), "d_k = d_v"),
        (MHAConfig(d_model=15, n_heads=3, d_k=4), "d_k = d_v"),
        (MHAConfig(d_model=15, n_heads=3, scale=0.3), "1/sqrt(d_k)"),
    ],
    ids=["gqa", "d_v", "d_k", "scale"],
)
@pytest.mark.parametrize("name", MHA_ORACLES)
def test_multihead_attention_refuses_what_it_cannot_hold(name, cfg, words):
    backend = get_backend(name)
    reason = backend.unsupported_reason(cfg, "float32", "cpu", "standard")
    assert reason and words in reason
    x = np.zeros((1, 2, cfg.d_model))
    with pytest.raises(UnsupportedCase, match=r"nn\.MultiheadAttention"):
        backend.prepare(cfg, init_params(cfg), x)


def test_sequence_first_layout_is_real():
    case = CASE_BY_NAME["causal"]
    seqfirst = get_backend("torch-mha-seqfirst")
    prepared, _ = seqfirst.prepare(case.cfg, case.params(), *case.inputs().arrays)
    assert prepared.info["batch_first"] is False
    result = prepared.forward()
    assert tuple(result.shape) == (7, 2, 15)  # (Nq, B, D): what the module returns
    stage = prepared.native_stages()["output"]
    assert stage.axes == ("Nq", "B", "D")
    np.testing.assert_allclose(prepared.to_numpy(result), case.reference(), atol=1e-12)
    assert get_backend("torch-mha").prepare(case.cfg, case.params(), *case.inputs().arrays)[0].forward().shape == (
        2,
        7,
        15,
    )


def test_mask_polarity_is_inverted_for_the_module():
    """attn_mask True = blocked; giving the module the spec's mask unchanged is wrong."""
    import torch

    from mha_rosetta.backends.oracles.torch import torch_blocked_mask

    allowed = np.array([[[[True, False, True], [False, False, True]]]])  # (1, 1, Nq=2, Nk=3)
    np.testing.assert_array_equal(torch_blocked_mask(allowed, 2, 4, 2, 3, "cpu").numpy(), ~allowed[0, 0])
    per_item = np.zeros((2, 1, 2, 3), dtype=bool)
    per_item[1, 0, :, 2] = True  # batch item 1 sees key 2 only
    per_item[0] = True
    blocked = torch_blocked_mask(per_item, 2, 4, 2, 3, "cpu").numpy()  # (B*H, Nq, Nk), index b*H + h
    assert blocked.shape == (8, 2, 3)
    assert not blocked[:4].any() and blocked[4:, :, :2].all() and not blocked[4:, :, 2].any()
    padding = np.ones((2, 1, 1, 3), dtype=bool)
    padding[1, ..., 0] = False  # a key-padding mask broadcast over queries
    blocked = torch_blocked_mask(padding, 2, 4, 2, 3, "cpu").numpy()
    assert blocked.shape == (8, 2, 3) and blocked[4:, :, 0].all() and blocked.sum() == 8

    cfg = MHAConfig(d_model=16, n_heads=4, bias=False)
    params = init_params(cfg, seed=2)
    x = np.random.default_rng(4).standard_normal((1, 3, 16))
    mask = np.tril(np.ones((3, 3), dtype=bool))
    expected = reference_mha(cfg, params, x, mask=mask)
    assert_close(get_backend("torch-mha").run(cfg, params, x, mask=mask), expected, "float64")
    module = torch.nn.MultiheadAttention(16, 4, bias=False, batch_first=True, dtype=torch.float64).eval()
    from mha_rosetta.core import to_torch_mha_state_dict

    module.load_state_dict({k: torch.from_numpy(v) for k, v in to_torch_mha_state_dict(cfg, params).items()})
    xt = torch.from_numpy(x)
    with torch.no_grad():
        same_polarity, _ = module(xt, xt, xt, attn_mask=torch.from_numpy(mask), need_weights=False)
        inverted, _ = module(xt, xt, xt, attn_mask=torch.from_numpy(~mask), need_weights=False)
    np.testing.assert_allclose(inverted.numpy(), expected, atol=1e-12)
    assert np.nanmax(np.abs(same_polarity.numpy() - expected)) > 0.1  # the spec's mask, unmapped, is wrong


# -- what torch returns for a query that may attend to nothing --------------------------------


def _empty_row_case(n_heads: int, cross: bool) -> SpecCase:
    return empty_rows_case(MHAConfig(d_model=4 * n_heads, n_heads=n_heads), cross=cross)


def test_module_fast_path_returns_nan_for_an_empty_row():
    """Eval, batch_first=True, self-attention, bias, even heads: torch's fused fast path."""
    case = _empty_row_case(4, cross=False)
    prepared, _ = get_backend("torch-mha").prepare(case.cfg, case.params(), *case.inputs().arrays)
    assert prepared.info["fast_path_expected"] == "yes"
    output = prepared.to_numpy(prepared.forward())
    expected = case.reference()
    assert np.isnan(output[1, 5]).all()  # every head of query 5 in item 1 is empty: NaN, not b_o
    assert np.isnan(output[0, 3]).all()  # one empty head (of four) is enough to poison the row
    finite = np.ones(output.shape[:2], dtype=bool)
    finite[1, 5] = finite[0, 3] = False
    assert np.isfinite(output[finite]).all()
    assert_close(output[finite], expected[finite], "float64")


def test_module_python_path_returns_b_o_for_an_empty_row():
    """Sequence-first (no fast path) goes through SDPA, which gives zero context: the spec's b_o."""
    case = _empty_row_case(4, cross=False)
    prepared, _ = get_backend("torch-mha-seqfirst").prepare(case.cfg, case.params(), *case.inputs().arrays)
    assert prepared.info["fast_path_expected"].startswith("no")
    output = prepared.to_numpy(prepared.forward())
    assert np.isfinite(output).all()
    assert_close(output, case.reference(), "float64")
    np.testing.assert_allclose(output[1, 5], case.params().b_o, atol=1e-12)


@pytest.mark.parametrize("name", MHA_ORACLES)
def test_module_weights_are_nan_for_an_empty_row(name):
    """need_weights=True computes the softmax in Python: 0/0 = NaN for the empty row."""
    case = _empty_row_case(4, cross=True)
    prepared, _ = get_backend(name).prepare(case.cfg, case.params(), *case.inputs().arrays)
    weights = get_backend(name).canonical_stages(prepared)["weights"]
    assert np.isnan(weights[0, 1, 3]).all() and np.isnan(weights[1, :, 5]).all()
    reference = reference_stages(case.cfg, case.params(), *case.inputs().arrays)["weights"]
    usable = ~np.isnan(weights)
    assert usable.sum() == weights.size - 5 * 5  # exactly the empty rows (5 keys each) are NaN
    assert_close(weights[usable], reference[usable], "float64")


def test_sdpa_returns_b_o_for_an_empty_row():
    case = _empty_row_case(3, cross=True)
    output = get_backend("torch-sdpa").run(case.cfg, case.params(), *case.inputs().arrays, dtype="float32")
    assert np.isfinite(output).all()
    np.testing.assert_allclose(output[1, 5], case.params().b_o, atol=1e-6)
    assert_close(output, case.reference(), "float32")


# -- scaled_dot_product_attention ---------------------------------------------------------------


def _sdpa_for(case: SpecCase):
    """torch-sdpa for ``case``; a softcap, sinks or output-gate case skips with the library's reason (and only those
    do), and a form the registry limits to some libraries (core.variants.adapted_variants) with its name."""
    backend = get_backend("torch-sdpa")
    reason = backend.unsupported_reason(case.cfg, "float64", "cpu", "standard")
    unadapted = set(case.cfg.variants) - adapted_variants()
    if reason and unadapted:
        missing = reason.split("does not implement ", 1)[1].split(" (it implements")[0]  # "a, b, c"
        assert unadapted <= set(missing.split(", ")), reason  # each limited form named, in the registry's order
        pytest.skip(reason)
    if reason:
        assert case.cfg.softcap is not None or case.cfg.sinks or case.cfg.attn_output_gate, reason
        assert "scaled_dot_product_attention has no" in reason  # the library's reason, not the generic one
        pytest.skip(reason)
    return backend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_sdpa_matches_reference_on_every_case(case, dtype):
    backend = _sdpa_for(case)
    assert_close(case.run(backend, dtype), case.reference(), dtype, what=f"torch-sdpa/{dtype} on {case}")


# Inside the kernel: the scores and everything made from them before the weighted sum.
SDPA_KERNEL_STAGES = ("scores", "capped_scores", "biased_scores", "masked_scores", "weights")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sdpa_stages_outside_the_kernel_match_reference(case):
    _, stages = case.run(_sdpa_for(case), return_stages=True)
    reference = case.reference_stages()
    assert not set(stages) & set(SDPA_KERNEL_STAGES)  # inside the fused kernel
    outside = [name for name in stage_names(case.cfg) if name not in SDPA_KERNEL_STAGES]  # q_normed with QK-norm
    assert_stages_close(stages, reference, "float64", outside)


def test_sdpa_runs_a_value_head_that_differs_from_the_key_head():
    """scaled_dot_product_attention takes v of its own last size: d_k 4, d_v 6 gives a context (B, H, Nq, 6)."""
    cfg = MHAConfig(d_model=12, n_heads=3, d_k=4, d_v=6, causal=True)
    params = init_params(cfg, seed=2)
    x = np.random.default_rng(5).standard_normal((2, 7, 12))
    backend = get_backend("torch-sdpa")
    assert backend.unsupported_reason(cfg, "float64", "cpu", "standard") is None
    output, stages = backend.run(cfg, params, x, return_stages=True, dtype="float64")
    assert stages["context"].shape == (2, 3, 7, 6) and stages["k_heads"].shape == (2, 3, 7, 4)
    assert_close(output, reference_mha(cfg, params, x), "float64")
    assert_close(stages["context"], reference_stages(cfg, params, x)["context"], "float64")


def test_sdpa_uses_is_causal_without_a_user_mask_and_a_bool_mask_with_one():
    cfg = MHAConfig(d_model=18, n_heads=6, n_kv_heads=3, d_k=4, kdim=11, vdim=9, causal=True, scale=0.37)
    causal_cross = SpecCase("gqa-causal-cross", "Nq=7 > Nk=5: top-left alignment matters", cfg, kv_tokens=5)
    data = causal_cross.inputs()
    prepared, _ = get_backend("torch-sdpa").prepare(cfg, causal_cross.params(), *data.arrays)
    assert prepared.info["mask"] == "is_causal=True (top-left)"
    assert prepared.info["enable_gqa"] is True
    assert_close(prepared.output(), causal_cross.reference(), "float64")
    combined = CASE_BY_NAME["causal_padding"]
    prepared, _ = get_backend("torch-sdpa").prepare(combined.cfg, combined.params(), *combined.inputs().arrays)
    assert "True = may attend" in prepared.info["mask"]


def test_oracles_say_what_they_are():
    for name in ("torch-mha", "torch-mha-seqfirst", "torch-sdpa"):
        backend = get_backend(name)
        assert backend.kind == "oracle"
        assert backend.known_differences and all(isinstance(line, str) and line for line in backend.known_differences)
        assert backend.strategies == ("standard",)
    assert "True = blocked" in get_backend("torch-mha").known_differences[0]
    assert "(N, B, E)" in get_backend("torch-mha-seqfirst").convention
    assert "NaN" in " ".join(get_backend("torch-mha").known_differences)


# -- the variants (issue 24): what each torch oracle can express, and why not the rest ------------------------


@pytest.mark.parametrize("name", MHA_ORACLES)
def test_multihead_attention_adds_t5_bias_and_window_through_a_float_mask_with_the_tables_gradient(name):
    """nn.MultiheadAttention takes T5's bias (and ALiBi) as a float attn_mask (B*H, Nq, Nk), the window as -inf in it;
    the table's gradient flows back through the mask."""
    cfg = MHAConfig(d_model=16, n_heads=4, causal=True, window=3, rel_buckets=6, rel_max_distance=7)
    case = SpecCase("t5-window-default-scale", "T5 bias, window 3, default scale", cfg, q_tokens=7, seed=5)
    backend = get_backend(name)
    assert backend.unsupported_reason(cfg, "float64", "cpu", "standard") is None
    assert_close(case.run(backend, "float64"), case.reference(), "float64")
    _, stages = case.run(backend, return_stages=True)
    assert_stages_close(stages, case.reference_stages(), "float64", ("weights", "output"))
    prepared, _ = backend.prepare(cfg, case.params(), case.inputs().query)
    B = case.inputs().query.shape[0]
    assert prepared.info["attn_mask"].startswith(f"float64 ({B * 4}, 7, 7)")  # (B*H, Nq, Nk): a float mask per head
    data = case.inputs()
    args = (cfg, case.params(), data.query, data.key, data.value, data.mask)
    expected = reference_mha_vjp(*args).tensors()
    actual = backend.run_vjp(*args).tensors()
    assert set(actual) == set(expected)
    for tensor in expected:
        assert_close(actual[tensor], expected[tensor], "float64", what=f"d {tensor}")
    assert np.abs(actual["rel_bias"]).max() > 0.01  # the table's gradient is real, not the zeros of an unused leaf


@pytest.mark.parametrize(
    ("name", "field", "why"),
    [
        ("torch-mha", {"softcap": 2.0}, "nn.MultiheadAttention has no softcap: the scores are never exposed"),
        ("torch-mha", {"sinks": True}, "nn.MultiheadAttention has no sinks"),
        ("torch-mha", {"qk_norm": "head"}, "nn.MultiheadAttention has no QK-norm"),
        ("torch-mha", {"bias": "qkv"}, "one bias switch covers in_proj and out_proj together"),
        ("torch-sdpa", {"softcap": 2.0}, "scaled_dot_product_attention has no softcap"),
        ("torch-sdpa", {"sinks": True}, "scaled_dot_product_attention has no sinks"),
    ],
)
def test_an_oracle_refuses_a_variant_its_library_cannot_express_with_the_librarys_reason(name, field, why):
    cfg = MHAConfig(d_model=16, n_heads=4, **field)
    backend = get_backend(name)
    reason = backend.unsupported_reason(cfg, "float64", "cpu", "standard")
    assert reason is not None and why in reason, reason
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    with pytest.raises(UnsupportedCase, match=why.split(":")[0]):  # prepare says the same, never runs without it
        backend.prepare(cfg, init_params(cfg), x)


def test_sdpa_runs_qk_norm_and_the_qkv_bias_in_its_own_code_before_the_kernel():
    for cfg in (
        MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, qk_norm="projection", bias="qkv"),
        MHAConfig(d_model=24, n_heads=4, qk_norm="head", alibi=True, causal=True),
    ):
        case = SpecCase("sdpa-variants", "QK-norm, qkv bias / ALiBi", cfg, q_tokens=6, seed=3)
        _, stages = case.run(get_backend("torch-sdpa"), return_stages=True)
        assert_stages_close(stages, case.reference_stages(), "float64", ("q_normed", "k_normed", "output"))
