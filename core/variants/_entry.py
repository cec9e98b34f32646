"""The entry type of the variant registry (`Variant`) and the small types its fields are made of.

A `Variant` holds, in one place, everything the project knows about one variant of 2024-26
attention: the `MHAConfig` fields it reads and their validation, the parameters it adds and
how `init_params` draws them, its stages and its place in the score pipeline, its float64
formulas, its check and decode cases, its bench entry, its command-line options, the
explainer's demonstration, diagnose's causes and planted mistakes, and what a model layout
reads to hold it. The consumers (core, checks, cli, benchmarks, explain, diagnose, models)
iterate `core.variants.VARIANT_REGISTRY` instead of keeping a table of their own.

Plain data and functions of NumPy only. No module here imports `core.config`: it imports the
registry (its `VARIANTS` and `MHAConfig.variants` come from it), so an entry describes
configurations as keyword arguments (`CaseSpec.config`) rather than building one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake
from ._score_step import SCORE_PLACES as SCORE_PLACES  # the score pipeline's types, where the entries import them
from ._score_step import OpsCall as OpsCall
from ._score_step import ScoreStep

# An `MHAConfig`. `core.config` imports this package, so no module of it imports `core.config`, not
# even for typing (tests/test_import_cycles.py counts type-only imports too).
Config = Any

# Where a weighted norm of the queries and keys sits before rotary (`NormStep`): over each token's merged
# projection before the head split, or over each head's features after it.
NORM_PLACES = ("projection", "head")


@dataclass(frozen=True)
class NormStep:
    """A variant's weighted RMS norm of the queries and keys before rotary (stages ``q_normed``, ``k_normed``):
    the head step every convention runs between its projections and rotary, read from the registry
    (`core.variants.norm_step`) so that no adapter names the variant.

    place:   one of `NORM_PLACES`: ``"projection"`` normalises each token's merged projection before the head
             split (the weights span every head's features: (H*Dk,) and (Hkv*Dk,)); ``"head"`` each head's Dk
             features after it (one (Dk,) weight per side, shared by every head).
    weights: the `MHAParams` fields of the queries' and the keys' weights.
    how:     what it computes, in words (what a recording says of the normed stages).
    """

    place: str
    weights: tuple[str, str]
    how: str

    def __post_init__(self) -> None:
        if self.place not in NORM_PLACES:
            raise ValueError(f"NormStep.place must be one of {NORM_PLACES}, got {self.place!r}")

    @property
    def per_head(self) -> bool:
        """Whether it normalises each head's own features (after the split), not the whole projection."""
        return self.place == "head"

    def weight(self, which: str) -> str:
        """The `MHAParams` field of the weight of ``which`` ("q" or "k")."""
        if which not in ("q", "k"):
            raise ValueError(f"which must be 'q' or 'k', got {which!r}")
        return self.weights[0 if which == "q" else 1]


@dataclass(frozen=True)
class ConfigField:
    """An `MHAConfig` field a variant owns, declared in its entry (`Variant.config_fields`).

    The fields of the variants registered with the package are written out in `MHAConfig` (public API, in
    the order their positional arguments have always had); an entry registered later
    (`core.variants.register_variant`, before `core.config` is imported: the ``mha_rosetta.variants``
    entry points) declares its own here, and `MHAConfig` gets them as keyword fields after its own, in
    registry order. The entry's ``validate`` checks them like any other field.

    name: the field; default: its value when not given (the variant off); annotation: its type, as written.
    """

    name: str
    default: Any = None
    annotation: str = "Any"


@dataclass(frozen=True)
class StageSpec:
    """A stage a variant adds to `core.stages.STAGES` (the catalogue there holds only the stages every
    configuration has; every entry's, the package's own included, are inserted in registry order).

    It sits right after the stage ``after`` and has the shape of ``like`` (``"scores"``: a score stage);
    its backward stage ``d_<name>`` sits right before ``d_<grad_before>`` in `core.grad.GRAD_STAGES`
    (``grad_before`` defaults to ``after``: the gradient of a step's output comes just before its input's).

    Several entries may add into one stage (the additive biases: ``biased_scores``): each declares it with the
    same step, anchors and ``meaning``, a template over ``{terms}``, and its own ``term``; the stage's meaning
    is the template with every term, in registry order, joined by " and ".
    """

    step: str
    name: str
    meaning: str
    after: str = ""
    like: str = "scores"
    # MLA's latents (issue 45): ``before`` puts the stage right before that one (its backward stage after every
    # other, in reverse order); ``shape``: its symbolic shape, a symbol `core.stages` lacks read as that cfg field.
    before: str = ""
    shape: tuple[str, ...] = ()
    grad_before: str = ""
    term: str = ""

    def joins(self, other: StageSpec) -> bool:
        """Whether ``other`` declares the same stage as this one (all but its ``term``): entries that add into one stage."""
        return replace(self, term="") == replace(other, term="")


@dataclass(frozen=True)
class ParamSpec:
    """A learned parameter a variant adds to `MHAParams` (present only while the variant is on).

    name:   the `MHAParams` field.
    field:  the `MHAConfig` field that decides whether it exists (for the refusal texts).
    shape:  ``shape(cfg)``, its canonical shape, or None where ``cfg`` has no such parameter.
    centre, spread: `init_params` draws ``centre + spread * N(0, 1)`` from the variants' generator
            (in `MHAParams` field order, so a seed gives the same numbers as it always has).
    head_axis: the axis of its canonical shape that holds one entry per query head (split with the heads:
            GQA groups, sharded ranks), or None (not split by head).
    score_part: the keyword of the score steps it feeds (`backends.frameworks.ops.score_steps`), laid out by
            each convention against its scores (`backends.frameworks.score_parts`); "" for none.
    """

    name: str
    field: str
    shape: Callable[[Config], tuple[int, ...] | None]
    centre: float
    spread: float
    head_axis: int | None = None
    score_part: str = ""


@dataclass(frozen=True)
class CaseSpec:
    """A check or decode case as data: ``checks`` builds its `SpecCase` / `DecodeCase` from it.

    config:  `MHAConfig` keyword arguments.
    options: the case's other keyword arguments (batch, q_tokens or tokens, prefill, dtypes, seed, ...).
             The seed is the case's number: the cases of the entries and of `core.variants.models`
             are listed by it.
    """

    name: str
    description: str
    config: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return int(self.options.get("seed", 0))


@dataclass(frozen=True)
class CliOption:
    """One command-line option of ``mha-rosetta diagnose``'s variant group (`cli.variant_options`).

    flag:   the option as typed (``--window``); its dest is the flag without dashes, ``-`` as ``_``.
    kwargs: ``argparse.add_argument`` keyword arguments (type, choices, action, metavar, help).
    fields: ``fields(value)``, the `MHAConfig` fields the given value sets.
    needs:  the option this one is a part of (refused without it), or None.
    rank:   its place in the group's help (the order the help text has always had).
    conflicts: another option of the command it contradicts -> what this one means (for the refusal).
    """

    flag: str
    kwargs: Mapping[str, Any]
    fields: Callable[[Any], dict]
    needs: str | None = None
    rank: int = 0
    conflicts: Mapping[str, str] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def value_option(flag: str, field: str, help: str, *, rank: int, needs: str | None = None, **kwargs) -> CliOption:
    """An option whose value sets one `MHAConfig` field (``--window 3`` -> ``{"window": 3}``); ``kwargs``: type, choices, metavar."""
    return CliOption(flag, dict(kwargs, help=help), lambda value: {field: value}, needs=needs, rank=rank)


def switch_option(flag: str, sets: Mapping[str, Any], help: str, *, rank: int, **kwargs) -> CliOption:
    """A switch that sets `MHAConfig` fields to fixed values (``--alibi`` -> ``{"alibi": True}``); ``kwargs``: needs, conflicts."""
    return CliOption(flag, dict(action="store_true", help=help), lambda value: dict(sets), rank=rank, **kwargs)


def demo(field: str, on: Any, off: Any) -> dict:
    """`Variant.demo_on` and ``demo_off`` of a variant one field switches, as keyword arguments (``**demo(...)``)."""
    return dict(demo_on={field: on}, demo_off={field: off})


@dataclass(frozen=True)
class BenchSpec:
    """The variant's cell of ``bench --preset variants`` (`benchmarks.variants`).

    overrides: `MHAConfig` keyword arguments at the cell's size; ``"tokens/4"`` is resolved per size.
    baseline:  the bench entry it is measured against (its cost is its time over the baseline's).
    label:     the bench entry's name, where it is not the variant's (``rope_yarn``).
    preset:    the ``bench --preset`` that times it: ``"variants"`` (the variants of 2024), ``"forms"`` (the
               attention forms of 2025-26, issue 45: Llama 4's chunks, ...); `benchmarks.variants.preset_cells`.
    """

    overrides: Mapping[str, Any]
    baseline: str
    label: str = ""
    preset: str = "variants"


@dataclass(frozen=True)
class Explanation:
    """The explainer's text of a variant (``explain``'s "Variants" section; `explain.variants` adds the stages).

    fields: the `MHAConfig` fields that switch it on, as typed; formula; place: where it sits in the pipeline;
    spellings: (library, how it spells the variant); pitfalls: known off-by-ones, with computed numbers.
    """

    fields: str
    formula: str
    place: str
    spellings: list[tuple[str, str]]
    pitfalls: list[str]


def numbers(values, digits: int = 4) -> str:
    """``values`` as ``"a, b, c"`` to ``digits`` significant digits (the explainer's computed figures)."""
    return ", ".join(f"{v:.{digits}g}" for v in np.ravel(values))


@dataclass(frozen=True)
class Variant:
    """One variant of 2024-26 attention, with everything every consumer reads about it.

    name:     the name an implementation declares in `Backend.variants` (`core.VARIANTS`).
    summary:  one line: what the variant does.
    fields:   the `MHAConfig` fields it reads.
    config_fields: the `MHAConfig` fields it owns beyond those written out in `MHAConfig` (`ConfigField`).
    is_on:    ``is_on(cfg)``: whether ``cfg`` switches it on (`MHAConfig.variants`).
    validate: ``validate(cfg)`` raises for a bad value of its fields (naming the field, the rule and the
              value) and returns the resolved values `MHAConfig` writes back ({} for none). Entries that
              share fields share the function, and `MHAConfig` runs each function once.
    params:   the parameters it adds (`ParamSpec`).
    stages:   the stages of `core.stages` that exist only with it: its ``stage_specs``' names, derived from them when
              left out (an entry registered from outside whose stages are declared elsewhere names them here).
    stage_specs: the stages it adds to `core.stages.STAGES` (`StageSpec`), each at its place in the pipeline.
    score_step: its place in the score pipeline and the ops method for it, or None (it acts elsewhere).
    forward, backward: its float64 formula and that formula's vector-Jacobian product (None: none of
              its own, e.g. a mask has no gradient). A score step's take the arguments of its place
              (`ScoreStep`); the others' document their own.
    check_cases, decode_cases: its cases of ``mha-rosetta check`` and ``check --decode``. The combinations
              real models use are in `core.variants.models`.
    bench:    its cell of ``bench --preset variants``, or None.
    cli:      its options of ``mha-rosetta diagnose``.
    demo_on:  the `MHAConfig` fields that switch it on in the explainer's demonstration layer.
    demo_off: the values that switch those fields off again.
    explain:  ``explain(demo)`` -> its `Explanation`, the numbers computed from ``demo``, the explainer's
              demonstration layer (`explain.variants.Demonstration`: ``demo.tokens``, ``demo.cfg`` and
              ``demo.run(name)`` -> (cfg on, params on, stages on, cfg off, stages off); passed in, since
              the oracle imports this package).
    diagnose: what ``mha-rosetta diagnose`` knows of it (`DiagnoseSpec`, in `_diagnose`), or None: its causes
              (``diagnose_causes``), the bugs its candidates plant in it (``planted_mistakes``), its steps in the
              simulator and in those candidates, its settings of the confusion table.
    layout_params: the parameters a model layout must store to hold it (`models._layout`).
    tied:     parameter -> the parameter it is the same array as while the variant is on (``{"w_v": "w_k"}``
              with ``attention_k_eq_v``): `init_params` draws the second and copies it, `validate_params` refuses
              parameters where the two differ (each a gradient of its own use: the one weight's is their sum).
    implemented_by: for a variant outside the score pipeline, the ops libraries (`backends.frameworks.ops`)
              whose adapters apply it; None: every adapter, and every third-party oracle that claims the
              package's variants (`BUILTIN_VARIANTS`). Any other adapter refuses it by name.
    strategies: the only strategies that run it, for a form computed by an algorithm of its own (MLA's ``naive``
              and ``absorbed``: `backends._mla`); None: every strategy of an adapter that applies it. An adapter
              declares such a form only if it has all of them, and only for them (`runs_in`); every other
              adapter and strategy refuses it by name.
    distance_slopes: for a bias step that is a per-head factor times the key-minus-query distance (ALiBi's
              ``m_h (p_j - p_i)``), ``distance_slopes(cfg)`` -> those factors, float64 ``(n_heads,)``: each
              convention lays them out and multiplies them by its distances in its own arithmetic
              (`backends.frameworks.score_parts.distance_slopes`); None for any other variant.
    norm_step: for a weighted norm of the queries and keys before rotary (QK-norm), its place and weights
              (`NormStep`): every convention reads it through `core.variants.norm_step` and runs it in its own
              arithmetic at that place; None for any other variant.
    kernel_refusal: for a variant that a fused attention kernel can take only through a hook of its own for it,
              why a kernel without that hook cannot, as a template over ``{kernel}`` (the kernel's name); the
              third-party oracles build their refusals from it (`core.variants.kernel_refusals`). "" for a variant
              a kernel takes through its ordinary inputs (a mask, a float bias) or that happens outside it.
    """

    name: str
    summary: str
    fields: tuple[str, ...]
    is_on: Callable[[Config], bool]
    validate: Callable[[Config], dict] | None = None
    params: tuple[ParamSpec, ...] = ()
    stages: tuple[str, ...] = ()
    config_fields: tuple[ConfigField, ...] = ()
    stage_specs: tuple[StageSpec, ...] = ()
    score_step: ScoreStep | None = None
    forward: Callable | None = None
    backward: Callable | None = None
    check_cases: tuple[CaseSpec, ...] = ()
    decode_cases: tuple[CaseSpec, ...] = ()
    bench: BenchSpec | None = None
    cli: tuple[CliOption, ...] = ()
    demo_on: Mapping[str, Any] = field(default_factory=dict)
    demo_off: Mapping[str, Any] = field(default_factory=dict)
    explain: Callable[[Any], Explanation] | None = None
    diagnose: DiagnoseSpec | None = None
    implemented_by: tuple[str, ...] | None = None
    # ``base_shapes(cfg)``: the base weights' and biases' shapes where the variant changes them (MLA's w_q, w_k, w_v).
    base_shapes: Callable[[Config], dict] | None = None
    tied: Mapping[str, str] = field(default_factory=dict)
    strategies: tuple[str, ...] | None = None
    distance_slopes: Callable[[Config], np.ndarray] | None = None
    norm_step: NormStep | None = None
    kernel_refusal: str = ""

    def __post_init__(self) -> None:
        declared = tuple(spec.name for spec in self.stage_specs)
        if not self.stages:
            object.__setattr__(self, "stages", declared)  # frozen: set once, from the one place they are written
        elif declared and self.stages != declared:
            raise ValueError(
                f"variant {self.name!r}: stages {self.stages} must be its stage_specs' names {declared}, "
                "or left out (they are derived from stage_specs)"
            )

    def runs_in(self, strategy: str) -> bool:
        """Whether ``strategy`` runs it: any strategy, unless it names its own (`strategies`)."""
        return self.strategies is None or strategy in self.strategies

    @property
    def layout_params(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.params)

    def step_forward(self, *args):
        """Its score step's float64 formula, called with its place's arguments (`ScoreStep`)."""
        if self.forward is None:
            raise TypeError(f"variant {self.name!r} has a score step at {self._place()} but no float64 forward")
        return self.forward(*args)

    def step_backward(self, *args):
        """The vector-Jacobian product of its score step's formula, called with its place's arguments."""
        if self.backward is None:
            raise TypeError(f"variant {self.name!r} has a score step at {self._place()} but no backward")
        return self.backward(*args)

    def _place(self) -> str:
        return "no place" if self.score_step is None else repr(self.score_step.place)

    @property
    def diagnose_causes(self) -> tuple[DiagnoseCause, ...]:
        return () if self.diagnose is None else self.diagnose.causes

    @property
    def planted_mistakes(self) -> tuple[PlantedMistake, ...]:
        return () if self.diagnose is None else self.diagnose.mistakes
