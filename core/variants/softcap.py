"""The logit softcap of Gemma 2: every score pressed into (-c, c) by ``c * tanh(s / c)``."""

from __future__ import annotations

import numpy as np

from .._validate import require_positive_number
from ._entry import BenchSpec, CaseSpec, CliOption, Config, Explanation, ScoreStep, Variant, numbers
from ._shared import softmax_with_empty_rows


def softcap(scores: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(scores / cap)``: every score pressed into (-cap, cap), nearly unchanged near 0."""
    return cap * np.tanh(scores / cap)


def softcap_vjp(scores: np.ndarray, cap: float, d_capped: np.ndarray) -> np.ndarray:
    """The scores' gradient of `softcap` for the cotangent ``d_capped``: ``d_capped * (1 - tanh(scores / cap)**2)``."""
    return d_capped * (1.0 - np.tanh(scores / cap) ** 2)


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


ENTRY = Variant(
    name="softcap",
    summary="c * tanh(s / c) on the scaled scores",
    fields=("softcap",),
    is_on=lambda cfg: cfg.softcap is not None,
    validate=_validate,
    stages=("capped_scores",),
    score_step=ScoreStep("transform", "softcap"),
    forward=softcap,
    backward=softcap_vjp,
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
    cli=(
        CliOption(
            "--softcap",
            dict(type=float, help="logit softcap c: scores become c * tanh(s / c)"),
            lambda value: {"softcap": value},
            rank=20,
        ),
    ),
    demo_on={"softcap": 2.0},
    demo_off={"softcap": None},
    explain=explain,
)
