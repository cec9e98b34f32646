"""The float64 oracle: multi-head attention written straight from the formulas.

For each batch item ``b`` and query head ``h`` (kv head ``g = h // group_size``)::

    Q = x_q @ w_q.T + b_q          K = x_k @ w_k.T + b_k          V = x_v @ w_v.T + b_v
    Q_h, K_g = R(positions) Q_h, R(kv_positions) K_g   (rotary embedding, only with cfg.rope)
    S_h = scale * Q_h @ K_g.T      (blocked positions -> -inf)
    A_h = softmax(S_h, over keys)  (a row with no allowed key -> all zeros)
    C_h = A_h @ V_g
    out = [C_0 | C_1 | ... | C_{H-1}] @ w_o.T + b_o

It loops over heads on purpose: clarity is the point, speed is the backends' job.

A query row that may attend to no key at all has no softmax (0/0). The spec defines
its weights as zeros, so its context is zero and its output is ``b_o`` (zero without
bias). Libraries differ here (NaN in torch SDPA, a uniform average in others); the
check reports each one's answer instead of hiding it.
"""

from __future__ import annotations

import numpy as np

from .config import MHAConfig
from .inputs import allowed_positions, prepare_inputs
from .params import MHAParams, validate_params
from .rotary import apply_rotary, rotary_tables
from .stages import STAGE_NAMES


def linear(x, weight, bias):
    """Row samples through an (out, in) weight: ``x @ weight.T + bias`` (any array type with ``@`` and ``.T``)."""
    y = x @ weight.T
    return y if bias is None else y + bias


def softmax_with_empty_rows(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis where rows of all -inf give zeros instead of NaN."""
    row_max = np.max(scores, axis=-1, keepdims=True)
    empty = np.isneginf(row_max)
    # Subtracting the row maximum keeps exp() in range for logits of any size.
    shifted = scores - np.where(empty, 0.0, row_max)
    exp = np.exp(shifted)
    total = np.sum(exp, axis=-1, keepdims=True)
    return np.where(empty, 0.0, exp / np.where(empty, 1.0, total))


def reference_stages(
    cfg: MHAConfig, params: MHAParams, query, key=None, value=None, mask=None, positions=None, kv_positions=None
) -> dict[str, np.ndarray]:
    """Every stage tensor of the oracle, batched and in the canonical layout of `core.stages`.

    ``positions``/``kv_positions``: the rotary positions (see `core.inputs.prepare_inputs`).
    """
    validate_params(cfg, params)
    inputs = prepare_inputs(cfg, query, key, value, mask, positions, kv_positions)
    f64 = {name: None if array is None else array.astype(np.float64) for name, array in params.as_dict().items()}
    x_q, x_k, x_v = (x.astype(np.float64) for x in (inputs.query, inputs.key, inputs.value))
    B, Nq, Nk = inputs.batch, inputs.q_tokens, inputs.kv_tokens
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    q = linear(x_q, f64["w_q"], f64["b_q"])  # (B, Nq, H*Dk)
    k = linear(x_k, f64["w_k"], f64["b_k"])  # (B, Nk, Hkv*Dk)
    v = linear(x_v, f64["w_v"], f64["b_v"])  # (B, Nk, Hkv*Dv)

    # Head h owns feature columns h*Dk:(h+1)*Dk; slicing makes that ownership explicit.
    q_heads = np.stack([q[:, :, h * Dk : (h + 1) * Dk] for h in range(H)], axis=1)  # (B, H, Nq, Dk)
    k_heads = np.stack([k[:, :, g * Dk : (g + 1) * Dk] for g in range(Hkv)], axis=1)  # (B, Hkv, Nk, Dk)
    v_heads = np.stack([v[:, :, g * Dv : (g + 1) * Dv] for g in range(Hkv)], axis=1)  # (B, Hkv, Nk, Dv)

    # Rotary: each head's feature pairs turned by the token's angle; the heads themselves without rope.
    tables = rotary_tables(cfg, inputs)
    q_rotated, k_rotated = q_heads, k_heads
    if tables is not None:
        q_rotated = apply_rotary(q_heads, tables.q_cos[:, None], tables.q_sin[:, None], tables.style)  # (B, H, Nq, Dk)
        k_rotated = apply_rotary(
            k_heads, tables.k_cos[:, None], tables.k_sin[:, None], tables.style
        )  # (B, Hkv, Nk, Dk)

    allowed = allowed_positions(cfg, inputs)
    allowed = np.ones((B, H, Nq, Nk), dtype=bool) if allowed is None else np.broadcast_to(allowed, (B, H, Nq, Nk))

    scores = np.empty((B, H, Nq, Nk))
    context = np.empty((B, H, Nq, Dv))
    masked_scores = np.empty_like(scores)
    weights = np.empty_like(scores)
    for h in range(H):
        g = cfg.kv_head_of(h)
        scores[:, h] = cfg.scale * (q_rotated[:, h] @ np.swapaxes(k_rotated[:, g], -1, -2))  # (B, Nq, Nk)
        masked_scores[:, h] = np.where(allowed[:, h], scores[:, h], -np.inf)
        weights[:, h] = softmax_with_empty_rows(masked_scores[:, h])
        context[:, h] = weights[:, h] @ v_heads[:, g]  # (B, Nq, Dv)

    merged = np.concatenate([context[:, h] for h in range(H)], axis=-1)  # (B, Nq, H*Dv)
    output = linear(merged, f64["w_o"], f64["b_o"])  # (B, Nq, D)

    stages = dict(q=q, k=k, v=v, q_heads=q_heads, k_heads=k_heads, v_heads=v_heads)
    stages.update(q_rotated=q_rotated, k_rotated=k_rotated, scores=scores, masked_scores=masked_scores)
    stages.update(weights=weights, context=context, merged=merged, output=output)
    assert tuple(stages) == STAGE_NAMES  # the table in core.stages is the contract
    return stages


def reference_mha(
    cfg: MHAConfig,
    params: MHAParams,
    query,
    key=None,
    value=None,
    mask=None,
    return_weights: bool = False,
    return_stages: bool = False,
    *,
    positions=None,
    kv_positions=None,
):
    """The float64 oracle.

    Returns the output ``(batch, q_tokens, d_model)`` (or ``(q_tokens, d_model)`` for
    unbatched input); with ``return_weights`` also the attention weights
    ``(batch, heads, q_tokens, kv_tokens)``; with ``return_stages`` also the dict of
    every stage tensor (always batched, canonical layout, see `core.stages`).
    ``positions`` (queries) and ``kv_positions`` (keys) are the rotary positions, integers
    ``(N,)`` or ``(B, N)``, defaulting to ``0 .. N-1`` (see `core.inputs.prepare_inputs`).
    """
    stages = reference_stages(cfg, params, query, key, value, mask, positions, kv_positions)
    batched = np.ndim(query) == 3
    output = stages["output"] if batched else stages["output"][0]
    extras = []
    if return_weights:
        extras.append(stages["weights"] if batched else stages["weights"][0])
    if return_stages:
        extras.append(stages)
    return (output, *extras) if extras else output
