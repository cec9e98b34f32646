"""The two runtimes of an ONNX graph, the op's causal plan, and the float mask it takes for a score bias.

`make_runner` gives ONNX Runtime (CPU provider, both thread pools pinned per session through
`frameworks.onnx.session_options`) or onnx's ReferenceEvaluator behind one call; `op_plan` chooses
``is_causal``, a ``past_key`` split or ``attn_mask`` (`adapter`'s docstring); `float_mask` is the
op's additive ``attn_mask`` for ALiBi and T5's bias. Both are shared by the forward (`adapter`) and
the decode steps (`decode`) and ``torch-onnx``.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions, causal_on_indices
from mha_rosetta.core.variants import score_bias

from ..frameworks.onnx import session_options


def float_mask(cfg: MHAConfig, params: MHAParams, q_positions, k_positions, allowed, dtype: str) -> np.ndarray:
    """ALiBi/T5's score bias where allowed and -inf where blocked, (1|B, H, Nq, Nk), as the op's float attn_mask."""
    bias = score_bias(cfg, params.rel_bias, q_positions, k_positions)  # (1|B, H, Nq, Nk)
    if allowed is not None:
        bias = np.where(allowed, bias, -np.inf)
    return bias.astype(dtype)


def past_offset(cfg: MHAConfig, inputs: MHAInputs) -> int | None:
    """``P`` when causality alone makes queries at ``P..P+Nq-1`` see keys at ``0..Nk-1`` (bottom-right), else None."""
    n_q, n_k = inputs.q_tokens, inputs.kv_tokens
    if not cfg.causal or inputs.mask is not None or cfg.window is not None or cfg.has_score_bias or n_k <= n_q:
        return None
    offset = n_k - n_q
    if np.all(inputs.positions == np.arange(offset, n_k)) and np.all(inputs.kv_positions == np.arange(n_k)):
        return offset
    return None


def op_plan(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str):
    """(is_causal, past keys split off, attn_mask or None) for the op, as the module docstring says."""
    plain = cfg.causal and inputs.mask is None and cfg.window is None and not cfg.has_score_bias
    if plain and causal_on_indices(inputs):
        return True, 0, None
    if (past := past_offset(cfg, inputs)) is not None:
        return True, past, None
    allowed = allowed_positions(cfg, inputs)  # (1|B, 1|H, Nq, Nk) or None
    if cfg.has_score_bias:
        return False, 0, float_mask(cfg, params, inputs.positions, inputs.kv_positions, allowed, dtype)
    return False, 0, allowed


def make_runner(model, reference: bool):
    """``run(feeds, names) -> list`` of ORT (CPU, pinned threads) or of the ReferenceEvaluator."""
    if reference:
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        return lambda feeds, names=None: evaluator.run(names, feeds)
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return lambda feeds, names=None: session.run(names, feeds)
