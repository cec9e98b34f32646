"""The ``onnx`` and ``onnx-reference`` backends: the spec's layer exported around the ONNX ``Attention`` op.

Every spec case each backend supports agrees with the float64 oracle: in float32 within the
float32 tolerance, in float64 on the answer of the op's known float32 ``sqrt(scale)``
(`known.known_answer`) to 1e-15 and, with ``fold_scale=True``, on the spec itself. The stages
around the fused node are exposed and agree; the hidden ones are named. Decoding through
``past_key``/``present_key`` equals the full causal forward. Refusals carry their reasons.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx is not installed: pip install 'mha-rosetta[onnx]'")
pytest.importorskip("onnxruntime", reason="onnxruntime is not installed: pip install 'mha-rosetta[onnx]'")

from adapter_cases import CASE_BY_NAME, CASES, assert_stages_close

from mha_rosetta.backends import UnsupportedCase, get_backend
from mha_rosetta.backends.onnx.adapter import OnnxBackend, OnnxReferenceBackend
from mha_rosetta.backends.onnx.known import float32_sqrt_scale, known_answer
from mha_rosetta.backends.onnx.runtime import op_plan
from mha_rosetta.core import MHAConfig, assert_close, compare, init_params, prepare_inputs
from mha_rosetta.core.decode import reference_decode

NAMES = ("onnx", "onnx-reference")
# The reference evaluator is a Python interpreter of the graph: every case once, ORT on every case in both dtypes.
SUPPORTED = [
    case for case in CASES if get_backend("onnx").unsupported_reason(case.cfg, "float32", "cpu", "standard") is None
]


def _args(case):
    data = case.inputs()
    return (data.query, data.key, data.value, data.mask, data.positions, data.kv_positions)


@pytest.mark.parametrize("case", SUPPORTED, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_float32_agrees_with_the_spec(name, case):
    assert_close(case.run(get_backend(name), "float32"), case.reference(), "float32", what=f"{name} on {case}")


@pytest.mark.parametrize("case", SUPPORTED, ids=str)
def test_float64_lands_on_the_float32_square_root_of_the_scale(case):
    """The op's known difference, measured: the float64 output is the spec's with the scale float32 applies."""
    backend = get_backend("onnx")
    output = case.run(backend, "float64")
    answer = known_answer("sqrt_scale", case.cfg, case.params(), _args(case), case.reference_stages()).output
    answer = answer[0] if case.inputs().query.ndim == 2 else answer  # (Nq, D) for an unbatched case
    assert_close(output, answer, "float64", atol=1e-14, rtol=1e-12)
    if float32_sqrt_scale(case.cfg.scale) != case.cfg.scale:  # beyond float64's tolerance from the exact spec
        assert not compare(output, case.reference(), "float64").ok


@pytest.mark.parametrize("case_name", ["self_attention", "gqa", "rope_interleaved", "softcap", "alibi", "causal_cache"])
@pytest.mark.parametrize("cls", [OnnxBackend, OnnxReferenceBackend])
def test_fold_scale_agrees_in_float64(cls, case_name):
    case = CASE_BY_NAME[case_name]
    assert_close(case.run(cls(fold_scale=True), "float64"), case.reference(), "float64", what=f"{cls.name} {case}")


def test_opset_24_runs_where_installed_onnx_has_it():
    case = CASE_BY_NAME["causal"]
    backend = OnnxBackend(opset=24)
    if backend.unsupported_reason(case.cfg, "float32", "cpu", "standard"):
        pytest.skip("the installed onnx has no opset 24")
    assert_close(case.run(backend, "float32"), case.reference(), "float32")
    for name in NAMES:  # the opset24 strategy: what the check runs beside opset 23
        output, stages = case.run(get_backend(name), "float32", strategy="opset24", return_stages=True)
        assert_close(output, case.reference(), "float32")
        assert_stages_close(stages, case.reference_stages(), "float32", ("masked_scores", "weights", "context"))
    assert "opset 25" in OnnxBackend(opset=25).unsupported_reason(case.cfg, "float32", "cpu", "standard")


STAGE_CASES = [
    "padding",
    "rope_gqa_causal",
    "qk_norm_projection",
    "mistral",
    "softcap",
    "gemma2",
    "alibi",
    "causal_cache",
]


@pytest.mark.parametrize("case_name", STAGE_CASES)
@pytest.mark.parametrize("name", NAMES)
def test_stages_around_and_inside_the_fused_node(name, case_name):
    """Every tensor around the node, and its insides through qk_matmul_output in the spec's numbering (#7913)."""
    case = CASE_BY_NAME[case_name]
    backend = get_backend(name)
    _, stages = case.run(backend, "float32", return_stages=True)
    reference = case.reference_stages()
    shown = {"q", "k", "v", "q_heads", "k_heads", "v_heads", "weights", "context", "merged", "output"}
    shown |= {"q_rotated", "k_rotated"} if case.cfg.rope else set()
    shown |= {"q_normed", "k_normed"} if case.cfg.qk_norm else set()
    shown |= {"capped_scores"} if case.cfg.softcap else set()
    masked = case.cfg.causal or case.cfg.window or case.cfg.has_score_bias or case.inputs().mask is not None
    shown |= {"masked_scores"} if masked else set()
    shown |= set() if name == "onnx-reference" and case.cfg.softcap else {"scores"}  # its mode 0 is capped then
    assert set(stages) == shown
    assert_stages_close(stages, reference, "float32", shown)
    prepared, _ = backend.prepare(
        case.cfg, case.params(), *case.inputs().arrays, dtype="float32", **case.inputs().positions_kwargs
    )
    hidden = [
        n for n in ("scores", "capped_scores", "biased_scores", "masked_scores") if n in reference and n not in shown
    ]
    assert [n for n in prepared.info["stages_hidden"] if n in reference] == hidden


def test_the_causal_plan_uses_the_ops_own_rules():
    """is_causal on indices; cached keys split off as past_key (bottom-right); anything else in the mask."""
    params = init_params(MHAConfig(d_model=8, n_heads=2, causal=True), seed=0)
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True)
    x = np.zeros((1, 5, 8))
    assert op_plan(cfg, params, prepare_inputs(cfg, x), "float32")[:2] == (True, 0)
    cached = prepare_inputs(cfg, x[:, :3], x, None, None, np.arange(2, 5)[None], np.arange(5)[None])
    assert op_plan(cfg, params, cached, "float32")[:2] == (True, 2)
    padded = prepare_inputs(cfg, x, None, None, np.array([[True] * 4 + [False]]))
    is_causal, past, mask = op_plan(cfg, params, padded, "float32")
    assert (is_causal, past) == (False, 0) and mask.dtype == np.bool_ and not mask[0, 0, 0, 1] and mask[0, 0, 1, 0]
    alibi = dataclasses.replace(cfg, alibi=True)
    _, _, float_mask = op_plan(alibi, params, prepare_inputs(alibi, x), "float32")
    assert float_mask.dtype == np.float32 and np.isneginf(float_mask[0, 0, 0, 1]) and float_mask[0, 1, 2, 0] < 0


def test_refusals_name_the_reason():
    backend = get_backend("onnx")
    sinks = CASE_BY_NAME["sinks"]
    assert "no sinks" in backend.unsupported_reason(sinks.cfg, "float32", "cpu", "standard")
    assert "float32 and float64" in backend.unsupported_reason(CASE_BY_NAME["causal"].cfg, "float16", "cpu", "standard")
    with pytest.raises(UnsupportedCase, match="no sinks"):
        sinks.run(backend, "float32")


DECODE = [
    ("plain", MHAConfig(d_model=12, n_heads=3, n_kv_heads=1, rope="half", causal=True), {}),
    ("window", MHAConfig(d_model=12, n_heads=3, window=3, causal=True, softcap=5.0), {}),
    ("alibi", MHAConfig(d_model=12, n_heads=4, d_k=3, alibi=True, causal=True), {}),
    ("left_padded", MHAConfig(d_model=12, n_heads=3, rope="interleaved", causal=True), {"mask": True}),
]


@pytest.mark.parametrize(("label", "cfg", "extra"), DECODE, ids=[d[0] for d in DECODE])
@pytest.mark.parametrize("name", NAMES)
def test_decode_through_past_key_equals_the_full_forward(name, label, cfg, extra):
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 9, cfg.d_model))
    mask = None
    if extra.get("mask"):
        mask = np.ones((2, 9), bool)
        mask[1, :3] = False  # item 1 left-padded by 3
    expected = reference_decode(cfg, params, x, prefill=4, step=2, mask=mask)
    backend = OnnxBackend(fold_scale=True) if name == "onnx" else OnnxReferenceBackend(fold_scale=True)
    output = backend.run_decode(cfg, params, x, prefill=4, step=2, mask=mask, dtype="float64")
    assert_close(output, expected, "float64", what=f"{name} decode {label}")
    prepared, _ = backend.prepare_decode_run(cfg, params, x, prefill=4, step=2, mask=mask, dtype="float32")
    assert prepared.info["cache"]["kind"] == "past_key"
    assert prepared.info["is_causal"] == (label == "plain")  # the op's past offset, else decode_allowed as the mask
    if cfg.window is not None:
        assert prepared.info["cache"]["slots"] == cfg.window - 1 + 2


def test_float64_decode_declares_the_float32_square_root():
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True)
    prepared, _ = get_backend("onnx").prepare_decode_run(cfg, init_params(cfg, seed=0), np.zeros((1, 4, 12)), prefill=2)
    assert prepared.info["tolerance_dtype"] == "float32" and prepared.info["known_difference"] == "sqrt_scale"


def test_a_timed_decode_step_runs_one_session_call():
    cfg = MHAConfig(d_model=12, n_heads=3, n_kv_heads=1, rope="half", causal=True, window=4)
    prepared = get_backend("onnx").prepare_decode(cfg, init_params(cfg, seed=0), context=10, batch=2, step=1)
    assert prepared.output().shape == (2, 1, 12)
    assert prepared.info["cache"]["slots"] == 4  # the window's W - 1 past slots and the new one


def test_session_threads_follow_the_benchmark_pinning():
    from mha_rosetta.backends.frameworks import get_framework
    from mha_rosetta.backends.frameworks import onnx as layer

    saved = layer.session_threads()
    try:
        applied = get_framework("onnxruntime").configure_threads(1)
        assert applied == {"onnxruntime.intra_op_num_threads": 1, "onnxruntime.inter_op_num_threads": 1}
        options = layer.session_options()
        assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)
    finally:
        layer._SESSION_THREADS["threads"] = saved
    assert not get_framework("onnxruntime").owns(np.zeros(2))  # its arrays are NumPy's: NumPy answers for them


def test_the_decode_check_names_the_float32_square_root_in_float64():
    from mha_rosetta.checks import Status, run_check

    result = run_check(kind="decode", backends="onnx,numpy", cases=["plain_mha"], dtypes=["float64", "float32"])
    runs = {(run.label, run.dtype): run for run in result.runs}
    onnx64 = runs[("onnx[past_key]", "float64")]
    assert onnx64.status is Status.KNOWN_DIFFERENCE
    assert "known difference sqrt_scale" in onnx64.reason and "[source: ONNX Attention" in onnx64.reason
    assert runs[("onnx[past_key]", "float32")].status is Status.AGREE
    assert result.exit_status == 0
