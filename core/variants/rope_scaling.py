"""Rope scaling: the rotary frequencies scaled in Hugging Face's form (linear, dynamic, llama3, yarn, proportional).

The formulas and the validation of the dict are `core.rope_scaling`'s; this is the variant's entry.
"""

from __future__ import annotations

import argparse
import json

from ..rope_scaling import describe_rope_scaling, scaled_frequencies, validate_rope_scaling, yarn_attention_factor
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, CliOption, Config, Explanation, Variant, numbers


def _validate(cfg: Config) -> dict:
    if cfg.rope_scaling is None:
        return {"rope_scaling": None}
    if cfg.rope is None and getattr(cfg, "kv_lora_rank", None) is None:  # MLA resolves its rope (core.variants.mla)
        raise ValueError(
            f"MHAConfig.rope_scaling={cfg.rope_scaling!r} needs rope='half' or 'interleaved' (rope is None)"
        )
    return {"rope_scaling": validate_rope_scaling(cfg.rope_scaling)}


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
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 8192
    plain, _ = scaled_frequencies(8, 500000.0, None, demo.tokens)
    scaled, _ = scaled_frequencies(8, 500000.0, llama3, demo.tokens)
    linear, _ = scaled_frequencies(8, 500000.0, {"rope_type": "linear", "factor": 8.0}, demo.tokens)
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    resolved = validate_rope_scaling(yarn)  # its defaults filled in (a dict: yarn is not None)
    assert resolved is not None
    attention = yarn_attention_factor(resolved)
    return Explanation(
        "rope_scaling (a dict in Hugging Face's form)",
        "each pair's frequency scaled by its type (linear, dynamic, llama3, yarn, proportional); yarn's factor on cos and sin",
        "the rotary tables (q_rotated, k_rotated)",
        [
            (
                "Hugging Face config",
                "rope_scaling = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, "
                "'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192} (Llama 3.1)",
            ),
            (
                "Hugging Face config",
                "rope_scaling = {'rope_type': 'yarn', 'factor': 32.0, 'beta_fast': 32.0, "
                "'beta_slow': 1.0, 'original_max_position_embeddings': 4096, 'truncate': False} (gpt-oss)",
            ),
            ("transformers", "ROPE_INIT_FUNCTIONS[rope_type]; the legacy key 'type' is read as 'rope_type'"),
        ],
        [
            f"llama3 (d_k 8, base 500000) divides each pair's frequency by {numbers(plain / scaled, 3)}; "
            f"linear would divide all by {numbers(plain / linear, 3)}: the high frequencies are where they differ",
            f"yarn with factor 32 multiplies cos and sin by {attention:.4g}, so the rotated part of each score by "
            f"{attention**2:.3g}",
        ],
    )


# -- diagnose: the scaling read as linear, or ignored --------------------------------------------------------------
def mistaken_rope_scaling(cfg: Config, rope_type: str) -> dict | None:
    """The rope_scaling a candidate with the wrong type uses: None for ``"none"``, else ``rope_type`` with cfg's factor."""
    if rope_type == "none":
        return None
    assert cfg.rope_scaling is not None and rope_type == "linear"
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
    default, would make it the plain frequencies: the scaling ignored)."""
    return cfg.rope_scaling["rope_type"] not in ("linear", "proportional")


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
    planted=PlantedSteps(frequencies=_planted_frequencies),
)


ENTRY = Variant(
    name="rope_scaling",
    summary="scaled rotary frequencies (linear, dynamic, llama3, yarn, proportional)",
    fields=("rope_scaling",),
    is_on=lambda cfg: cfg.rope_scaling is not None,
    validate=_validate,
    forward=scaled_frequencies,
    # Its check case is Llama 3.1's layer (`core.variants.models`).
    decode_cases=(
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
