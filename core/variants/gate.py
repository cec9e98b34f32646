"""Gated attention (Qwen3-Next, Qwen 3.5): each head's context times ``sigmoid(gate)`` before the output projection.

``Qwen3NextAttention``'s ``q_proj`` gives each head ``2 * head_dim`` features, ``[q_h | gate_h]``::

    q, gate = chunk(q_proj(x).view(..., n_heads, 2 * head_dim), 2, dim=-1)
    out = o_proj(merged_context * sigmoid(gate.reshape(..., n_heads * head_dim)))

The spec keeps the two halves apart: ``w_q`` (H*Dk, D) as ever and ``w_gate`` (H*Dk, D) (``b_gate`` with
q's bias), so the gate's stage is ``gate = sigmoid(x_q @ w_gate.T + b_gate)`` (B, Nq, H*Dv) and the output
``(merged * gate) @ w_o.T + b_o``. `split_gated_q` and `fuse_gated_q` convert between the fused,
per-head interleaved ``q_proj`` rows and the spec's two weights: reading the gate as the second half of
the whole projection (``q, gate = q_proj(x).chunk(2, -1)``) is the bug on record (vllm #36242,
Megatron-Bridge #1694). The gate multiplies the context, whose head is ``d_v`` wide, and comes from the
``2 * d_k`` features of a query head: it fits only with ``d_v == d_k`` (`_validate`).

Qwen3-Next's other parts are the spec's already: QK-norm per head (``qk_norm="head"``; its stored weights
are offsets, load ``1 + w``), partial rotate-half rotary (``rope_dims = int(d_k * partial_rotary_factor)``,
frequencies ``base ** (-2i / rope_dims)``).

``transformers`` 5.25's ``Qwen3NextConfig`` has no switch (its attention layers are always gated); the field
is ``attn_output_gate`` as Qwen 3.5's configuration and vLLM's reader name it.
"""

from __future__ import annotations

import numpy as np

from .._validate import require_bool
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, Explanation, ParamSpec, StageSpec, Variant, numbers, switch_option
from ._shared import flag, resolved_head_dims

FIELD = "attn_output_gate"
# Why a third-party kernel's oracle refuses the gate ("{kernel}": its name): what it compares is the kernel.
KERNEL_REFUSAL = (
    "{kernel} has no output gate: Qwen3-Next multiplies the merged heads by sigmoid(x @ w_gate.T) after the kernel, "
    "in model code before o_proj, so the kernel has nothing of it to compare (our adapters apply it)"
)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` without overflow for large negative ``x`` (a new array)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def gate_forward(x_q: np.ndarray, w_gate: np.ndarray, b_gate: np.ndarray | None) -> np.ndarray:
    """The gate stage ``sigmoid(x_q @ w_gate.T + b_gate)``: (B, Nq, D) -> (B, Nq, H*Dv)."""
    logits = x_q @ w_gate.T
    return sigmoid(logits if b_gate is None else logits + b_gate)


def gate_backward(x_q, w_gate, gate, d_gate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d_x_q, d_w_gate, d_b_gate) of `gate_forward` for the cotangent ``d_gate`` of its output ``gate``.

    ``sigmoid' = g (1 - g)``: ``d_logits = d_gate * g * (1 - g)``; then the linear layer's backward.
    """
    d_logits = d_gate * gate * (1.0 - gate)  # (B, Nq, H*Dv)
    return d_logits @ w_gate, np.einsum("bno,bni->oi", d_logits, x_q), d_logits.sum(axis=(0, 1))


def split_gated_q(fused: np.ndarray, n_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(w_q, w_gate) from Qwen3-Next's ``q_proj`` rows (H*2*d, ...) (a weight or a bias): head h's [q_h | gate_h]."""
    per_head = fused.reshape(n_heads, 2, head_dim, *fused.shape[1:])  # (H, 2, d, ...) view: [q_h | gate_h]
    rest = fused.shape[1:]
    return per_head[:, 0].reshape(n_heads * head_dim, *rest), per_head[:, 1].reshape(n_heads * head_dim, *rest)


def fuse_gated_q(w_q: np.ndarray, w_gate: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """The inverse of `split_gated_q`: Qwen3-Next's ``q_proj`` rows, each head's q then its gate (a copy)."""
    rest = w_q.shape[1:]
    q = w_q.reshape(n_heads, 1, head_dim, *rest)  # (H, 1, d, ...) view
    g = w_gate.reshape(n_heads, 1, head_dim, *rest)  # (H, 1, d, ...) view
    return np.concatenate([q, g], axis=1).reshape(n_heads * 2 * head_dim, *rest)  # (H*2*d, ...) copy


# -- diagnose: the gate forgotten, or read from the second half of the whole q_proj (vllm #36242) -----------------
def _as_read(cfg: Config, p: dict, mistake) -> dict:
    """The parameters by name as a candidate reads them: with ``"halves"``, q and the gate from q_proj's two halves."""
    if mistake != "halves":
        return p
    half = cfg.n_heads * cfg.d_k
    read = dict(p)
    for w, g in (("w_q", "w_gate"), ("b_q", "b_gate")):
        if p.get(g) is not None:
            fused = fuse_gated_q(p[w], p[g], cfg.n_heads, cfg.d_k)  # what Qwen3NextAttention stores
            read[w], read[g] = fused[:half], fused[half:]  # the mistake: chunk(2) of the whole projection
    return read


def _gated(cfg: Config, p, query, merged, mistake):
    """What w_o reads: ``merged * sigmoid(query @ w_gate.T + b_gate)``; ``merged`` itself when the gate is forgotten."""
    if mistake == "dropped":
        return merged
    return merged * gate_forward(query, p.w_gate, p.b_gate)


CAUSES = (
    DiagnoseCause(
        "gate",
        "dropped",
        "the output gate forgotten: the merged context goes to w_o without the sigmoid(x @ w_gate.T) factor",
        "multiply the merged context by sigmoid(x @ w_gate.T + b_gate) before o_proj (Qwen3NextAttention)",
    ),
    DiagnoseCause(
        "gate",
        "halves",
        "the gate read as the second half of the whole q_proj (q, gate = q_proj(x).chunk(2, -1)), where each head's "
        "2*d_k features are [q_h | gate_h]",
        "split per head: q_proj(x).view(..., n_heads, 2 * head_dim).chunk(2, -1) (core.variants.split_gated_q)",
        when=lambda cfg: cfg.n_heads > 1,
    ),
)


def _regroup(cfg: Config, params, order) -> dict:
    """The gate's rows of the query heads reordered by ``order`` (they move with their heads' columns of w_o)."""
    H, Dv = cfg.n_heads, cfg.d_v
    w_gate = params.w_gate.reshape(H, Dv, -1)[order].reshape(H * Dv, -1)  # (H, Dv, D) rows regrouped, copy
    b_gate = None if params.b_gate is None else params.b_gate.reshape(H, Dv)[order].reshape(H * Dv)
    return {"w_gate": w_gate, "b_gate": b_gate}


def _validate(cfg: Config) -> dict:
    gated = getattr(cfg, FIELD)
    require_bool(FIELD, gated)
    d_k, d_v = resolved_head_dims(cfg)
    if gated and d_v != d_k:
        raise ValueError(
            f"MHAConfig.{FIELD}=True needs d_v == d_k: the gate is the second half of each query head's "
            f"[q | gate] (2*d_k features) and multiplies that head's context (d_v features); got d_k={d_k}, d_v={d_v}"
        )
    return {}


def _gate_shape(cfg: Config) -> tuple[int, ...] | None:
    return (cfg.n_heads * cfg.d_k, cfg.d_model) if getattr(cfg, FIELD) else None


def _gate_bias_shape(cfg: Config) -> tuple[int, ...] | None:
    return (cfg.n_heads * cfg.d_k,) if getattr(cfg, FIELD) and cfg.qkv_bias else None


# w_gate N(0, 0.2^2): gate logits of spread about 1 at the cases' widths (d_model 16-32), so the sigmoid is
# neither saturated nor flat and a dropped or misread gate shows. b_gate like the other biases.
PARAMS = (
    ParamSpec("w_gate", FIELD, _gate_shape, centre=0.0, spread=0.2),
    ParamSpec("b_gate", FIELD, _gate_bias_shape, centre=0.0, spread=0.1),
)
STAGE = StageSpec(
    "output gate",
    "gate",
    "sigmoid(x_q @ w_gate.T + b_gate) (attn_output_gate): merged * gate is what w_o reads",
    after="merged",
    like="merged",
)
# Qwen3-Next's attention layer at a small size: GQA, per-head QK-norm, rotate-half on the first quarter.
QWEN3_NEXT_LIKE = dict(
    d_model=32, n_heads=4, n_kv_heads=2, d_k=8, rope="half", rope_dims=2, causal=True, qk_norm="head", bias=False
)


def explain(demo) -> Explanation:
    on, _, stages, _, _ = demo.run("gate")
    gate = stages["gate"][0, 0]  # token 0, (H*Dv,)
    H, Dk = on.n_heads, on.d_k
    return Explanation(
        f"{FIELD}=True (d_v == d_k)",
        "gate = sigmoid(x @ w_gate.T + b_gate); out = (merged * gate) @ w_o.T + b_o",
        "after the heads are merged, before the output projection",
        [
            ("Hugging Face", "Qwen3NextAttention: q_proj (H*2*d, D) -> view(..., H, 2*d).chunk(2): [q_h | gate_h]"),
            ("spec", "w_q, w_gate = split_gated_q(q_proj.weight, H, d) (core.variants.gate)"),
        ],
        [
            f"the gate is interleaved per head: for the demonstration (H={H}, d={Dk}) its row r of w_gate is "
            f"row (r // d) * 2d + d + r % d of q_proj, not row H*d + r: chunking the whole projection in two "
            f"reads query rows as gates (vllm #36242)",
            f"the gate of token 0's first head is {numbers(gate[:Dk], 3)}: each a factor in (0, 1)",
        ],
    )


ENTRY = Variant(
    name="gate",
    summary="each head's context times sigmoid(x @ w_gate.T) before the output projection (Qwen3-Next)",
    **flag(FIELD),
    validate=_validate,
    params=PARAMS,
    stage_specs=(STAGE,),
    forward=gate_forward,
    backward=gate_backward,
    diagnose=DiagnoseSpec(
        rank=75,  # after T5 (70), before a variant registered from outside at 80 (tests/test_diagnose_registry.py)
        causes=CAUSES,
        # The candidates plant the forgotten gate; they are given the spec's w_gate apart from w_q, so the halves
        # are a hypothesis only (`tests/test_gate.py` diagnoses a candidate that chunks the fused q_proj).
        mistakes=(PlantedMistake("gate forgotten", "gate", "merged @ w_o.T with no sigmoid(gate) factor", "dropped"),),
        settings=(("qwen3-next-gate", dict(QWEN3_NEXT_LIKE, attn_output_gate=True)),),
        simulated=SimulatedSteps(params=_as_read, output=_gated),
        planted=PlantedSteps(output=_gated),
        regroup_heads=_regroup,
    ),
    # Every adapter applies it (implemented_by None): NumPy, torch, JAX and MLX through their ops object's
    # `output_gate`, einops on all three, the sharded backends on their heads' rows, the onnx graph after its
    # Attention node. The kernels' oracles (SDPA, flex, jax-dpa, MLX SDPA, HF) and the best paths leave it out of
    # what they claim and refuse it with their reason (`KERNEL_REFUSAL`).
    check_cases=(
        CaseSpec(
            "gate",
            "Qwen3-Next: each head's context times sigmoid(gate) before o_proj; QK-norm, partial rotary",
            dict(QWEN3_NEXT_LIKE, attn_output_gate=True),
            dict(q_tokens=6, dtypes=("float64",), seed=60),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "gate",
            "Qwen3-Next's gate: each step's new tokens gated by their own sigmoid(x @ w_gate.T); nothing cached for it",
            dict(QWEN3_NEXT_LIKE, attn_output_gate=True),
            dict(tokens=7, prefill=3, seed=160),
        ),
    ),
    # Its cost against plain attention: one more (D, H*Dv) projection, a sigmoid and a product, timed in every
    # adapter; the best paths refuse it (the cell says so).
    bench=BenchSpec({FIELD: True}, "plain"),
    cli=(
        switch_option(
            "--attn-output-gate", {FIELD: True}, "Qwen3-Next's output gate: context * sigmoid(x @ w_gate.T)", rank=34
        ),
    ),
    explain=explain,
    kernel_refusal=KERNEL_REFUSAL,
)
