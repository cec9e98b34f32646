"""The variants of 2024-26 attention: one module each, and the registry every consumer iterates.

Where each sits in the score pipeline (`MHAConfig`'s docstring has the fields)::

    q, k = x @ w.T + b                               (bias="qkv": no b_o later)
    q, k = RMSNorm(q), RMSNorm(k)                    qk_norm: "projection" before the head split,
                                                     "head" after it; stages q_normed / k_normed
    q, k = rotary(q), rotary(k)                      rope_scaling changes the frequencies only
    s    = scale * q @ k.T                           stage scores
    s    = c * tanh(s / c)                           softcap; stage capped_scores
    s    = s + m_h (p_j - p_i) + rel_bias[bucket]    alibi, rel_buckets; stage biased_scores
    s    = s where allowed else -inf                 causal, window, the user's mask; masked_scores
    a    = exp(s) / (exp(sink_h) + sum_k exp(s_k))   sinks (softmax_with_sinks); stage weights

Every formula is float64 NumPy, has no state, and is what `reference_stages` calls; the backends
compute the same numbers in their own frameworks and conventions.

`VARIANT_REGISTRY` maps each variant's name to its entry (`Variant`, in `_entry`): its
`MHAConfig` fields and their validation, its parameters, stages, score step, formulas, cases,
bench cell, command-line options, explainer demonstration and what diagnose knows of it (its causes,
planted mistakes and simulator steps: `Variant.diagnose`, the types in `_diagnose`). Its order is `core.VARIANTS`'
(the checks and the reports list variants in it). A new variant is one module here and one line
in `VARIANT_REGISTRY`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import alibi as _alibi
from . import qk_norm as _qk_norm
from . import qkv_bias as _qkv_bias
from . import rel_bias as _rel_bias
from . import rope_scaling as _rope_scaling
from . import sinks as _sinks
from . import softcap as _softcap
from . import window as _window
from ._diagnose import REPAIRS, DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps, steps_at
from ._entry import SCORE_PLACES, BenchSpec, CaseSpec, CliOption, Config, ParamSpec, ScoreStep, Variant
from ._shared import relative_distances, softmax_with_empty_rows
from .alibi import alibi_bias, alibi_slopes
from .qk_norm import QK_NORMS, rms_norm, rms_norm_vjp
from .rel_bias import relative_bias, relative_bias_vjp, t5_buckets
from .sinks import sink_vjp, softmax_with_sinks
from .softcap import softcap, softcap_vjp
from .window import window_allowed

# name -> entry, in the order of `core.VARIANTS` (explicit: the order is part of every output).
VARIANT_REGISTRY: dict[str, Variant] = {
    entry.name: entry
    for entry in (
        _window.ENTRY,
        _softcap.ENTRY,
        _qk_norm.HEAD,
        _qk_norm.PROJECTION,
        _qkv_bias.ENTRY,
        _alibi.ENTRY,
        _rel_bias.ENTRY,
        _sinks.ENTRY,
        _rope_scaling.ENTRY,
    )
}


def variant(name: str) -> Variant:
    """The registry's entry ``name``; a KeyError naming the known variants for any other."""
    try:
        return VARIANT_REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known variants: {', '.join(VARIANT_REGISTRY)}") from None


def variants_on(cfg: Config) -> tuple[Variant, ...]:
    """The entries ``cfg`` switches on, in registry order (empty: 2017-23 attention)."""
    return tuple(entry for entry in VARIANT_REGISTRY.values() if entry.is_on(cfg))


def score_steps(cfg: Config) -> tuple[ScoreStep, ...]:
    """The score steps of ``cfg``'s variants in pipeline order (`SCORE_PLACES`), each with its variant's name.

    scale * q.k -> softcap -> additive biases (ALiBi, T5) -> positional masks (window) -> softmax
    (with sinks). Steps at one place keep registry order (ALiBi's bias before T5's: they add up).
    """
    steps = [replace(e.score_step, variant=e.name) for e in variants_on(cfg) if e.score_step is not None]
    return tuple(sorted(steps, key=lambda step: SCORE_PLACES.index(step.place)))


def param_spec(name: str) -> ParamSpec:
    """The `ParamSpec` of a variant's parameter ``name`` (``q_norm``, ``sinks``, ...); KeyError for another."""
    for entry in VARIANT_REGISTRY.values():
        for spec in entry.params:
            if spec.name == name:
                return spec
    raise KeyError(f"no variant adds a parameter named {name!r}")


def stage_owners() -> dict[str, tuple[Variant, ...]]:
    """Each stage that exists only with a variant -> the entries that add it (``biased_scores``: ALiBi and T5)."""
    owners: dict[str, tuple[Variant, ...]] = {}
    for entry in VARIANT_REGISTRY.values():
        for stage in entry.stages:
            owners[stage] = (*owners.get(stage, ()), entry)
    return owners


def validate_variants(cfg: Config) -> dict:
    """Every entry's validation of ``cfg`` (once per function, in registry order); the resolved values."""
    resolved: dict = {}
    seen = []
    for entry in VARIANT_REGISTRY.values():
        if entry.validate is not None and entry.validate not in seen:
            seen.append(entry.validate)
            resolved.update(entry.validate(cfg))
    return resolved


def registry_cases(kind: str) -> list[CaseSpec]:
    """The check (``kind="check"``) or decode (``"decode"``) cases of every entry and model, by their seed.

    The entries' `Variant.check_cases` / `decode_cases` and the models' (`core.variants.models.MODELS`);
    ``checks.cases`` and ``checks.decode_cases`` list them after their cases of the 2017-23 layer.
    """
    from .models import MODELS

    if kind not in ("check", "decode"):
        raise ValueError(f"kind must be 'check' or 'decode', got {kind!r}")
    specs = [spec for entry in VARIANT_REGISTRY.values() for spec in getattr(entry, f"{kind}_cases")]
    specs += [spec for model in MODELS.values() if (spec := getattr(model, kind)) is not None]
    return sorted(specs, key=lambda spec: spec.seed)


def score_bias(cfg: Config, rel_table, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray | None:
    """What ALiBi and T5's relative bias add to the scores, (1|B, H, Nq, Nk) float64, or None if neither is on."""
    bias = None
    if cfg.alibi:
        bias = alibi_bias(cfg.n_heads, positions, kv_positions)
    if cfg.rel_buckets is not None:
        rel = relative_bias(cfg, rel_table, positions, kv_positions)
        bias = rel if bias is None else bias + rel
    return bias


__all__ = [
    "QK_NORMS",
    "REPAIRS",
    "SCORE_PLACES",
    "VARIANT_REGISTRY",
    "BenchSpec",
    "CaseSpec",
    "CliOption",
    "DiagnoseCause",
    "DiagnoseSpec",
    "ParamSpec",
    "PlantedMistake",
    "PlantedSteps",
    "ScoreStep",
    "SimulatedSteps",
    "Variant",
    "alibi_bias",
    "alibi_slopes",
    "param_spec",
    "registry_cases",
    "relative_bias",
    "relative_bias_vjp",
    "relative_distances",
    "rms_norm",
    "rms_norm_vjp",
    "score_bias",
    "score_steps",
    "sink_vjp",
    "softcap",
    "softcap_vjp",
    "softmax_with_empty_rows",
    "softmax_with_sinks",
    "stage_owners",
    "steps_at",
    "t5_buckets",
    "validate_variants",
    "variant",
    "variants_on",
    "window_allowed",
]
