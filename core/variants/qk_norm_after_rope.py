"""Llama 4's QK-norm: a weightless RMSNorm of each head's queries and keys AFTER rotary (``qk_norm_after_rope``).

``Llama4TextAttention`` (transformers 5.25) applies ``Llama4TextWeightlessRMSNorm(rms_norm_eps)``
(``x * rsqrt(mean(x**2) + eps)``, no learned weight; alias ``Llama4TextL2Norm``) to q and k after
``apply_rotary_emb``, on its rotary layers only (``use_qk_norm`` and ``no_rope_layers[i] == 1``). Qwen3 and
OLMo 2 norm before rotary, with a weight (`qk_norm`). The stages are ``q_rotated_normed`` and
``k_rotated_normed``, after ``q_rotated``/``k_rotated``; the cache holds the normed, rotated keys.

What diagnose names (`DIAGNOSE`): the norm taken across the heads (over each token's whole projection, as a
tensor-parallel shard's did: vllm #16311) and the norm forgotten. The norm moved before rotary is no mistake an
output can show: rotary turns each pair of features by an angle, which keeps each head's sum of squares (partial
rotary too), so a weightless per-head norm gives the same numbers before or after it, up to rounding.
"""

from __future__ import annotations

import math

import numpy as np

from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import (
    BenchSpec,
    CaseSpec,
    Config,
    ConfigField,
    Explanation,
    StageSpec,
    Variant,
    numbers,
    switch_option,
)
from ._shared import OUR_ADAPTERS, rms_norm, rms_norm_vjp

# Llama 4's rotary layer at a small size: GQA, interleaved rotary, chunks, the weightless norm after rotary.
LLAMA4_ROPE_LIKE = dict(
    d_model=24,
    n_heads=4,
    n_kv_heads=2,
    rope="interleaved",
    causal=True,
    bias=False,
    attention_chunk_size=4,
    norm_eps=1e-5,
    qk_norm_after_rope=True,
)


# -- Llama 4: a weightless RMSNorm per head AFTER rotary ----------------------------------------------------------
AFTER_ROPE = "qk_norm_after_rope"


def _validate_after_rope(cfg: Config) -> dict:
    on = getattr(cfg, AFTER_ROPE)
    if not isinstance(on, bool):
        raise TypeError(f"MHAConfig.{AFTER_ROPE} must be a bool, got {on!r} ({type(on).__name__})")
    if on and cfg.rope is None:
        raise ValueError(
            f"MHAConfig.{AFTER_ROPE}=True normalises each head after rotary (Llama 4's rotary layers; its NoPE "
            "layers have no QK-norm), so it needs rope='half' or 'interleaved', got rope=None"
        )
    return {}


def norm_after_rope(cfg: Config, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotated q (B, H, Nq, Dk) and k (B, Hkv, Nk, Dk), each head's features RMS-normed, no weight."""
    return rms_norm(q, 1.0, cfg.norm_eps), rms_norm(k, 1.0, cfg.norm_eps)


def norm_after_rope_vjp(cfg: Config, q, k, d_q, d_k) -> tuple[np.ndarray, np.ndarray]:
    """The cotangents of `norm_after_rope`'s inputs (RMSNorm's backward with weight 1; nothing learned)."""
    return rms_norm_vjp(q, 1.0, cfg.norm_eps, d_q)[0], rms_norm_vjp(k, 1.0, cfg.norm_eps, d_k)[0]


# -- diagnose: the norm across the heads instead of per head (vllm #16311), or forgotten --------------------------
def _across_heads(x: np.ndarray, eps: float) -> np.ndarray:
    """(B, n, N, d) RMS-normed over each token's n*d features together, no weight (a new array)."""
    return x / np.sqrt(np.mean(x * x, axis=(1, 3), keepdims=True) + eps)  # the mean over heads and features


def _simulated(cfg: Config, p, q, k, positions, mistake):
    """Diagnose's simulator: the spec's per-head norm, across the heads (``"across_heads"``) or none (``"dropped"``)."""
    if mistake == "dropped":
        return q, k
    if mistake == "across_heads":
        return _across_heads(q, cfg.norm_eps), _across_heads(k, cfg.norm_eps)
    return norm_after_rope(cfg, q, k)


def _planted(cfg: Config, params, q, k, mistake):
    """The NumPy candidate's ``Llama4TextL2Norm`` (``x * rsqrt(mean(x**2, -1) + eps)``) on the rotated heads."""
    if mistake == "dropped":
        return q, k

    def l2_norm(x):
        if mistake != "across_heads":
            return x * (1.0 / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.norm_eps))
        B, n, N, d = x.shape
        flat = x.transpose(0, 2, 1, 3).reshape(B, N, n * d)  # (B, N, n*d) copy: a token's whole projection
        flat = flat * (1.0 / np.sqrt((flat**2).mean(-1, keepdims=True) + cfg.norm_eps))
        return flat.reshape(B, N, n, d).transpose(0, 2, 1, 3)  # (B, n, N, d) view

    return l2_norm(q), l2_norm(k)


_FIX = (
    "normalise each head's d_k features on their own, after rotary and with no weight (Llama4TextL2Norm on "
    "q.view(B, N, H, d) and k.view(B, N, Hkv, d); core.variants.norm_after_rope)"
)
DIAGNOSE = DiagnoseSpec(
    rank=75,  # with the forms of 2025-26, before a variant registered from outside at 80
    causes=(
        DiagnoseCause(
            AFTER_ROPE,
            "across_heads",
            "the QK-norm across the heads: each token's whole projection (H*d_k features) normed at once where "
            "Llama 4 norms each head (vllm #16311)",
            _FIX,
            when=lambda cfg: cfg.n_heads > 1,
        ),
        DiagnoseCause(AFTER_ROPE, "dropped", "the QK-norm after rotary forgotten: q and k unnormed", _FIX),
    ),
    mistakes=(
        PlantedMistake(
            "qk-norm after rope across heads",
            AFTER_ROPE,
            "the weightless norm over q.view(B, N, H*d) (a shard's whole projection)",
            "across_heads",
            runs=lambda cfg, q_tokens: cfg.n_heads > 1,
        ),
        PlantedMistake("qk-norm after rope forgotten", AFTER_ROPE, "q and k scored unnormed", "dropped"),
    ),
    settings=(("llama4-rope", LLAMA4_ROPE_LIKE),),
    simulated=SimulatedSteps(rotated=_simulated),
    planted=PlantedSteps(rotated=_planted),
    weightless_qk_norm=True,
)


def _explain_after_rope(demo) -> Explanation:
    on, _, stages, _, _ = demo.run(AFTER_ROPE)
    q_rot = stages["q_rotated"][0, :, 0]  # token 0, (H, Dk)
    rms_heads = np.sqrt(np.mean(q_rot**2, axis=-1) + on.norm_eps)  # (H,)
    whole = math.sqrt(float(np.mean(q_rot**2)) + on.norm_eps)
    normed = stages["q_rotated_normed"][0, :, 0]  # (H, Dk)
    return Explanation(
        f"{AFTER_ROPE}=True, norm_eps (= rms_norm_eps; rope on)",
        "q_h <- q_h / sqrt(mean_d(q_h**2) + eps) after rotary, no weight; k the same",
        "after rotary, before the scores (Llama 4's rotary layers)",
        [
            (
                "Hugging Face",
                "Llama4TextAttention.qk_norm = Llama4TextWeightlessRMSNorm(rms_norm_eps) (alias Llama4TextL2Norm) "
                "when use_qk_norm, on rotary layers",
            ),
            ("Hugging Face", "its order: apply_rotary_emb, then qk_norm (Qwen3 and OLMo 2 norm first)"),
        ],
        [
            f"per head: the RMS of token 0's rotated query heads is {numbers(rms_heads, 3)}, of all heads together "
            f"{whole:.3g}: normalising across heads (vllm #16311, tensor parallel) scales each head by their ratio",
            f"each normed head has RMS 1 (token 0: {numbers(np.sqrt(np.mean(normed**2, axis=-1)), 4)}); rotation keeps "
            "the norm of each pair, so before rotary the same weightless norm would give the same numbers in exact "
            "arithmetic (partial rotary too): the order matters with a learned weight (Qwen3's) and in rounding",
        ],
    )


ENTRY = Variant(
    name=AFTER_ROPE,
    summary="Llama 4: a weightless RMSNorm of each head's queries and keys after rotary",
    fields=(AFTER_ROPE, "norm_eps"),
    config_fields=(ConfigField(AFTER_ROPE, False, "bool"),),
    is_on=lambda cfg: bool(getattr(cfg, AFTER_ROPE)),
    validate=_validate_after_rope,
    # After rotary; the backward's normed stages come right before d_q_rotated (after the temperature's).
    stage_specs=(
        StageSpec(
            "qk-norm after rotary",
            "q_rotated_normed",
            "q_rotated with each head RMS-normed, no weight (Llama 4); only with qk_norm_after_rope",
            after="k_rotated",
            like="q_rotated",
            grad_before="q_rotated",
        ),
        StageSpec(
            "qk-norm after rotary",
            "k_rotated_normed",
            "k_rotated normed the same way",
            after="q_rotated_normed",
            like="k_rotated",
            grad_before="q_rotated",
        ),
    ),
    forward=norm_after_rope,
    backward=norm_after_rope_vjp,
    implemented_by=OUR_ADAPTERS,  # through their ops object's `frameworks.ops.after_rotary`
    check_cases=(
        CaseSpec(
            AFTER_ROPE,
            "Llama 4's rotary layer: interleaved rotary, then a weightless RMSNorm per head; chunks of 4",
            LLAMA4_ROPE_LIKE,
            dict(q_tokens=7, dtypes=("float64", "float32"), seed=66),
        ),
    ),
    decode_cases=(
        CaseSpec(
            AFTER_ROPE,
            "the norm after rotary across steps: the cache holds each key rotated at its position, then normed",
            LLAMA4_ROPE_LIKE,
            dict(tokens=9, prefill=3, step=2, seed=67),
        ),
    ),
    bench=BenchSpec({"causal": True, "rope": "interleaved", AFTER_ROPE: True}, "causal", preset="forms"),
    cli=(
        switch_option("--qk-norm-after-rope", {AFTER_ROPE: True}, "Llama 4's weightless QK-norm after rotary", rank=32),
    ),
    demo_on={AFTER_ROPE: True},
    demo_off={AFTER_ROPE: False},
    explain=_explain_after_rope,
    diagnose=DIAGNOSE,
)
