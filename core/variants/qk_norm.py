"""QK-norm: RMSNorm of the queries and keys before rotary, over each head (Qwen3, Gemma 3) or over the
whole projection before the head split (OLMo 2). Two variants, one formula: ``qk_norm_head`` and
``qk_norm_projection``. Llama 4's weightless norm after rotary is `qk_norm_after_rope`'s.
"""

from __future__ import annotations

import math

import numpy as np

from .._validate import require_positive_number
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import (
    BenchSpec,
    CaseSpec,
    CliOption,
    Config,
    Explanation,
    NormStep,
    ParamSpec,
    StageSpec,
    Variant,
    numbers,
    value_option,
)
from ._shared import rms_norm, rms_norm_vjp, written_once
from .models import MODELS

# Where QK-norm takes its statistics (`rms_norm`): over each head's d_k features
# with one (d_k,) weight (Qwen3, Gemma 3), or over the whole projection before the head split
# with (n_heads*d_k,) / (n_kv_heads*d_k,) weights (OLMo 2).
QK_NORMS = ("head", "projection")


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


# What the normed stages hold, in words (a recording's note; `NormStep.how`).
NORM_HOW = {
    "head": "RMSNorm over each head's Dk features (one weight for every head)",
    "projection": "RMSNorm over the whole projection, before the head split",
}

# Weights 1 + 0.3 N(0, 1): not all one, so that a dropped weight shows.
PARAMS = (
    ParamSpec("q_norm", "qk_norm", _norm_shape("q"), centre=1.0, spread=0.3),
    ParamSpec("k_norm", "qk_norm", _norm_shape("k"), centre=1.0, spread=0.3),
)
# Between the head split and rotary; the backward's normed stages come right before d_q_heads (after rotary's).
STAGE_SPECS = (
    StageSpec(
        "qk-norm",
        "q_normed",
        "q_heads after RMSNorm (over each head, or over the whole projection before the split); only with qk_norm",
        after="v_heads",
        like="q_heads",
        grad_before="q_heads",
    ),
    StageSpec(
        "qk-norm",
        "k_normed",
        "k_heads after RMSNorm; only with qk_norm",
        after="q_normed",
        like="k_heads",
        grad_before="q_heads",
    ),
)
_OPTIONS = (
    value_option("--qk-norm", "qk_norm", "RMSNorm of q and k: per head or projection", rank=30, choices=QK_NORMS),
    value_option("--norm-eps", "norm_eps", "the norms' epsilon (default 1e-6)", rank=31, needs="--qk-norm", type=float),
)
# Qwen3's layer: the check case and the decode case read the same configuration.
QWEN3_LIKE = dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=8, rope="half", causal=True, qk_norm="head", bias=False)


def _explainer(place: str):
    def explain(demo) -> Explanation:
        on, _, stages, _, _ = demo.run(f"qk_norm_{place}")
        q = stages["q"][0, 0]  # token 0, (H*Dk,)
        per_head = np.sqrt(np.mean(q.reshape(on.n_heads, on.d_k) ** 2, axis=-1) + on.norm_eps)  # (H,)
        whole = math.sqrt(float(np.mean(q**2)) + on.norm_eps)
        spellings = {
            "head": [
                ("Hugging Face", "Qwen3 / Gemma 3: self_attn.q_norm, k_norm = RMSNorm(head_dim), weight (head_dim,)"),
                ("Hugging Face", "Gemma 3's RMSNorm multiplies by (1 + weight): load weight + 1 as the spec's q_norm"),
            ],
            "projection": [
                ("Hugging Face", "OLMo 2: self_attn.q_norm (n_heads*head_dim,), k_norm (n_kv_heads*head_dim,)"),
            ],
        }[place]
        where = {"head": "after the head split, before rotary", "projection": "before the head split (then rotary)"}
        formula = {
            "head": "q_h <- q_h / sqrt(mean_d(q_h**2) + eps) * w, one w (d_k,) for every head; k the same",
            "projection": "q <- q / sqrt(mean(q**2 over all H*d_k) + eps) * w, w (H*d_k,); k over Hkv*d_k",
        }
        return Explanation(
            f"qk_norm={place!r}, norm_eps",
            formula[place],
            where[place],
            spellings,
            [
                f"head and projection take different statistics: for token 0 of the demonstration the RMS of each "
                f"head is {numbers(per_head, 3)}, of the whole projection {whole:.3g}: taking one for the other scales "
                "each head by their ratio (Qwen3 and OLMo 2 differ exactly there)",
            ],
        )

    return explain


# -- diagnose: the norm taken over the other place (each head's features, or the whole projection) ------------------
_WHERE = {
    "head": "over each head's d_k features after the head split, one (d_k,) weight for every head (Qwen3, Gemma 3)",
    "projection": "over all n_heads*d_k (n_kv_heads*d_k for keys) features before the head split (OLMo 2)",
}


def _other(place: str) -> str:
    return "head" if place == "projection" else "projection"


def _cause(place: str) -> DiagnoseCause:
    """The cause of a candidate that normalises over the other place than ``place``, the spec's."""
    other = _other(place)
    return DiagnoseCause(
        "qk_norm",
        other,  # the place the candidate normalises at
        f"over the {other} where the spec normalises over the {place}",
        f"take the RMSNorm {_WHERE[place]}, not {_WHERE[other]}",
    )


def _simulated_projection(cfg: Config, p, q, k, mistake):
    """q (B, Nq, H*Dk), k (B, Nk, Hkv*Dk) after a projection RMSNorm, if the simulated candidate takes one there."""
    if (mistake or cfg.qk_norm) != "projection":
        return q, k
    w_q, w_k = p.q_norm, p.k_norm
    if cfg.qk_norm == "head":  # the mistake: the one (d_k,) weight tiled over the heads
        w_q, w_k = np.tile(w_q, cfg.n_heads), np.tile(w_k, cfg.n_kv_heads)  # (H*Dk,), (Hkv*Dk,)
    return rms_norm(q, w_q, cfg.norm_eps), rms_norm(k, w_k, cfg.norm_eps)


def _simulated_heads(cfg: Config, p, q_h, k_h, mistake):
    """q_h (B, H, Nq, Dk), k_h (B, Hkv, Nk, Dk) after a per-head RMSNorm, if the simulated candidate takes one there."""
    if (mistake or cfg.qk_norm) != "head":
        return q_h, k_h
    w_q, w_k = p.q_norm, p.k_norm
    if cfg.qk_norm == "projection":  # the mistake: each head's slice of the projection weight
        w_q = w_q.reshape(cfg.n_heads, 1, cfg.d_k)  # (H, 1, Dk) view, broadcast over tokens
        w_k = w_k.reshape(cfg.n_kv_heads, 1, cfg.d_k)  # (Hkv, 1, Dk) view
    return rms_norm(q_h, w_q, cfg.norm_eps), rms_norm(k_h, w_k, cfg.norm_eps)


def norm_weights(cfg: Config, params, place: str):
    """The spec's q_norm and k_norm shaped for the place a planted candidate normalises at (NumPy arrays)."""
    w_q, w_k = params.q_norm, params.k_norm
    if place == cfg.qk_norm:
        return w_q, w_k
    if place == "projection":  # a (d_k,) head weight tiled over the heads
        return np.tile(w_q, cfg.n_heads), np.tile(w_k, cfg.n_kv_heads)  # (H*Dk,), (Hkv*Dk,)
    return w_q.reshape(cfg.n_heads, 1, cfg.d_k), w_k.reshape(cfg.n_kv_heads, 1, cfg.d_k)  # per head slices, views


def planted_norm(at: str, rms):
    """The planted candidates' QK-norm step at ``at`` ("projection" or "head") with their RMSNorm ``rms(x, w, eps)``.

    The mistake is the place the candidate normalises at (its weights `norm_weights` shapes for it); the torch
    candidate passes ``torch.rsqrt``'s.
    """

    def step(cfg: Config, params, q, k, mistake):
        place = mistake or cfg.qk_norm
        if place != at:
            return q, k
        w_q, w_k = norm_weights(cfg, params, place)
        return rms(q, w_q, cfg.norm_eps), rms(k, w_k, cfg.norm_eps)

    return step


def _regroup(cfg: Config, params, order) -> dict:
    if cfg.qk_norm != "projection":  # one (d_k,) weight for every head: nothing per head
        return {}
    H, Dk = cfg.n_heads, cfg.d_k
    return {"q_norm": params.q_norm.reshape(H, Dk)[order].reshape(H * Dk)}  # (H, Dk) rows regrouped, copy


# Both entries plant both mistakes (each runs where the spec normalises at the other place), in this order.
MISTAKES = (
    PlantedMistake(
        "qk-norm per head",
        "qk_norm",
        "RMSNorm of each head's slice where the projection is normalised",
        "head",
        runs=lambda cfg, q_tokens: cfg.qk_norm == "projection" and cfg.n_heads > 1,
    ),
    PlantedMistake(
        "qk-norm over projection",
        "qk_norm",
        "RMSNorm of the whole projection where each head is normalised",
        "projection",
        runs=lambda cfg, q_tokens: cfg.qk_norm == "head" and cfg.n_heads > 1,
    ),
)
SIMULATED = SimulatedSteps(projection=_simulated_projection, heads=_simulated_heads)


def _planted(idioms) -> PlantedSteps:
    """The candidates' QK-norm at either place, with their library's RMSNorm (the torch one's ``torch.rsqrt``)."""
    return PlantedSteps(
        projection=planted_norm("projection", idioms.rms_norm), heads=planted_norm("head", idioms.rms_norm)
    )


SETTINGS = {
    # Llama 3.1's layer (its rope scaling) with Qwen3's head QK-norm and Qwen2's q/k/v bias; d_k = 8.
    "head": dict(MODELS["llama3"].config, d_model=24, bias="qkv", qk_norm="head"),
    # OLMo 2's projection QK-norm, with a two-sided window of 3 (no causal); d_k = 5.
    "projection": dict(d_model=20, n_heads=4, qk_norm="projection", window=3, bias=False),
}


def _variant(place: str, summary: str, check: CaseSpec, decode: CaseSpec, cli: tuple[CliOption, ...] = ()) -> Variant:
    """The entry of QK-norm at ``place`` ("head" or "projection"): one formula, one option, two variants."""
    return Variant(
        name=f"qk_norm_{place}",
        summary=summary,
        fields=("qk_norm", "norm_eps"),
        is_on=lambda cfg: cfg.qk_norm == place,
        validate=_validate,
        params=PARAMS,
        stage_specs=STAGE_SPECS,  # both places declare them: one stage each (`core.stages`)
        forward=rms_norm,
        backward=rms_norm_vjp,
        check_cases=(check,),
        decode_cases=(decode,),
        bench=BenchSpec({"qk_norm": place}, "plain"),
        cli=cli,
        demo_on={"qk_norm": place},
        demo_off={"qk_norm": None},
        explain=_explainer(place),
        norm_step=NormStep(place, ("q_norm", "k_norm"), NORM_HOW[place]),
        diagnose=DiagnoseSpec(
            rank=40,
            causes=(_cause(place),),
            mistakes=MISTAKES,
            settings=((f"qk-norm-{place}", SETTINGS[place]),),
            simulated=SIMULATED,
            **written_once(_planted),
            normalises_qk=True,
            regroup_heads=_regroup,
        ),
    )


HEAD = _variant(
    "head",
    "RMSNorm of each head's queries and keys",
    CaseSpec(
        "qk_norm_head",
        "Qwen3: RMSNorm of each head's queries and keys (one weight of d_k per side), before rotary",
        QWEN3_LIKE,
        dict(q_tokens=6, dtypes=("float64", "bfloat16"), seed=23),
    ),
    CaseSpec(
        "qk_norm_head",
        "RMSNorm of each head's queries and keys before rotary (the cache holds normed, rotated keys)",
        QWEN3_LIKE,
        dict(tokens=8, prefill=3, seed=112),
    ),
    cli=_OPTIONS,  # one set of options for both: the value of --qk-norm picks the variant
)
PROJECTION = _variant(
    "projection",
    "RMSNorm over the whole q and k projections",
    CaseSpec(
        "qk_norm_projection",
        "OLMo 2: RMSNorm over the whole q and k projections (before the head split)",
        dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=8, rope="half", causal=True, qk_norm="projection"),
        dict(q_tokens=6, dtypes=("float64", "float32"), seed=24),
    ),
    CaseSpec(
        "qk_norm_projection",
        "RMSNorm over the whole q and k projections (OLMo 2), GQA and rotary",
        dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=10, rope="half", causal=True, qk_norm="projection"),
        dict(tokens=7, prefill=2, seed=113),
    ),
)
