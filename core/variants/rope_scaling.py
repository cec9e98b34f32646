"""Rope scaling: the rotary frequencies scaled in Hugging Face's form (linear, dynamic, llama3, yarn, proportional,
longrope).

The formulas and the validation of the dict are `core.rope_scaling`'s (longrope's `core.longrope`'s); this is the
variant's entry.
"""

from __future__ import annotations

import argparse
import json

from ..longrope import check_longrope_pairs
from ..rope_scaling import describe_rope_scaling, scaled_frequencies, validate_rope_scaling, yarn_attention_factor
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, CliOption, Config, Explanation, Variant, numbers
from ._shared import every_candidate

# Two real models' rope_scaling, as their config.json writes it: the explainer shows them and `core.variants.models`
# runs them. Llama 3.1's llama3 scaling (on rotary base 500000):
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# gpt-oss's YaRN (original context 4096, factor 32, no truncation).
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}
# Phi-3-style longrope on 2 rotated pairs: original length 4, factor 4 (cos and sin times sqrt(1 + ln 4 / ln 4))
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": (1.0, 1.5),
    "long_factor": (2.0, 3.5),
    "original_max_position_embeddings": 4,
    "factor": 4.0,
}


def _validate(cfg: Config) -> dict:
    if cfg.rope_scaling is None:
        return {"rope_scaling": None}
    if cfg.rope is None and getattr(cfg, "kv_lora_rank", None) is None:  # MLA resolves its rope (core.variants.mla)
        raise ValueError(
            f"MHAConfig.rope_scaling={cfg.rope_scaling!r} needs rope='half' or 'interleaved' (rope is None)"
        )
    scaling = validate_rope_scaling(cfg.rope_scaling)
    assert scaling is not None  # rope_scaling is not None here
    if scaling["rope_type"] == "longrope" and cfg.rope is not None:  # one divisor per rotated pair
        check_longrope_pairs(scaling, _rotated_dims(cfg))
    return {"rope_scaling": scaling}


def _rotated_dims(cfg: Config) -> int:
    """cfg's rope_dims (the entries validate before MHAConfig resolves it: the head's d_k when not given)."""
    if cfg.rope_dims is not None:
        return cfg.rope_dims
    return cfg.d_k if cfg.d_k is not None else cfg.d_model // cfg.n_heads


def json_object(text: str) -> dict:
    """``--rope-scaling``'s type: a JSON object, or argparse's error saying what was expected and what was given."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object in Hugging Face\'s form, e.g. \'{{"rope_type": "linear", "factor": 2.0}}\'; '
            f"got {text!r} ({error.msg})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object (a dict), got {text!r}")
    return value


def explain(demo) -> Explanation:
    plain, _ = scaled_frequencies(8, 500000.0, None, demo.tokens)
    scaled, _ = scaled_frequencies(8, 500000.0, LLAMA31_SCALING, demo.tokens)
    linear, _ = scaled_frequencies(8, 500000.0, {"rope_type": "linear", "factor": 8.0}, demo.tokens)
    resolved = validate_rope_scaling(GPT_OSS_YARN)  # a dict: GPT_OSS_YARN is not None
    assert resolved is not None
    attention = yarn_attention_factor(resolved)
    base, _ = scaled_frequencies(4, 10000.0, None, 1)  # (2,): LONGROPE's two pairs, unscaled
    within, _ = scaled_frequencies(4, 10000.0, LONGROPE, 4)  # 4 tokens: not past its original length
    past, longrope_factor = scaled_frequencies(4, 10000.0, LONGROPE, 5)
    return Explanation(
        "rope_scaling (a dict in Hugging Face's form)",
        "each pair's frequency scaled by its type (linear, dynamic, llama3, yarn, proportional, longrope); yarn's and "
        "longrope's factor on cos and sin",
        "the rotary tables (q_rotated, k_rotated)",
        [
            ("Hugging Face config", f"rope_scaling = {LLAMA31_SCALING} (Llama 3.1)"),
            ("Hugging Face config", f"rope_scaling = {GPT_OSS_YARN} (gpt-oss)"),
            ("transformers", "ROPE_INIT_FUNCTIONS[rope_type]; the legacy key 'type' is read as 'rope_type'"),
        ],
        [
            f"llama3 (d_k 8, base 500000) divides each pair's frequency by {numbers(plain / scaled, 3)}; "
            f"linear would divide all by {numbers(plain / linear, 3)}: the high frequencies are where they differ",
            f"yarn with factor 32 multiplies cos and sin by {attention:.4g}, so the rotated part of each score by "
            f"{attention**2:.3g}",
            f"longrope (Phi-3; original length 4, factor 4) divides the pairs by {numbers(base / within, 3)} in a call "
            f"of 4 tokens and by {numbers(base / past, 3)} in one of 5, with {longrope_factor:.4g} on cos and sin",
        ],
    )


# -- diagnose: the scaling read as linear, or ignored --------------------------------------------------------------
def mistaken_rope_scaling(cfg: Config, mistake: str) -> dict | None:
    """The rope_scaling a candidate with ``mistake`` uses: None for ``"none"``; for ``"long_table"`` cfg's longrope
    with its long table below the original length too (mlx-lm's SuScaledRoPE); else linear with cfg's factor."""
    if mistake == "none":
        return None
    assert cfg.rope_scaling is not None and mistake in ("linear", "long_table")
    if mistake == "long_table":
        return {**cfg.rope_scaling, "short_factor": cfg.rope_scaling["long_factor"]}
    return {"rope_type": "linear", "factor": cfg.rope_scaling["factor"]}


def _fix(cfg: Config) -> str:
    return (
        f"scale the rotary frequencies as rope_scaling says, {describe_rope_scaling(cfg.rope_scaling)} (transformers' "
        "ROPE_INIT_FUNCTIONS[rope_type], core.rope_scaling.scaled_frequencies), YaRN's attention factor on cos "
        "and sin included"
    )


def _simulated_frequencies(cfg: Config, seq_len: int, mistake):
    """(inv_freq (r/2,), the factor on cos and sin) the simulated candidate rotates with (no scaling: the plain ones)."""
    scaling = cfg.rope_scaling if mistake is None else mistaken_rope_scaling(cfg, mistake)
    return scaled_frequencies(cfg.rope_dims, cfg.rope_base, scaling, seq_len)


def _planted_frequencies(cfg: Config, seq_len: int, mistake):
    """(inv_freq, factor on cos and sin) for scaled rotary, or None for the plain frequencies."""
    scaling = cfg.rope_scaling
    if mistake == "none":
        scaling = None
    elif mistake == "linear":
        scaling = {"rope_type": "linear", "factor": scaling["factor"]}
    if scaling is None:
        return None
    return scaled_frequencies(cfg.rope_dims, cfg.rope_base, scaling, seq_len)


def _reads_as_linear(cfg: Config) -> bool:
    """Whether "read as linear" is a mistake of its own: not for linear, nor for proportional (whose factor, 1 by
    default, would make it the plain frequencies: the scaling ignored), nor for longrope (whose factor sets only the
    factor on cos and sin, and may be absent)."""
    return cfg.rope_scaling["rope_type"] not in ("linear", "proportional", "longrope")


DIAGNOSE = DiagnoseSpec(
    rank=60,
    causes=(
        DiagnoseCause(
            "rope_scaling",
            "linear",
            lambda cfg: (
                f"linear (every frequency / {cfg.rope_scaling['factor']:g}) where the spec's type is "
                f"{cfg.rope_scaling['rope_type']!r}"
            ),
            _fix,
            when=lambda cfg: _reads_as_linear(cfg),
        ),
        DiagnoseCause(
            "rope_scaling",
            "long_table",
            "longrope's long table at every length (mlx-lm's SuScaledRoPE), where the spec turns by short_factor up "
            "to original_max_position_embeddings",
            _fix,
            when=lambda cfg: (
                cfg.rope_scaling["rope_type"] == "longrope"
                and cfg.rope_scaling["short_factor"] != cfg.rope_scaling["long_factor"]
            ),
        ),
        DiagnoseCause(
            "rope_scaling",
            "none",
            lambda cfg: f"ignored: the plain frequencies where the spec has {describe_rope_scaling(cfg.rope_scaling)}",
            _fix,
        ),
    ),
    mistakes=(
        PlantedMistake(
            "rope scaling linear",
            "rope_scaling",
            "rope_scaling read as linear with its factor",
            "linear",
            runs=lambda cfg, q_tokens: _reads_as_linear(cfg),
        ),
        PlantedMistake("rope scaling ignored", "rope_scaling", "the plain rotary frequencies", "none"),
    ),
    simulated=SimulatedSteps(frequencies=_simulated_frequencies),
    # The mistake is which rope_scaling is passed, not the formula: both candidates read these frequencies.
    **every_candidate(PlantedSteps(frequencies=_planted_frequencies)),
)


ENTRY = Variant(
    name="rope_scaling",
    summary="scaled rotary frequencies (linear, dynamic, llama3, yarn, proportional, longrope)",
    fields=("rope_scaling",),
    is_on=lambda cfg: cfg.rope_scaling is not None,
    validate=_validate,
    forward=scaled_frequencies,
    # Llama 3.1's and gpt-oss's layers are check cases of their own (`core.variants.models`); longrope's are here.
    check_cases=(
        CaseSpec(
            "longrope",
            "Phi-3's longrope past its original length (7 tokens > 4): the long table, and sqrt(2) on cos and sin",
            dict(
                d_model=24, n_heads=4, n_kv_heads=2, rope="interleaved", rope_dims=4, causal=True, rope_scaling=LONGROPE
            ),
            dict(batch=2, q_tokens=7, dtypes=("float64", "float32"), seed=68),
        ),
        CaseSpec(
            "longrope_short",
            "Phi-3's longrope within its original length (7 tokens <= 16): the short table",
            dict(  # d_k 6, its first 4 features turned: every size distinct (tests/test_check.py)
                d_model=24,
                n_heads=4,
                rope="half",
                rope_dims=4,
                causal=True,
                rope_scaling={**LONGROPE, "original_max_position_embeddings": 16},
            ),
            dict(batch=2, q_tokens=7, dtypes=("float64",), seed=69),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "decode_longrope",
            # past L from the prefill on: a cache keeps keys rotated when written, so a run that crosses L in decode
            # (Hugging Face's DynamicCache: the short table up to L) is not the spec's run (core.longrope)
            "longrope past its original length (2) from a prefill of 3 on: the long table on every step",
            dict(
                d_model=16,
                n_heads=4,
                n_kv_heads=2,
                rope="half",
                causal=True,
                rope_scaling={**LONGROPE, "original_max_position_embeddings": 2},
            ),
            dict(tokens=8, prefill=3, seed=122),
        ),
        CaseSpec(
            "rope_scaling",
            "linear rope scaling (factor 4) on half rotary",
            dict(
                d_model=15,
                n_heads=3,
                d_k=6,
                rope="half",
                causal=True,
                rope_scaling={"rope_type": "linear", "factor": 4.0},
            ),
            dict(tokens=8, prefill=3, seed=117),
        ),
    ),
    # Measured against plain rotary, with gpt-oss's YaRN (factor 32).
    bench=BenchSpec(
        {
            "rope": "half",
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
            },
        },
        "rope",
        label="rope_yarn",
    ),
    cli=(
        CliOption(
            "--rope-scaling",
            dict(
                type=json_object,
                metavar="JSON",
                help='rope_scaling in Hugging Face\'s form, e.g. \'{"rope_type": "linear", "factor": 2.0}\' (needs --rope)',
            ),
            lambda value: {"rope_scaling": value},
            rank=80,
        ),
    ),
    demo_on={"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    demo_off={"rope_scaling": None},
    explain=explain,
    diagnose=DIAGNOSE,
)
