"""One ``Attention`` node, called bare in each runtime, to measure its known differences live (`known.KNOWN`).

`attention_call` runs a single op in ONNX Runtime, onnx's ReferenceEvaluator or torch's
``torch.onnx.ops.attention`` on NumPy float64 heads (B, H, N, d); `findings` classifies what each
runtime does for every known difference against float64 NumPy readings of the candidates. The
explainer (`explain.differences.onnx`) prints these, and `tests/test_onnx_known.py` asserts them.
"""

from __future__ import annotations

import numpy as np

from .._probe import import_failure
from ..demos._needs import LibraryMissing
from .known import KNOWN, OP_ATTRIBUTES, attribute_transform

RUNTIMES = ("onnxruntime", "reference", "torch")
RUNTIME_LABELS = {
    "onnxruntime": "ONNX Runtime (CPU)",
    "reference": "onnx ReferenceEvaluator",
    "torch": "torch.onnx.ops.attention",
}
_OUTPUTS = ("Y", "present_key", "present_value", "qk_matmul_output")


def _needs(module: str) -> None:
    reason = import_failure(module)  # not installed, or the import error with its remedy (core.probe)
    if reason:
        raise LibraryMissing(module, reason)


def attention_call(runtime: str, q, k, v, mask=None, past=None, **attrs) -> list:
    """The op's four outputs (absent ones None) for float64 ``q``, ``k``, ``v`` (B, H, N, d), ``mask`` (bool,
    broadcastable to (B, H, Nq, T)), ``past`` (past_key, past_value) and the op's attributes."""
    if runtime == "torch":
        _needs("torch")
        import torch

        tensors = [
            None if a is None else torch.from_numpy(np.asarray(a)) for a in (q, k, v, mask, *(past or (None, None)))
        ]
        return [t.numpy() for t in torch.onnx.ops.attention(*tensors, **attrs)]
    _needs("onnx")
    from onnx import TensorProto, helper

    feeds = {"Q": q, "K": k, "V": v}
    if mask is not None:
        feeds["M"] = np.asarray(mask)
    if past is not None:
        feeds["PK"], feeds["PV"] = past
    names = ["Q", "K", "V", "M" if mask is not None else ""] + (["PK", "PV"] if past is not None else [])
    while names[-1] == "":
        names.pop()
    kind = {name: TensorProto.BOOL if name == "M" else TensorProto.DOUBLE for name in feeds}
    node = helper.make_node("Attention", names, list(_OUTPUTS), **attrs)
    inputs = [helper.make_tensor_value_info(name, kind[name], None) for name in feeds]
    outputs = [helper.make_tensor_value_info(name, TensorProto.DOUBLE, None) for name in _OUTPUTS]
    model = helper.make_model(
        helper.make_graph([node], "probe", inputs, outputs), opset_imports=[helper.make_opsetid("", 23)]
    )
    model.ir_version = min(model.ir_version, 10)
    if runtime == "reference":
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(model).run(None, feeds)
    _needs("onnxruntime")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # the unshaped outputs' warnings are not findings
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    exp = np.exp(logits - np.where(np.isfinite(top), top, 0))
    total = exp.sum(axis=-1, keepdims=True)
    return np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)


def _attend(q, k, v, scale, allowed=None, attributes=None, after_mask=False) -> np.ndarray:
    """The float64 reading: scores, the op's variant ``attributes`` (the spec's formula) before the mask, or after
    it with ``after_mask``, the softmax, the context."""
    scores = q @ k.swapaxes(-1, -2) * scale  # (B, H, Nq, T)
    if attributes and not after_mask:
        scores = attribute_transform(scores, attributes)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    if attributes and after_mask:
        scores = attribute_transform(scores, attributes)
    return _softmax(scores) @ v


def _closest(value: np.ndarray, candidates: dict, atol: float = 1e-12) -> str:
    value = np.nan_to_num(np.asarray(value, dtype=np.float64), neginf=-1e300)
    for name, candidate in candidates.items():
        if np.allclose(value, np.nan_to_num(candidate, neginf=-1e300), rtol=0, atol=atol):
            return name
    if np.isnan(value).all():
        return "NaN"
    return "none of the candidates"


def findings(runtime: str, seed: int = 0) -> dict[str, str]:
    """What ``runtime`` does for each known difference, measured now on a small float64 case (B=1, H=2, d=4)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, n, 4)) for n in (3, 5, 5))
    scale = 0.3
    attributes = dict.fromkeys(OP_ATTRIBUTES.values(), 2.0)  # the op's variant attributes (its softcap), each 2
    allowed = rng.random((3, 5)) > 0.4
    allowed[:, 0] = True
    out = {}
    y = attention_call(runtime, q, k, v, scale=scale)[0]
    root = float(np.sqrt(np.float32(scale)))
    error = float(np.abs(y - _attend(q, k, v, scale)).max())
    exact, float32_root = KNOWN["sqrt_scale"].readings
    candidates = {exact: _attend(q, k, v, scale), float32_root: _attend(q, k, v, root * root)}
    out["sqrt_scale"] = _closest(y, candidates, 1e-14)
    out["sqrt_scale"] += f" (max abs {error:.2g} from the exact float64 scale)"
    scale = 0.25  # from here on a scale whose square root float32 holds exactly: only the probed rule differs
    y = attention_call(runtime, q, k, v, allowed, scale=scale, **attributes)[0]
    before, after = KNOWN["softcap_after_mask"].readings
    candidates = {
        before: _attend(q, k, v, scale, allowed, attributes),
        after: _attend(q, k, v, scale, allowed, attributes, after_mask=True),
    }
    out["softcap_after_mask"] = _closest(y, candidates, 1e-12)
    past = 2  # queries 0..2 of the block after 2 cached keys: keys 0..4 in all
    y = attention_call(
        runtime, q, k[:, :, past:], v[:, :, past:], past=(k[:, :, :past], v[:, :, :past]), scale=scale, is_causal=1
    )[0]
    bottom_right, top_left = np.tril(np.ones((3, 5), bool), past), np.tril(np.ones((3, 5), bool))
    offset_aware, on_indices = KNOWN["causal_past_top_left"].readings
    out["causal_past_top_left"] = _closest(
        y, {offset_aware: _attend(q, k, v, scale, bottom_right), on_indices: _attend(q, k, v, scale, top_left)}
    )
    empty = allowed.copy()
    empty[1] = False
    row = attention_call(runtime, q, k, v, empty, scale=scale)[0][:, :, 1]
    zero, mean = KNOWN["empty_rows_zero"].readings
    out["empty_rows_zero"] = _closest(row, {zero: np.zeros_like(row), mean: v.mean(axis=2)})
    scores = q @ k.swapaxes(-1, -2) * scale  # (B, H, Nq, T)
    capped, masked = attribute_transform(scores, attributes), np.where(allowed, scores, -np.inf)
    stages = {
        "scores": scores,
        "capped": capped,
        "capped+masked": np.where(allowed, capped, -np.inf),
        "masked": masked,
        "masked+capped": attribute_transform(masked, attributes),
        "weights": _softmax(np.where(allowed, capped, -np.inf)),
        f"weights ({after})": _softmax(attribute_transform(masked, attributes)),
    }
    modes = []
    for mode in range(4):
        qk = attention_call(runtime, q, k, v, allowed, scale=scale, qk_matmul_output_mode=mode, **attributes)[3]
        modes.append(f"{mode}: {_closest(qk, stages, 1e-10)}")
    out["qk_mode_numbering"] = ", ".join(modes)
    return out
