"""The variants of 2024-26 attention: one module each, and the registry every consumer iterates.

Where each sits in the score pipeline (`MHAConfig`'s docstring has the fields)::

    q, k = x @ w.T + b                               (bias="qkv": no b_o later)
    q, k = RMSNorm(q), RMSNorm(k)                    qk_norm: "projection" before the head split,
                                                     "head" after it; stages q_normed / k_normed
    v    = v / sqrt(mean(v**2) + eps) per kv head     value_norm (Gemma 4, no weight); stage v_normed
                                                     (attention_k_eq_v: v = the raw k projection, w_v is w_k)
    q, k = rotary(q), rotary(k)                      rope_scaling changes the frequencies only
    q, k = RMSNorm(q), RMSNorm(k)                    qk_norm_after_rope (Llama 4): weightless, per head;
                                                     stages q_rotated_normed / k_rotated_normed
    q    = q * (1 + a log1p(floor((p+o)/f)))         temperature (Llama 4's NoPE layers o=1, Mistral 4 o=0);
                                                     stage q_tempered
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
in `VARIANT_REGISTRY`, or, from outside the package, one module that calls `register_variant` and one entry
point of the group ``mha_rosetta.variants`` naming it (tests/test_adding_a_variant.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from . import alibi as _alibi
from . import chunked as _chunked
from . import gate as _gate
from . import k_eq_v as _k_eq_v
from . import mla as _mla
from . import qk_norm as _qk_norm
from . import qk_norm_after_rope as _qk_norm_after_rope
from . import qkv_bias as _qkv_bias
from . import rel_bias as _rel_bias
from . import rope_scaling as _rope_scaling
from . import sinks as _sinks
from . import softcap as _softcap
from . import temperature as _temperature
from . import value_norm as _value_norm
from . import window as _window
from ._diagnose import (
    REPAIRS,
    DiagnoseCause,
    DiagnoseSpec,
    PlantedIdioms,
    PlantedMistake,
    PlantedSteps,
    SimulatedSteps,
    planted_heads,
    steps_at,
)
from ._entry import (
    NORM_PLACES,
    SCORE_PLACES,
    BenchSpec,
    CaseSpec,
    CliOption,
    Config,
    ConfigField,
    Explanation,
    NormStep,
    OpsCall,
    ParamSpec,
    ScoreStep,
    StageSpec,
    Variant,
)
from ._registry import VARIANT_REGISTRY, norm_place, norm_step, variant
from ._shared import relative_distances, rms_norm, rms_norm_vjp, softmax_with_empty_rows
from .alibi import alibi_bias, alibi_slopes
from .chunked import chunk_allowed
from .gate import fuse_gated_q, gate_backward, gate_forward, split_gated_q
from .qk_norm import QK_NORMS
from .qk_norm_after_rope import norm_after_rope, norm_after_rope_vjp
from .rel_bias import relative_bias, relative_bias_vjp, t5_buckets
from .sinks import sink_vjp, softmax_with_sinks
from .softcap import softcap, softcap_vjp
from .temperature import temper, temper_vjp, temperature_scales
from .value_norm import value_rms_norm, value_rms_norm_vjp
from .window import window_allowed

# The built-in entries, in the order of `core.VARIANTS` (explicit: the order is part of every output), into the
# registry's storage (`_registry`, a leaf module the entries can read at call time).
VARIANT_REGISTRY.update(
    (entry.name, entry)
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
        _chunked.ENTRY,
        _gate.ENTRY,
        _qk_norm_after_rope.ENTRY,
        _temperature.ENTRY,
        _mla.ENTRY,
        _mla.Q_LORA_ENTRY,
        _k_eq_v.ENTRY,
        _value_norm.ENTRY,
    )
)


# The variants this package ships (before any registered from outside): what a third-party oracle can claim, since a
# library's kernel knows those forms and no later one (backends/oracles list theirs from it).
# An entry only some of our adapters apply (`Variant.implemented_by`) is no kernel's: the oracles refuse it.
def adapted_variants(*libraries: str, strategy: str | None = None) -> frozenset[str]:
    """The registered variants every one of our adapters applies: all but those whose entry names its libraries;
    with ``libraries`` (ops libraries: "numpy", "torch", "jax", "mlx"), also those whose entry names all of them,
    which our adapters on those libraries apply (`backends.frameworks.ops.RegistryVariants`). With ``strategy``,
    only those that strategy runs (`Variant.runs_in`: not a form of its own strategies, MLA's, elsewhere)."""
    return frozenset(
        name
        for name, entry in VARIANT_REGISTRY.items()
        if (entry.implemented_by is None or (libraries and set(libraries) <= set(entry.implemented_by)))
        and (strategy is None or entry.runs_in(strategy))
    )


def strategy_forms(strategies: Iterable[str]) -> frozenset[str]:
    """The variants that run only in strategies of their own (`Variant.strategies`) which are all among
    ``strategies`` (an adapter's): the forms such an adapter may declare. A form whose strategies it lacks is
    left out, and the adapter refuses it by name."""
    have = set(strategies)
    return frozenset(
        name
        for name, entry in VARIANT_REGISTRY.items()
        if entry.strategies is not None and set(entry.strategies) <= have
    )


BUILTIN_VARIANTS: frozenset[str] = adapted_variants()


# What core built from the registry when it was imported (MHAConfig's fields, the stage table): an entry
# that adds to either must be registered before (`register_variant`).
BUILT_FROM_REGISTRY: list[str] = []
ENTRY_POINT_GROUP = "mha_rosetta.variants"


def register_variant(entry: Variant) -> Variant:
    """Add ``entry`` to `VARIANT_REGISTRY`, after the package's own; every consumer then iterates it.

    An entry that owns `MHAConfig` fields (``config_fields``) or stages (``stage_specs``) must be registered
    before `core.config` is imported, since those are built once from the registry: a module named by an
    entry point of the group ``mha_rosetta.variants`` calls this when `core.variants` loads it. Its score op
    (``score_step.op``) needs a method on each ops object (`backends.frameworks.ops.register_score_op`).
    """
    if not isinstance(entry, Variant):
        raise TypeError(f"register_variant expects a core.variants.Variant, got {type(entry).__name__}")
    if entry.name in VARIANT_REGISTRY:
        raise ValueError(f"a variant named {entry.name!r} is already registered")
    if (entry.config_fields or entry.stage_specs) and BUILT_FROM_REGISTRY:
        raise RuntimeError(
            f"variant {entry.name!r} adds MHAConfig fields or stages, but {' and '.join(BUILT_FROM_REGISTRY)} "
            f"were already built from the registry: register it from a module named by an entry point of the "
            f"group {ENTRY_POINT_GROUP!r}, which core.variants loads before core.config is imported"
        )
    VARIANT_REGISTRY[entry.name] = entry
    return entry


def discover_variants() -> None:
    """Import every module named by an entry point of the group ``mha_rosetta.variants`` (each registers its entry)."""
    import warnings
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()
        except Exception as error:  # a broken plugin must not take the package down; it is named
            warnings.warn(
                f"{ENTRY_POINT_GROUP}: entry point {point.name!r} = {point.value!r} failed: {error}", stacklevel=2
            )


def kernel_refusals(kernel: str, has: frozenset[str] = frozenset()) -> dict[str, str]:
    """Why the fused attention kernel ``kernel`` (its name, as a refusal prints it) cannot take the variants that
    need a hook of their own, less ``has`` (those its library does take, through an argument or a hook of its own):
    variant -> sentence (`Variant.kernel_refusal`), in registry order. An oracle's refusals come from here, and so
    does the set it leaves out of what it claims."""
    return {
        name: entry.kernel_refusal.format(kernel=kernel)
        for name, entry in VARIANT_REGISTRY.items()
        if entry.kernel_refusal and name not in has
    }


def kernel_refusal(cfg: Config, kernel: str, has: frozenset[str] = frozenset()) -> str | None:
    """The `kernel_refusals` of the variants ``cfg`` switches on that ``has`` lacks (``has``: those the kernel
    takes through a hook of its own), joined by "; " in registry order, or None."""
    why = [text for name, text in kernel_refusals(kernel, has).items() if VARIANT_REGISTRY[name].is_on(cfg)]
    return "; ".join(why) or None


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


def steps_at_place(cfg: Config, place: str) -> tuple[Variant, ...]:
    """The entries ``cfg`` switches on whose score step sits at ``place`` (`SCORE_PLACES`), in registry order."""
    return tuple(e for e in variants_on(cfg) if e.score_step is not None and e.score_step.place == place)


def bias_terms(cfg: Config, p, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray | None:
    """What the bias entries ``cfg`` has add to the scores, summed in registry order, (1|B, H, Nq, Nk); None: none.

    ``p``: the parameters by name (each entry's ``forward`` reads its own).
    """
    bias = None
    for entry in steps_at_place(cfg, "bias"):
        term = entry.step_forward(cfg, p, positions, kv_positions)
        bias = term if bias is None else bias + term
    return bias


def score_bias(cfg: Config, rel_table, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray | None:
    """What ALiBi and T5's relative bias add to the scores, (1|B, H, Nq, Nk) float64, or None if neither is on."""
    return bias_terms(cfg, {"rel_bias": rel_table}, positions, kv_positions)


def allowed_by_masks(cfg: Config, positions: np.ndarray, kv_positions: np.ndarray, allowed=None):
    """``allowed`` ANDed with every positional mask entry ``cfg`` has (the window), on the token positions."""
    for entry in steps_at_place(cfg, "mask"):
        mask = entry.step_forward(cfg, positions, kv_positions)  # (1|B, 1, Nq, Nk)
        allowed = mask if allowed is None else allowed & mask
    return allowed


__all__ = [
    "BUILTIN_VARIANTS",
    "NORM_PLACES",
    "QK_NORMS",
    "REPAIRS",
    "SCORE_PLACES",
    "VARIANT_REGISTRY",
    "BenchSpec",
    "CaseSpec",
    "CliOption",
    "ConfigField",
    "DiagnoseCause",
    "DiagnoseSpec",
    "Explanation",
    "NormStep",
    "OpsCall",
    "ParamSpec",
    "PlantedIdioms",
    "PlantedMistake",
    "PlantedSteps",
    "ScoreStep",
    "SimulatedSteps",
    "StageSpec",
    "Variant",
    "adapted_variants",
    "alibi_bias",
    "alibi_slopes",
    "allowed_by_masks",
    "bias_terms",
    "chunk_allowed",
    "fuse_gated_q",
    "gate_backward",
    "gate_forward",
    "kernel_refusal",
    "kernel_refusals",
    "norm_after_rope",
    "norm_after_rope_vjp",
    "norm_place",
    "norm_step",
    "param_spec",
    "planted_heads",
    "register_variant",
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
    "split_gated_q",
    "stage_owners",
    "steps_at",
    "steps_at_place",
    "strategy_forms",
    "t5_buckets",
    "temper",
    "temper_vjp",
    "temperature_scales",
    "validate_variants",
    "value_rms_norm",
    "value_rms_norm_vjp",
    "variant",
    "variants_on",
    "window_allowed",
]

# Third-party variants (entry-point group "mha_rosetta.variants"), loaded before core.config builds MHAConfig.
discover_variants()
