"""The logit softcap of Gemma 2: every score pressed into (-c, c) by ``c * tanh(s / c)``."""

from __future__ import annotations

import numpy as np

from .._validate import require_positive_number
from ._entry import BenchSpec, CaseSpec, CliOption, Config, ScoreStep, Variant


def softcap(scores: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(scores / cap)``: every score pressed into (-cap, cap), nearly unchanged near 0."""
    return cap * np.tanh(scores / cap)


def softcap_vjp(scores: np.ndarray, cap: float, d_capped: np.ndarray) -> np.ndarray:
    """The scores' gradient of `softcap` for the cotangent ``d_capped``: ``d_capped * (1 - tanh(scores / cap)**2)``."""
    return d_capped * (1.0 - np.tanh(scores / cap) ** 2)


def _validate(cfg: Config) -> dict:
    return {"softcap": None if cfg.softcap is None else require_positive_number("softcap", cfg.softcap)}


ENTRY = Variant(
    name="softcap",
    summary="c * tanh(s / c) on the scaled scores",
    fields=("softcap",),
    is_on=lambda cfg: cfg.softcap is not None,
    validate=_validate,
    stages=("capped_scores",),
    score_step=ScoreStep("softcap", "softcap"),
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
    bench=BenchSpec({"softcap": 50.0}, "plain"),
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
)
