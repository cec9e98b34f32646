"""The logit softcap of Gemma 2: every score pressed into (-c, c) by ``c * tanh(s / c)``."""

from __future__ import annotations

import numpy as np

from .._validate import require_positive_number
from ._diagnose import GQA_ROTARY, DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import (
    BenchSpec,
    CaseSpec,
    Config,
    Explanation,
    OpsCall,
    ScoreStep,
    StageSpec,
    Variant,
    demo,
    numbers,
    value_option,
)
from ._shared import given, softmax_with_empty_rows, written_once


def softcap(scores: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(scores / cap)``: every score pressed into (-cap, cap), nearly unchanged near 0."""
    return cap * np.tanh(scores / cap)


def softcap_vjp(scores: np.ndarray, cap: float, d_capped: np.ndarray) -> np.ndarray:
    """The scores' gradient of `softcap` for the cotangent ``d_capped``: ``d_capped * (1 - tanh(scores / cap)**2)``."""
    return d_capped * (1.0 - np.tanh(scores / cap) ** 2)


def _forward(cfg: Config, scores: np.ndarray) -> np.ndarray:  # the registry's transform step (`ScoreStep`)
    return softcap(scores, cfg.softcap)


def _backward(cfg: Config, scores: np.ndarray, d_capped: np.ndarray) -> np.ndarray:
    return softcap_vjp(scores, cfg.softcap, d_capped)


def _validate(cfg: Config) -> dict:
    return {"softcap": None if cfg.softcap is None else require_positive_number("softcap", cfg.softcap)}


def explain(demo) -> Explanation:
    c = ENTRY.demo_on["softcap"]
    gemma = 50.0  # Gemma 2's attn_logit_softcapping
    scores = np.array([10.0, 50.0, 100.0])
    _, _, stages, _, _ = demo.run("softcap")
    blocked = ~np.isfinite(stages["masked_scores"])  # (B, H, N, N): the causal mask's
    capped_after = softcap(np.where(blocked, -np.inf, stages["scores"]), c)  # the mask first, then the cap
    leaked = softmax_with_empty_rows(capped_after)[blocked].max()
    return Explanation(
        "softcap=c",
        "s <- c * tanh(s / c)",
        "after the scale, before ALiBi / the relative bias and the mask",
        [
            (
                "Hugging Face config",
                f"attn_logit_softcapping = {gemma:g} (Gemma 2); final_logit_softcapping is the LM head's",
            ),
            (
                "Hugging Face config",
                "query_pre_attn_scalar (Gemma 2): the scale is query_pre_attn_scalar**-0.5, not d_k**-0.5",
            ),
            ("FlashAttention", "flash_attn_func(..., softcap=c)"),
            ("FlexAttention", "score_mod = lambda s, b, h, q, kv: c * torch.tanh(s / c)"),
            ("torch SDPA", "none: the scores are never exposed (transformers PR #32865 dropped Gemma 2's silently)"),
        ],
        [
            f"with c = {gemma:g}, scores {numbers(scores)} become {numbers(softcap(scores, gemma))}",
            f"capped after the mask, a blocked score becomes c*tanh(-inf) = {softcap(np.array(-np.inf), c):g} instead "
            f"of -inf: in the demonstration (c = {c:g}) a blocked key then takes up to {leaked:.3g} of a row",
        ],
    )


# -- diagnose: the cap moved after the mask, or dropped ------------------------------------------------------------
def _after_mask_fix(cfg: Config) -> str:
    c = f"{cfg.softcap:g}"
    return (
        f"cap the scores before any bias and the mask: s = {c} * tanh(s / {c}) right after the scale; capped after "
        f"the mask, a blocked score becomes -{c} and keeps the weight exp(-{c}) it should not have"
    )


def _dropped_fix(cfg: Config) -> str:
    c = f"{cfg.softcap:g}"
    return (
        f"apply s = {c} * tanh(s / {c}) after the scale, before any bias and the mask (Gemma 2's "
        "attn_logit_softcapping; SDPA has no softcap and dropped it silently, transformers PR #32865): "
        f"use eager attention, FlexAttention's score_mod or FlashAttention's softcap={c}"
    )


def _simulated_cap(cfg: Config, scores, mistake):  # neither mistake caps the scores here
    return scores if mistake is not None else softcap(scores, cfg.softcap)


def _simulated_after_mask(cfg: Config, masked, mistake):  # blocked scores become c * tanh(-inf) = -c
    return softcap(masked, cfg.softcap) if mistake == "after_mask" else masked


def _planted(idioms) -> PlantedSteps:
    """The candidates' cap, written apart from `softcap` (it tests the simulator), in ``idioms``' library."""

    def capped(cfg: Config, scores):
        return cfg.softcap * idioms.tanh(scores / cfg.softcap)

    def cap(cfg: Config, scores, mistake):
        return capped(cfg, scores) if mistake is None else scores

    def after_mask(cfg: Config, scores, mistake):
        return capped(cfg, scores) if mistake == "after_mask" else scores

    return PlantedSteps(transform=cap, masked=after_mask)


DIAGNOSE = DiagnoseSpec(
    rank=10,
    causes=(
        DiagnoseCause(
            "softcap", "after_mask", "applied after the mask (a blocked score becomes -c, not -inf)", _after_mask_fix
        ),
        DiagnoseCause("softcap", "dropped", "not applied (the scores are not capped)", _dropped_fix),
    ),
    mistakes=(
        PlantedMistake(
            "softcap after mask",
            "softcap",
            "masked_fill(-inf), then c * tanh(s / c): blocked scores become -c",
            "after_mask",
        ),
        PlantedMistake(
            "softcap dropped", "softcap", "scores never capped (SDPA with Gemma 2's attn_logit_softcapping)", "dropped"
        ),
    ),
    # Gemma 2's: softcap, causal window of 3, a scale of its own, GQA, rotary; d_k = 6.
    settings=(("softcap-window", dict(GQA_ROTARY, window=3, softcap=1.5, scale=0.3, bias=False)),),
    simulated=SimulatedSteps(transform=_simulated_cap, masked=_simulated_after_mask),
    **written_once(_planted),
)


ENTRY = Variant(
    name="softcap",
    summary="c * tanh(s / c) on the scaled scores",
    **given("softcap"),
    validate=_validate,
    stage_specs=(
        StageSpec("softcap", "capped_scores", "softcap * tanh(scores / softcap); only with softcap", after="scores"),
    ),
    score_step=ScoreStep(
        "transform",
        "softcap",
        call=OpsCall(
            "capped_scores",
            "c * tanh(s / c)",
            forward=lambda ops, cfg, scores, parts: ops.softcap(scores, cfg.softcap),
            backward=lambda ops, cfg, d_capped, scores: ops.softcap_backward(d_capped, scores, cfg.softcap),
            saves_input=True,
        ),
    ),
    # A fused kernel takes the cap only where it hands the scores to a hook (FlexAttention's score_mod, ONNX's
    # softcap attribute); an additive mask cannot carry a tanh.
    kernel_refusal="{kernel} has no softcap: the scores are never exposed between the product and the softmax",
    forward=_forward,
    backward=_backward,
    check_cases=(
        CaseSpec(
            "softcap",
            "logit softcap c = 1.5: scores become 1.5 tanh(s / 1.5), so the larger ones are pressed down",
            dict(d_model=18, n_heads=3, softcap=1.5),  # d_k = 6
            dict(dtypes=("float64", "float32"), seed=22),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "softcap",
            "softcap 1.5 on the scores",
            dict(d_model=18, n_heads=3, d_k=6, rope="half", causal=True, softcap=1.5),
            dict(tokens=8, prefill=3, seed=111),
        ),
    ),
    bench=BenchSpec({"softcap": 50.0}, "plain"),  # Gemma 2's attn_logit_softcapping
    cli=(value_option("--softcap", "softcap", "logit softcap c: scores become c * tanh(s / c)", rank=20, type=float),),
    **demo("softcap", 2.0, None),
    explain=explain,
    diagnose=DIAGNOSE,
)
