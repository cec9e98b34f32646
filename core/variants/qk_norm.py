"""QK-norm: RMSNorm of the queries and keys before rotary, over each head (Qwen3, Gemma 3) or over the
whole projection before the head split (OLMo 2). Two variants, one formula: ``qk_norm_head`` and
``qk_norm_projection``.
"""

from __future__ import annotations

import numpy as np

from .._validate import require_positive_number
from ._entry import BenchSpec, CaseSpec, CliOption, Config, ParamSpec, Variant

# Where QK-norm takes its statistics (`rms_norm`): over each head's d_k features
# with one (d_k,) weight (Qwen3, Gemma 3), or over the whole projection before the head split
# with (n_heads*d_k,) / (n_kv_heads*d_k,) weights (OLMo 2).
QK_NORMS = ("head", "projection")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2, last axis) + eps) * weight``: RMSNorm over the last axis (a new array)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rms_norm_vjp(x: np.ndarray, weight: np.ndarray, eps: float, d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d_x, d_weight summed over every leading axis) of `rms_norm` for the cotangent ``d_y``.

    With ``r = (mean(x**2) + eps) ** -1/2`` and ``g = d_y * weight``:
    ``d_x = r g - x r**3 mean(g x)`` (the mean over the normalised axis), ``d_weight = sum(d_y x r)``.
    """
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = d_y * weight
    d_x = r * g - x * r**3 * np.mean(g * x, axis=-1, keepdims=True)
    d_weight = (d_y * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return d_x, d_weight


def _validate(cfg: Config) -> dict:
    if cfg.qk_norm is not None and cfg.qk_norm not in QK_NORMS:
        raise ValueError(
            f"MHAConfig.qk_norm must be None or one of {', '.join(map(repr, QK_NORMS))}, got {cfg.qk_norm!r}"
        )
    return {"norm_eps": require_positive_number("norm_eps", cfg.norm_eps)}


def _norm_shape(side: str):
    """The shape of ``q_norm`` (side "q") or ``k_norm`` ("k"): (d_k,) per head, the projection's width otherwise."""

    def shape(cfg: Config) -> tuple[int, ...] | None:
        if cfg.qk_norm is None:
            return None
        return (cfg.d_k,) if cfg.qk_norm == "head" else ((cfg.q_width,) if side == "q" else (cfg.k_width,))

    return shape


# Weights 1 + 0.3 N(0, 1): not all one, so that a dropped weight shows.
PARAMS = (
    ParamSpec("q_norm", "qk_norm", _norm_shape("q"), centre=1.0, spread=0.3),
    ParamSpec("k_norm", "qk_norm", _norm_shape("k"), centre=1.0, spread=0.3),
)
STAGES = ("q_normed", "k_normed")
_OPTIONS = (
    CliOption(
        "--qk-norm",
        dict(choices=QK_NORMS, help="RMSNorm of q and k: per head or projection"),
        lambda value: {"qk_norm": value},
        rank=30,
    ),
    CliOption(
        "--norm-eps",
        dict(type=float, help="the QK-norm's epsilon (default 1e-6)"),
        lambda value: {"norm_eps": value},
        needs="--qk-norm",
        rank=31,
    ),
)
# Qwen3's layer: the check case and the decode case read the same configuration.
QWEN3_LIKE = dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=8, rope="half", causal=True, qk_norm="head", bias=False)

HEAD = Variant(
    name="qk_norm_head",
    summary="RMSNorm of each head's queries and keys",
    fields=("qk_norm", "norm_eps"),
    is_on=lambda cfg: cfg.qk_norm == "head",
    validate=_validate,
    params=PARAMS,
    stages=STAGES,
    forward=rms_norm,
    backward=rms_norm_vjp,
    check_cases=(
        CaseSpec(
            "qk_norm_head",
            "Qwen3: RMSNorm of each head's queries and keys (one weight of d_k per side), before rotary",
            QWEN3_LIKE,
            dict(q_tokens=6, dtypes=("float64", "bfloat16"), seed=23),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "qk_norm_head",
            "RMSNorm of each head's queries and keys before rotary (the cache holds normed, rotated keys)",
            QWEN3_LIKE,
            dict(tokens=8, prefill=3, seed=112),
        ),
    ),
    bench=BenchSpec({"qk_norm": "head"}, "plain"),
    cli=_OPTIONS,  # one option for both: its value picks the variant
    demo_on={"qk_norm": "head"},
    demo_off={"qk_norm": None},
)

PROJECTION = Variant(
    name="qk_norm_projection",
    summary="RMSNorm over the whole q and k projections",
    fields=("qk_norm", "norm_eps"),
    is_on=lambda cfg: cfg.qk_norm == "projection",
    validate=_validate,
    params=PARAMS,
    stages=STAGES,
    forward=rms_norm,
    backward=rms_norm_vjp,
    check_cases=(
        CaseSpec(
            "qk_norm_projection",
            "OLMo 2: RMSNorm over the whole q and k projections (before the head split)",
            dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=8, rope="half", causal=True, qk_norm="projection"),
            dict(q_tokens=6, dtypes=("float64", "float32"), seed=24),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "qk_norm_projection",
            "RMSNorm over the whole q and k projections (OLMo 2), GQA and rotary",
            dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=10, rope="half", causal=True, qk_norm="projection"),
            dict(tokens=7, prefill=2, seed=113),
        ),
    ),
    bench=BenchSpec({"qk_norm": "projection"}, "plain"),
    demo_on={"qk_norm": "projection"},
    demo_off={"qk_norm": None},
)
