"""The ``torch-onnx`` oracle (``torch.onnx.ops.attention``, and ``torch.onnx.export``'s graph in ONNX Runtime),
and how all three ONNX backends are skipped, with the install command, where their libraries are missing.

Where none of torch's known departures from the ONNX spec applies (no softcap with a mask, no
cached keys), ``torch.onnx.ops.attention`` agrees with the spec in float64 to the float64
tolerance: it applies the scale in the tensors' dtype. The exported graph agrees in float32.
"""

from __future__ import annotations

import pytest

from conftest import library_absent
from mha_rosetta.backends import BackendNotInstalled, available_backends, get_backend, missing_backends


@pytest.mark.parametrize(
    ("absent", "expected"),
    [
        ("onnxruntime", {"onnx": "onnx, onnxruntime", "torch-onnx": "onnxruntime"}),
        ("onnx", {"onnx": "onnx", "onnx-reference": "onnx", "torch-onnx": "onnx"}),
    ],
)
def test_a_missing_library_skips_the_backend_with_the_install_command(monkeypatch, absent, expected):
    with library_absent(monkeypatch, absent):
        missing = missing_backends()
        for name in expected:
            assert name not in available_backends()
            assert "needs " in missing[name] and absent in missing[name]
            extra = "onnx,torch" if name == "torch-onnx" else "onnx"
            assert missing[name].endswith(f"which is not installed: pip install 'mha-rosetta[{extra}]'")
            with pytest.raises(BackendNotInstalled, match=r"pip install 'mha-rosetta\[onnx"):
                get_backend(name)


def _needs_all():
    for module in ("torch", "onnx", "onnxruntime", "onnxscript"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install 'mha-rosetta[onnx,torch]'")


STANDARD_CASES = ["self_attention", "cross_attention", "gqa", "padding", "custom_scale", "rope_interleaved", "alibi",
                  "qk_norm_head", "window", "softcap", "causal"]  # fmt: skip


@pytest.mark.parametrize("case_name", STANDARD_CASES)
def test_ops_attention_agrees_where_no_known_difference_applies(case_name):
    _needs_all()
    from adapter_cases import CASE_BY_NAME

    from mha_rosetta.core import assert_close

    case = CASE_BY_NAME[case_name]
    backend = get_backend("torch-onnx")
    # softcap without a mask: capping before or after a mask that blocks nothing is the same
    assert_close(case.run(backend, "float64"), case.reference(), "float64", what=f"torch-onnx on {case}")
    assert_close(case.run(backend, "float32"), case.reference(), "float32", what=f"torch-onnx on {case}")


def test_the_exported_graph_runs_in_onnx_runtime():
    _needs_all()
    from adapter_cases import CASE_BY_NAME

    from mha_rosetta.core import assert_close

    case = CASE_BY_NAME["padding"]
    backend = get_backend("torch-onnx")
    data = case.inputs()
    prepared, _ = backend.prepare(case.cfg, case.params(), *data.arrays, dtype="float32", strategy="export")
    assert {"MatMul", "Softmax"} <= set(prepared.info["exported_ops"])  # SDPA decomposed: no Attention op
    assert "Attention" not in prepared.info["exported_ops"]
    assert_close(prepared.output(), case.reference(), "float32")
    reason = backend.unsupported_reason(CASE_BY_NAME["causal"].cfg, "float32", "cpu", "export")
    assert "no causal mask" in reason


def test_decode_is_refused_with_the_causal_offset_reason():
    _needs_all()
    from mha_rosetta.core import MHAConfig

    reason = get_backend("torch-onnx").decode_reason(
        MHAConfig(d_model=6, n_heads=2, causal=True), "float32", "cpu", "standard", None
    )
    assert "ignores the past length" in reason
