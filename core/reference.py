"""The float64 oracle: multi-head attention written straight from the formulas.

For each batch item ``b`` and query head ``h`` (kv head ``g = h // group_size``)::

    Q = x_q @ w_q.T + b_q          K = x_k @ w_k.T + b_k          V = x_v @ w_v.T + b_v
    Q_h, K_g = RMSNorm(Q_h), RMSNorm(K_g)              (only with a norm before rotary: QK-norm)
    V_g = V_g / sqrt(mean(V_g**2) + eps)               (only with cfg.value_norm: Gemma 4, no weight)
    Q_h, K_g = R(positions) Q_h, R(kv_positions) K_g   (rotary embedding, only with cfg.rope)
    Q_h, K_g = RMSNorm(Q_h), RMSNorm(K_g)              (weightless, only with cfg.qk_norm_after_rope: Llama 4)
    Q_h = Q_h * (1 + a log1p(floor((p + o) / f)))      (only with cfg.attn_temperature_tuning: Llama 4's NoPE o=1,
                                                        Mistral 4 o=0: cfg.floor_offset)
    S_h = scale * Q_h @ K_g.T      (then the registry's score steps: softcap, ALiBi / relative bias;
                                    blocked positions -> -inf)
    A_h = softmax(S_h, over keys)  (with the sinks; a row with no allowed key -> all zeros)

The score steps are the variant registry's (`core.variants.score_steps`), each entry's float64 forward
in its own module, run in pipeline order: no variant is named here.
    C_h = A_h @ V_g
    out = [C_0 | C_1 | ... | C_{H-1}] @ w_o.T + b_o
    (with attn_output_gate: [C_0 | ... ] * sigmoid(x_q @ w_gate.T + b_gate) before w_o)

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
from .packing import ragged_arguments
from .params import MHAParams, validate_params
from .rotary import apply_rotary, rotary_tables
from .stages import stage_names
from .variants import (
    bias_terms,
    gate_forward,
    mla_heads,
    norm_after_rope,
    norm_step,
    rms_norm,
    softmax_with_empty_rows,
    steps_at_place,
    temper,
    value_rms_norm,
)
from .variants.mla import mla_on

__all__ = [
    "call_result",
    "forward_stages",
    "linear",
    "reference_mha",
    "reference_stages",
    "softmax_with_empty_rows",
]


def linear(x, weight, bias):
    """Row samples through an (out, in) weight: ``x @ weight.T + bias`` (any array type with ``@`` and ``.T``)."""
    y = x @ weight.T
    return y if bias is None else y + bias


def reference_stages(
    cfg: MHAConfig, params: MHAParams, query, key=None, value=None, mask=None, positions=None, kv_positions=None
) -> dict[str, np.ndarray]:
    """Every stage tensor of the oracle, batched and in the canonical layout of `core.stages`.

    ``positions``/``kv_positions``: the token positions (rotary, window, ALiBi and relative
    bias read them; see `core.inputs.prepare_inputs`). The keys are `stage_names(cfg)`.
    """
    validate_params(cfg, params)
    inputs = prepare_inputs(cfg, query, key, value, mask, positions, kv_positions)
    return forward_stages(cfg, *operands(params, inputs), inputs, lambda a: a)


def as_float64(array: np.ndarray) -> np.ndarray:
    """``array`` as float64 (a copy): what the float64 oracles compute on."""
    return array.astype(np.float64)


def float_params(params: MHAParams, cast=as_float64) -> dict:
    """The parameters by name, each array passed through ``cast`` (an absent one stays None): float64 for the
    oracles (`core.mla_forms`' too); the backward oracle's ``rounding`` path rounds them to storage (`core.grad`)."""
    return {name: None if array is None else cast(array) for name, array in params.as_dict().items()}


def operands(params: MHAParams, inputs, cast=as_float64) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """(parameters by name, x_q, x_k, x_v (B, N, F)): what `forward_stages` reads, each array through ``cast``."""
    x_q, x_k, x_v = (cast(x) for x in (inputs.query, inputs.key, inputs.value))
    return float_params(params, cast), x_q, x_k, x_v


def forward_stages(cfg: MHAConfig, p: dict, x_q, x_k, x_v, inputs, r) -> dict[str, np.ndarray]:
    """The pipeline on float arrays ``p`` (parameters by name) and ``x_*`` (B, N, F), each stage passed through ``r``.

    ``r`` is the identity for the float64 oracle; the backward oracle's ``rounding`` path
    passes a round-to-storage function (see `core.grad`), so both run these same lines.
    """
    if mla_on(cfg):  # MLA: its latents, per-head keys and values expanded from them, its rotary (core.variants.mla)
        rotate = mla_heads.Rotation(rotary_tables(cfg, inputs), apply_rotary)
        return attend(cfg, p, x_q, inputs, r, mla_heads.head_stages(cfg, p, x_q, x_k, x_v, rotate, r))
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    q = r(linear(x_q, p["w_q"], p["b_q"]))  # (B, Nq, H*Dk)
    k = r(linear(x_k, p["w_k"], p["b_k"]))  # (B, Nk, Hkv*Dk)
    v = r(linear(x_v, p["w_v"], p["b_v"]))  # (B, Nk, Hkv*Dv)

    def heads(merged, n, width):  # head h owns feature columns h*width:(h+1)*width
        return np.stack([merged[:, :, h * width : (h + 1) * width] for h in range(n)], axis=1)  # (B, n, N, width)

    q_heads, k_heads, v_heads = heads(q, H, Dk), heads(k, Hkv, Dk), heads(v, Hkv, Dv)
    stages = dict(q=q, k=k, v=v, q_heads=q_heads, k_heads=k_heads, v_heads=v_heads)
    if getattr(cfg, "value_norm", False):  # Gemma 4: each kv head's values RMS-normed, no weight
        v_heads = stages["v_normed"] = r(value_rms_norm(v_heads, cfg.norm_eps))  # (B, Hkv, Nk, Dv)

    # The norm before rotary (the registry's `norm_step`: QK-norm): over each head's features after the split,
    # or over the whole projection before it.
    q_normed, k_normed = q_heads, k_heads
    step = norm_step(cfg)
    if step is not None:
        w_q, w_k = p[step.weight("q")], p[step.weight("k")]  # present exactly when it is on (validate_params)
        if step.per_head:
            q_normed = r(rms_norm(q_heads, w_q, cfg.norm_eps))  # (B, H, Nq, Dk)
            k_normed = r(rms_norm(k_heads, w_k, cfg.norm_eps))  # (B, Hkv, Nk, Dk)
        else:
            q_normed = heads(r(rms_norm(q, w_q, cfg.norm_eps)), H, Dk)  # (B, H, Nq, Dk)
            k_normed = heads(r(rms_norm(k, w_k, cfg.norm_eps)), Hkv, Dk)  # (B, Hkv, Nk, Dk)
        stages.update(q_normed=q_normed, k_normed=k_normed)

    # Rotary: each head's feature pairs turned by the token's angle; unchanged without rope.
    tables = rotary_tables(cfg, inputs)
    q_rotated, k_rotated = q_normed, k_normed
    if tables is not None:
        q_rotated = r(apply_rotary(q_normed, tables.q_cos[:, None], tables.q_sin[:, None], tables.style))
        k_rotated = r(apply_rotary(k_normed, tables.k_cos[:, None], tables.k_sin[:, None], tables.style))
    stages.update(q_rotated=q_rotated, k_rotated=k_rotated)  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk)
    return attend(cfg, p, x_q, inputs, r, stages)


def attend(cfg: MHAConfig, p: dict, x_q, inputs, r, stages: dict) -> dict[str, np.ndarray]:
    """``stages`` (up to ``q_rotated``, ``k_rotated``) completed: the scores, their steps, softmax, context, output."""
    B, Nq, Nk = inputs.batch, inputs.q_tokens, inputs.kv_tokens
    H, Dv = cfg.n_heads, cfg.d_v
    q_rotated, k_rotated = stages["q_rotated"], stages["k_rotated"]
    v_heads = stages.get("v_normed", stages["v_heads"])  # what the weighted sum reads (normed with value_norm)
    q_scored, k_scored = scored_qk(cfg, q_rotated, k_rotated, inputs.positions, stages, r)
    allowed = allowed_positions(cfg, inputs)
    allowed = np.ones((B, H, Nq, Nk), dtype=bool) if allowed is None else np.broadcast_to(allowed, (B, H, Nq, Nk))
    bias = bias_terms(cfg, p, inputs.positions, inputs.kv_positions)  # (1|B, H, Nq, Nk) or None
    compute = q_scored.dtype
    scores = np.empty((B, H, Nq, Nk), dtype=compute)
    for h in range(H):
        g = cfg.kv_head_of(h)
        scores[:, h] = cfg.scale * (q_scored[:, h] @ np.swapaxes(k_scored[:, g], -1, -2))  # (B, Nq, Nk)
    scores = stages["scores"] = r(scores)
    last = scores
    for entry in steps_at_place(cfg, "transform"):  # the softcap: each its own stage, in registry order
        last = stages[entry.stages[0]] = r(entry.step_forward(cfg, last))
    if bias is not None:  # ALiBi and T5's bias share one stage
        last = stages[steps_at_place(cfg, "bias")[0].stages[0]] = r(last + bias)
    masked_scores = stages["masked_scores"] = np.where(allowed, last, -np.inf)
    softmax = steps_at_place(cfg, "softmax")  # the sinks, or the plain softmax
    weights = softmax[0].step_forward(cfg, p, masked_scores) if softmax else softmax_with_empty_rows(masked_scores)
    weights = stages["weights"] = r(weights)  # (B, H, Nq, Nk)

    context = np.empty((B, H, Nq, Dv), dtype=compute)
    for h in range(H):
        context[:, h] = weights[:, h] @ v_heads[:, cfg.kv_head_of(h)]  # (B, Nq, Dv)
    context = stages["context"] = r(context)
    merged = stages["merged"] = np.concatenate([context[:, h] for h in range(H)], axis=-1)  # (B, Nq, H*Dv)
    if p.get("w_gate") is not None:  # attn_output_gate (Qwen3-Next): w_o reads merged * sigmoid(x_q w_gate.T + b)
        gate = stages["gate"] = r(gate_forward(x_q, p["w_gate"], p.get("b_gate")))  # (B, Nq, H*Dv)
        merged = r(merged * gate)
    stages["output"] = r(linear(merged, p["w_o"], p["b_o"]))  # (B, Nq, D)
    assert tuple(stages) == stage_names(cfg)  # the table in core.stages is the contract
    return stages


def scored_qk(cfg: MHAConfig, q_rotated, k_rotated, positions, stages: dict, r):
    """The queries and keys the scores read: the rotated ones, then Llama 4's steps after rotary when on.

    ``qk_norm_after_rope``: a weightless RMSNorm per head (stages ``q_rotated_normed``, ``k_rotated_normed``);
    ``attn_temperature_tuning``: the queries times their positions' factors (stage ``q_tempered``). Each
    stage is written into ``stages``; ``positions`` (1|B, Nq) include the cache offset on a decode step.
    """
    q, k = q_rotated, k_rotated
    if cfg.qk_norm_after_rope:
        q, k = norm_after_rope(cfg, q, k)
        q, k = stages["q_rotated_normed"], stages["k_rotated_normed"] = r(q), r(k)
    if cfg.attn_temperature_tuning:
        q = stages["q_tempered"] = r(temper(cfg, q, positions))  # (B, H, Nq, Dk)
    return q, k


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
    cu_seqlens=None,
    position_ids=None,
    seq_lens=None,
    kv_seq_lens=None,
):
    """The float64 oracle.

    Returns the output ``(batch, q_tokens, d_model)`` (or ``(q_tokens, d_model)`` for
    unbatched input); with ``return_weights`` also the attention weights
    ``(batch, heads, q_tokens, kv_tokens)``; with ``return_stages`` also the dict of
    every stage tensor (always batched, canonical layout, see `core.stages`).
    ``positions`` (queries) and ``kv_positions`` (keys) are the token positions, integers
    ``(N,)`` or ``(B, N)``, defaulting to ``0 .. N-1`` (see `core.inputs.prepare_inputs`).
    ``cu_seqlens`` or packed ``position_ids``: ``query`` is ``(T, d_model)`` or ``(1, T, d_model)``
    packed documents, each attending only within itself, positions restarting per document
    (`core.packing`); results keep the caller's form. ``seq_lens`` (and ``kv_seq_lens``): per-row
    lengths of a right-padded ``(B, N, d_model)`` batch; padding keys are never attended and a
    padding query row has zero context (its output is ``b_o``).
    """
    ragged = dict(cu_seqlens=cu_seqlens, position_ids=position_ids, seq_lens=seq_lens, kv_seq_lens=kv_seq_lens)
    query, mask, positions = ragged_arguments(cfg, query, key, value, mask, positions, kv_positions, **ragged)
    stages = reference_stages(cfg, params, query, key, value, mask, positions, kv_positions)

    def unbatch(array):  # the caller's form: (1, ...) -> (...) for an unbatched query (a view)
        return array if np.ndim(query) == 3 else array[0]

    return call_result(unbatch(stages["output"]), stages, return_weights, return_stages, unbatch)


def call_result(output, stages: dict, return_weights: bool, return_stages: bool, unbatch):
    """What `reference_mha` and `Backend.run` return: ``output`` alone, or ``(output, weights, stages)`` with the
    ones asked for: the weights ``unbatch``-ed to the caller's form, the stages batched (canonical layout)."""
    extras = [unbatch(stages["weights"])] if return_weights else []
    if return_stages:
        extras.append(stages)
    return (output, *extras) if extras else output
