"""The real models' attention layers the checks run, as one table: `MODELS`.

Each is a small layer with the variants a model combines (Gemma 2's softcap and window, gpt-oss's
sinks, window and YaRN, ...), at sizes that differ from every other case. ``mha-rosetta check`` and
``check --decode`` read their configurations from here, so that a model is written once: its
check case (`Model.check`) and its decode case (`Model.decode`) run the same layer. The cases of a
single variant are in its entry (`core.variants.VARIANT_REGISTRY`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._entry import CaseSpec
from .mla import DEEPSEEK_V3_LIKE
from .rope_scaling import GPT_OSS_YARN, LLAMA31_SCALING

# Mistral 4's attention (Mistral4Attention) at a small size, every size distinct: DeepSeek V3's latent attention as
# `mla.DEEPSEEK_V3_LIKE` (q and kv LoRA, d_v 5) with nope 4 + rope 8 = d_k 12 and a latent of 9, interleaved rotary
# with YaRN (mscale = mscale_all_dim = 1, as its config), and the query temperature of its floor(p /
# original_max_position_embeddings) (floor_offset 0), 3 here so that the factor steps twice within the cases
# (transformers' beta is 0.1; 0.5 makes a wrong floor plain).
MISTRAL4_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=3, mscale=1.0, mscale_all_dim=1.0)
MISTRAL4_TEMPERATURE = dict(attn_temperature_tuning=True, floor_offset=0, floor_scale=3, attn_scale=0.5)
MISTRAL4_LIKE: dict[str, Any] = dict(
    DEEPSEEK_V3_LIKE, d_model=27, kv_lora_rank=9, qk_rope_head_dim=8, rope_scaling=MISTRAL4_YARN, **MISTRAL4_TEMPERATURE
)


@dataclass(frozen=True)
class Model:
    """A model's layer (`MHAConfig` keyword arguments) and its cases (None: the model has no such case)."""

    config: dict[str, Any]
    check: CaseSpec | None = None
    decode: CaseSpec | None = None


def _model(name: str, config: dict, check: tuple[str, dict] | None = None, decode: tuple[str, dict] | None = None):
    """``(name, Model)``: the model's cases, (description, options), named after it, read its one configuration."""
    cases = [None if case is None else CaseSpec(name, case[0], config, case[1]) for case in (check, decode)]
    return name, Model(config, *cases)


def _by_name(*models: tuple[str, Model]) -> dict[str, Model]:
    """The models by name, in the order given (each ``(name, Model)``, `_model`)."""
    return dict(models)


MODELS: dict[str, Model] = _by_name(
    _model(
        "mistral",
        dict(d_model=32, n_heads=4, n_kv_heads=2, rope="half", causal=True, window=4, bias=False),  # d_k = 8
        check=(
            "Mistral: grouped kv heads, rotary, causal sliding window of 4, no biases",
            dict(q_tokens=9, dtypes=("float64", "float32"), seed=30),
        ),
    ),
    # One window for both cases (they had 5 and 4): 4, which 8 query tokens and a 10-token decode outgrow.
    _model(
        "gemma2",
        dict(
            d_model=22,
            n_heads=2,
            n_kv_heads=1,
            d_k=10,
            rope="half",
            causal=True,
            window=4,
            softcap=2.0,
            scale=0.25,
            bias=False,
        ),
        check=(
            "Gemma 2: softcap 2, a window of 4, query_pre_attn_scalar 16 (scale 1/4, not 1/sqrt(d_k)), GQA",
            dict(batch=3, q_tokens=8, dtypes=("float64", "bfloat16"), seed=31),
        ),
        decode=(
            "Gemma 2: a window of 4 the sequence outgrows, softcap 2, scale 1/4, GQA, rotary",
            dict(batch=3, tokens=10, prefill=3, dtypes=("float64", "bfloat16"), seed=119),
        ),
    ),
    _model(
        "llama3",
        dict(
            d_model=26,
            n_heads=3,
            d_k=8,
            rope="half",
            rope_base=500000.0,
            causal=True,
            bias=False,
            rope_scaling=LLAMA31_SCALING,
        ),
        check=(
            "Llama 3.1's rope scaling (llama3: factor 8, low 1, high 4, original 8192) on rotary base 500000",
            dict(dtypes=("float64", "float32"), seed=32),
        ),
    ),
    _model(
        "qwen3",
        dict(d_model=32, n_heads=4, n_kv_heads=2, d_k=8, rope="half", causal=True, qk_norm="head", bias=False),
        decode=(
            "Qwen3: per-head qk_norm, GQA, rotary, no biases, two tokens a step",
            dict(batch=2, tokens=9, prefill=4, step=2, seed=120),
        ),
    ),
    _model(
        "mistral4",
        MISTRAL4_LIKE,
        check=(
            "Mistral 4: latent attention (q and kv LoRA, d_v != d_k), YaRN, and its query temperature "
            "1 + 0.5 log(1 + floor(p / 3)) on both query parts",
            dict(batch=2, q_tokens=7, dtypes=("float64",), seed=87),
        ),
        decode=(
            "Mistral 4 through the latent cache: a prefill of 3 and steps of 2, each step's temperature at its offset",
            dict(batch=2, tokens=8, prefill=3, step=2, seed=187),
        ),
    ),
    _model(
        "gpt_oss",
        dict(
            d_model=30,
            n_heads=4,
            n_kv_heads=2,
            d_k=6,
            rope="half",
            rope_base=150000.0,
            causal=True,
            window=4,
            sinks=True,
            rope_scaling=GPT_OSS_YARN,
        ),
        check=(
            "gpt-oss: sinks, a window of 4, biases, YaRN (factor 32, beta 32/1, original 4096, no truncation), GQA",
            dict(q_tokens=9, dtypes=("float64", "float32"), seed=33),
        ),
        decode=(
            "gpt-oss: sinks, a window of 4 the sequence outgrows, biases, YaRN, GQA",
            dict(batch=2, tokens=10, prefill=5, seed=121),
        ),
    ),
)
