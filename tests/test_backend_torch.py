"""The PyTorch row-sample adapter against the float64 oracle, stage by stage."""

from __future__ import annotations

import numpy as np
import pytest
from adapter_cases import CASE_BY_NAME, CASES, DTYPES, empty_rows_case

from conftest import gpu_skipif, requires
from mha_rosetta.backends import DIRECT_RESHAPE, PER_HEAD, SLICING, STANDARD, UnsupportedCase, get_backend
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha

pytestmark = requires("torch")
CORRECT_STRATEGIES = (STANDARD, PER_HEAD, SLICING)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_gpu = gpu_skipif(not _cuda_available(), "no CUDA device visible to torch")


@pytest.fixture(scope="module")
def backend():
    return get_backend("torch")


def test_direct_reshape_is_the_same_mistake_as_numpys(backend):
    """Both adapters make the one mistake the column/row-sample article describes, so they agree with each other."""
    case = CASE_BY_NAME["rope_gqa_causal"]  # GQA, causal, rotary on part of each head
    numpy_out = case.run(get_backend("numpy"), "float64", DIRECT_RESHAPE)
    torch_out = case.run(backend, "float64", DIRECT_RESHAPE)
    assert_close(torch_out, numpy_out, "float64")


def test_row_layout_of_native_stages(backend):
    """nn.Linear semantics, view + transpose to split (a view), contiguous().view to merge (a copy)."""
    case = CASES[0]
    query = case.inputs().query
    params = case.params()
    prepared, _ = backend.prepare(case.cfg, params, query)
    native = prepared.native_stages()
    q = native["q"]
    assert q.axes == ("B", "Nq", "H*Dk")
    np.testing.assert_allclose(q.value[0].numpy(), query[0] @ params.w_q.T + params.b_q, rtol=1e-12, atol=1e-12)
    heads = native["q_heads"]
    assert heads.axes == ("B", "H", "Nq", "Dk")
    assert (heads.relation, heads.parent) == ("view", "q")
    assert not heads.value.is_contiguous()  # the transpose leaves a strided view
    Dk = case.cfg.d_k
    H, Nq = heads.value.shape[1:3]
    assert heads.value.stride() == (Nq * H * Dk, Dk, H * Dk, 1)
    merged = native["merged"]
    assert merged.axes == ("B", "Nq", "H*Dv") and (merged.relation, merged.parent) == ("copy", "context")
    assert native["scores"].axes == ("B", "H", "Nq", "Nk")
    assert native["output"].axes == ("B", "Nq", "D")


def test_empty_rows_give_b_o_without_nan(backend, monkeypatch):
    import torch

    softmax = torch.softmax

    def softmax_that_must_not_make_nan(*args, **kwargs):
        result = softmax(*args, **kwargs)
        assert not torch.isnan(result).any(), "softmax produced NaN: an all -inf row reached it"
        return result

    monkeypatch.setattr(torch, "softmax", softmax_that_must_not_make_nan)
    cfg = MHAConfig(d_model=15, n_heads=3, bias=True)
    params = init_params(cfg, seed=5)
    query, key, value, mask = empty_rows_case(cfg).inputs().arrays
    for strategy in CORRECT_STRATEGIES:
        prepared, _ = backend.prepare(cfg, params, query, key, value, mask, dtype="float32", strategy=strategy)
        stages = prepared.native_stages()
        for name, stage in stages.items():
            assert not torch.isnan(stage.value).any(), f"NaN in stage {name} ({strategy})"
        output = prepared.to_numpy(prepared.forward())
        np.testing.assert_allclose(output[1, 5], params.b_o, rtol=1e-6, atol=1e-7)
        weights = backend.canonical_stages(prepared)["weights"]
        np.testing.assert_array_equal(weights[0, 1, 3], 0.0)
        assert np.isneginf(backend.canonical_stages(prepared)["masked_scores"][1, :, 5]).all()


def test_results_do_not_share_the_workspace(backend):
    case = CASES[0]
    prepared, _ = backend.prepare(case.cfg, case.params(), case.inputs().query, dtype="float32")
    assert prepared.info["workspace"]
    first = prepared.forward()
    kept = first.clone()
    second = prepared.forward()
    assert first.data_ptr() != second.data_ptr()
    assert (first == kept).all() and (first == second).all()


def test_precision_info_on_cpu(backend):
    case = CASES[0]
    prepared, _ = backend.prepare(case.cfg, case.params(), case.inputs().query, dtype="float32")
    assert prepared.info["tf32"] is False
    assert prepared.info["device"] == "cpu"
    assert "folded" in prepared.info["gqa"]


def test_matmul_precision_switches_are_set_and_restored():
    import torch

    from mha_rosetta.backends.torch.common import matmul_precision

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        with matmul_precision(False):
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_devices_and_unsupported(backend):
    case = CASES[0]
    assert backend.devices()[0] == "cpu"
    assert ("gpu" in backend.devices()) == _cuda_available()
    if not _cuda_available():
        reason = backend.unsupported_reason(case.cfg, "float32", "gpu", STANDARD)
        assert "no CUDA device" in reason
        with pytest.raises(UnsupportedCase, match="no CUDA device"):
            backend.prepare(case.cfg, case.params(), case.inputs().query, device="gpu")
    assert "no strategy" in backend.unsupported_reason(case.cfg, "float32", "cpu", "heads_first")


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("strategy", (STANDARD, SLICING))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case", [CASE_BY_NAME[name] for name in ("cross_attention", "gqa", "fully_masked_row")], ids=str
)
def test_gpu_output_matches_reference(backend, case, dtype, strategy):
    data = case.inputs()
    prepared, _ = backend.prepare(case.cfg, case.params(), *data.arrays, dtype=dtype, strategy=strategy, device="gpu")
    assert prepared.info["tf32"] is False
    assert_close(prepared.output(), case.reference(), dtype)


@pytest.mark.gpu
@needs_gpu
def test_gpu_tf32_changes_float32_error():
    """TF32 off: float32 accuracy. TF32 on (allow_tf32=True): errors of TF32's 10-bit mantissa."""
    from mha_rosetta.backends.torch.adapter import TorchBackend

    cfg = MHAConfig(d_model=256, n_heads=4)
    params = init_params(cfg, seed=0)
    x = np.random.default_rng(0).standard_normal((2, 128, 256))
    expected = reference_mha(cfg, params, x)
    errors = {}
    for allow in (False, True):
        prepared, _ = TorchBackend(name=f"torch-tf32-{allow}", allow_tf32=allow).prepare(
            cfg, params, x, dtype="float32", device="gpu"
        )
        assert prepared.info["tf32"] is allow
        result = prepared.forward()
        prepared.synchronize(result)
        errors[allow] = float(np.max(np.abs(prepared.to_numpy(result) - expected)))
    assert errors[False] < 2e-5, errors
    assert errors[True] > 10 * errors[False], errors  # TF32 rounds products to ~1e-3 relative


# -- the variants (issue 24) ---------------------------------------------------------------------------------


def test_chunked_skips_the_key_tiles_outside_the_window(backend):
    """12 tokens, blocks of 2, causal window 3: query block i needs key blocks i-1 and i only.

    The causal walk visits blocks 0..i (21 tiles over the 6 query blocks); the window leaves
    1 + 2 * 5 = 11 of them, so 10 are skipped whole, and the output is the oracle's.
    """
    cfg = MHAConfig(d_model=12, n_heads=2, causal=True, window=3)
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 12, 12))
    prepared, _ = backend.prepare(cfg, params, x, strategy="chunked", chunk=(2, 2))
    assert (prepared.info["tiles_visited"], prepared.info["tiles_skipped"]) == (11, 10)
    assert_close(prepared.output(), reference_mha(cfg, params, x), "float64")


def test_chunked_carries_softcap_bias_and_sinks_in_the_online_softmax(backend):
    """Everything the tiles carry at once, with a row that sees no key (the sink alone: a zero context)."""
    cfg = MHAConfig(
        d_model=12, n_heads=4, n_kv_heads=2, causal=True, softcap=1.2, alibi=True, sinks=True, rel_buckets=6
    )
    params = init_params(cfg, seed=6)
    x = np.random.default_rng(7).standard_normal((2, 7, 12))
    mask = np.ones((2, 4, 7, 7), dtype=bool)
    mask[1, 2, 4] = False  # query 4 of head 2 in item 1 may attend to nothing
    for dtype in ("float64", "float32", "bfloat16"):
        output = backend.run(cfg, params, x, mask=mask, dtype=dtype, strategy="chunked", chunk=(3, 2))
        assert_close(output, reference_mha(cfg, params, x, mask=mask), dtype, what=dtype)


def test_projection_qk_norm_per_head_adds_the_heads_sums_of_squares(backend):
    """PER_HEAD never builds the projection: its projection-wide norm adds the heads' sums of squares. The same
    numbers as the merged F.rms_norm, and not those of a per-head norm with the same weights."""
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, qk_norm="projection")
    params = init_params(cfg, seed=8)
    x = np.random.default_rng(9).standard_normal((2, 5, 16))
    per_head = backend.run(cfg, params, x, strategy=PER_HEAD, return_stages=True)[1]
    standard = backend.run(cfg, params, x, strategy=STANDARD, return_stages=True)[1]
    reference = reference_mha(cfg, params, x, return_stages=True)[1]
    for name in ("q_normed", "k_normed", "output"):
        assert_close(per_head[name], reference[name], "float64", what=name)
        assert_close(standard[name], reference[name], "float64", what=name)
    q_heads = reference["q_heads"]  # (B, H, Nq, Dk): a per-head RMS differs from the projection's
    per_head_rms = np.sqrt(np.mean(q_heads**2, axis=-1))
    projection_rms = np.sqrt(np.mean(reference["q"] ** 2, axis=-1))[:, None]
    assert np.max(np.abs(per_head_rms - projection_rms)) > 0.05


def test_in_place_score_variants_leave_the_recorded_scores_alone(backend):
    """The softcap and the bias work in place on the score buffer (inference); the recorded stages are snapshots."""
    cfg = MHAConfig(d_model=12, n_heads=3, softcap=0.8, alibi=True)
    params = init_params(cfg, seed=10)
    x = np.random.default_rng(11).standard_normal((2, 6, 12))
    _, stages = backend.run(cfg, params, x, return_stages=True)
    reference = reference_mha(cfg, params, x, return_stages=True)[1]
    for name in ("scores", "capped_scores", "biased_scores", "weights", "output"):
        assert_close(stages[name], reference[name], "float64", what=name)
    assert np.max(np.abs(stages["scores"])) > 0.8 >= np.max(np.abs(stages["capped_scores"]))  # the cap bites
