"""The explainer's "Variants" section: each variant of `core.VARIANTS` with its formula, its place in the pipeline,
the stage it changes, each library's spelling, and the known off-by-ones.

Design rules. The list is the variant registry (`core.variants.VARIANT_REGISTRY`): each entry's
`Variant.explain` writes its text and computes its numbers from `core` (the slopes, T5's buckets,
the rotary frequencies, the windows), and `variant_entries` raises when a variant has none, so a
new variant cannot be left out silently. The stage each variant changes is measured here: the
float64 oracle runs the demonstration layer (`DEMO`, 6 tokens) with the variant on (its entry's
``demo_on``) and off (``demo_off``) on the same parameters and inputs, and the first stage whose
tensor differs is named. The library spellings are the one typed part: names of configuration
fields and arguments. NumPy and `core` only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from mha_rosetta.core import (
    VARIANT_PARAM_NAMES,
    VARIANT_REGISTRY,
    VARIANTS,
    MHAConfig,
    init_params,
    reference_stages,
    stage_names,
)

TOKENS = 6
VARIANTS_INTRO = (
    "The variants of 2024-26 attention (core.VARIANTS), each off by default. The score pipeline runs in the order "
    "of the stage list, here with every score variant on (a stage that only a variant adds exists only with it):"
)
# The demonstration layer: 6 heads (not a power of two, as BLOOM's ALiBi needs to show), causal, rotary half.
DEMO = MHAConfig(d_model=24, n_heads=6, d_k=4, causal=True, rope="half", bias=False)
# Each variant switched on in the demonstration (its entry's field and value).
SWITCH_ON: dict[str, dict] = {name: dict(entry.demo_on) for name, entry in VARIANT_REGISTRY.items()}


@dataclass(frozen=True)
class VariantEntry:
    variant: str  # a core.VARIANTS name
    fields: str  # the MHAConfig fields that switch it on
    formula: str
    place: str  # where it sits in the pipeline
    stages: str  # the stages it adds, and the first stage it changes (measured)
    spellings: list[tuple[str, str]] = field(default_factory=list)  # (library, how it spells the variant)
    pitfalls: list[str] = field(default_factory=list)  # known off-by-ones, with computed numbers

    def to_dict(self) -> dict:
        return asdict(self)


# -- the measured stage, and the demonstration's tensors ------------------------------------------
class Demonstration:
    """The demonstration layer an entry's `Variant.explain` computes its numbers on (`core.variants._entry`)."""

    tokens = TOKENS
    cfg = DEMO

    @staticmethod
    def run(variant: str):
        """(cfg on, params on, stages on, cfg off, stages off) of the demonstration for ``variant``."""
        entry = VARIANT_REGISTRY[variant]
        on = replace(DEMO, **entry.demo_on)
        off = replace(on, **entry.demo_off)
        params = init_params(on, seed=3)
        params_off = replace(params, **dict.fromkeys(VARIANT_PARAM_NAMES))
        if on.bias != off.bias:  # bias="qkv" off is bias=True: the output bias is back
            params_off = replace(params_off, b_o=init_params(off, seed=3).b_o)
        if _reshapes(on) or _reshapes(off):  # MLA changes the projections' shapes: the off layer has its own
            params_off = init_params(off, seed=3)
        elif entry.tied:  # a weight held twice when on (k_eq_v: w_v is w_k) is its own when off
            untied = init_params(off, seed=3)
            params_off = replace(params_off, **{name: getattr(untied, name) for name in entry.tied})
        x = Demonstration.inputs()
        return on, params, reference_stages(on, params, x), off, reference_stages(off, params_off, x)

    @staticmethod
    def inputs() -> np.ndarray:
        """The demonstration's tokens (1, TOKENS, d_model), the same for every variant."""
        return np.random.default_rng(4).standard_normal((1, TOKENS, DEMO.d_model))


def first_changed_stage(variant: str) -> str:
    """The first stage whose tensor differs with ``variant`` on and off (or that exists only with it)."""
    on, _, stages_on, _, stages_off = Demonstration.run(variant)
    return next(
        name
        for name in stage_names(on)
        if name not in stages_off
        or not np.allclose(stages_on[name], stages_off[name], rtol=0.0, atol=1e-12, equal_nan=True)
    )


def _changed_stages(variant: str) -> str:
    on, _, _, off, _ = Demonstration.run(variant)
    added = [name for name in stage_names(on) if name not in stage_names(off)]
    text = f"adds {', '.join(added)}; " if added else ""
    return text + f"first changed: {first_changed_stage(variant)}"


def _entry(variant: str) -> VariantEntry:
    text = VARIANT_REGISTRY[variant].explain(Demonstration())  # type: ignore[misc]  # variant_entries checked it
    return VariantEntry(
        variant, text.fields, text.formula, text.place, _changed_stages(variant), text.spellings, text.pitfalls
    )


def _reshapes(cfg: MHAConfig) -> bool:
    """Whether a variant ``cfg`` has on changes the projections themselves (MLA: `Variant.base_shapes`)."""
    return any(VARIANT_REGISTRY[name].base_shapes is not None for name in cfg.variants)


def pipeline() -> str:
    """The score pipeline as the stage list of a layer with every score variant on (`core.stage_names`).

    MLA's entries, which change the projections (and refuse QK-norm), are left out: their stages come first.
    """
    switched = [e.demo_on for e in VARIANT_REGISTRY.values() if not _reshapes(replace(DEMO, **e.demo_on))]
    every = replace(DEMO, **{k: v for demo_on in switched for k, v in demo_on.items()})
    return " -> ".join(stage_names(every))


def variant_entries() -> list[VariantEntry]:
    """One entry per `core.VARIANTS` name, in that order; a variant without an entry is an error."""
    missing = [name for name in VARIANTS if name not in VARIANT_REGISTRY or VARIANT_REGISTRY[name].explain is None]
    if missing:
        raise KeyError(
            f"core.VARIANTS has {', '.join(missing)} without an explainer entry: give its Variant an explain function"
        )
    return [_entry(name) for name in VARIANTS]


def variant_tables(entries: list[VariantEntry]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The section's tables as (title, headers, rows): what each variant is, then how each library spells it."""
    what = [[e.variant, e.fields, e.formula, e.place, e.stages] for e in entries]
    spell = [[e.variant, library, text] for e in entries for library, text in e.spellings]
    slips = [[e.variant, text] for e in entries for text in e.pitfalls]
    return [
        (
            "The variants: formula, place in the pipeline, stage",
            ["variant", "MHAConfig", "formula", "where", "stages"],
            what,
        ),
        ("Each library's spelling", ["variant", "library", "spelling"], spell),
        ("Known off-by-ones and differences (computed)", ["variant", "what to know"], slips),
    ]
