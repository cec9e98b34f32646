"""The explainer's "Forms" section: each form of 2025-26 attention in each convention, with the shapes every
implementation really holds for the form's own stages (issue 45: "a section per form with its shapes, in each
convention").

Design rules. The forms are registry entries (`core.variants.VARIANT_REGISTRY`): those ``bench --preset forms``
times, and every entry that adds a stage not shaped like the scores (a stage shaped like the scores, a softcap's
or a bias's, sits where the scores sit in every convention: the stage table shows it). Each runs on the variants
section's demonstration layer with the entry's ``demo_on`` (`variants.Demonstration`), in every implementation
asked for, once per strategy the entry names (MLA's ``naive`` and ``absorbed``) or in the adapter's first
strategy; an adapter that refuses the form is listed with its reason. The stages shown are the entry's own
(`Variant.stages`) or, for a form without one (the chunked mask, K = V), the first stage it changes, measured by
the oracle as the variants section measures it. Every shape, axis symbol and note is what the adapter's
`native_stages` declares for its own layout (column samples, row samples, vmapped heads, named axes): nothing
here is written per convention.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mha_rosetta.core import STAGE_BY_NAME, VARIANT_REGISTRY, VARIANTS
from mha_rosetta.core.stages import SCORES

from .variants import Demonstration, first_changed_stage


def form_names() -> list[str]:
    """The forms, in `core.VARIANTS` order: the entries ``bench --preset forms`` times, and those with a stage of
    their own that is not shaped like the scores."""

    def is_form(entry) -> bool:
        timed = entry.bench is not None and entry.bench.preset == "forms"
        return timed or any(STAGE_BY_NAME[name].shape != SCORES for name in entry.stages)

    return [name for name in VARIANTS if is_form(VARIANT_REGISTRY[name])]


def shown_stages(form: str) -> tuple[str, ...]:
    """The stages the section shows for ``form``: its own, else the first stage it changes (measured)."""
    return VARIANT_REGISTRY[form].stages or (first_changed_stage(form),)


@dataclass(frozen=True)
class FormStage:
    """One stage of one form as one implementation holds it."""

    form: str
    backend: str
    strategy: str
    stage: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FormShapes:
    """Every implementation's stages of one form, and the implementations that refuse it (name -> reason)."""

    form: str
    summary: str
    stages: tuple[str, ...]
    rows: list[FormStage] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "form": self.form,
            "summary": self.summary,
            "stages": list(self.stages),
            "rows": [row.to_dict() for row in self.rows],
            "refused": dict(self.refused),
        }


NOT_EXPOSED = "not exposed: the implementation runs the form but does not record this stage"


def _strategies(form: str, backend) -> tuple[str, ...]:
    own = VARIANT_REGISTRY[form].strategies
    return tuple(s for s in own if s in backend.strategies) if own else backend.strategies[:1]


def form_shapes(form: str, backends: list[str], dtype: str = "float64") -> FormShapes:
    """``form`` on the demonstration layer in each of ``backends``: its shown stages as each one holds them."""
    from mha_rosetta.backends import BackendNotInstalled, UnsupportedCase, get_backend

    cfg, params, _, _, _ = Demonstration.run(form)
    x = Demonstration.inputs()
    result = FormShapes(form, VARIANT_REGISTRY[form].summary, shown_stages(form))
    for name in backends:
        try:
            backend = get_backend(name)
            strategies = _strategies(form, backend)
            if not strategies:
                own = ", ".join(VARIANT_REGISTRY[form].strategies or ())
                raise UnsupportedCase(f"{name} has none of the strategies that run {form} ({own})")
            for strategy in strategies:
                prepared, _ = backend.prepare(cfg, params, x, strategy=strategy, dtype=dtype)
                stages = prepared.native_stages()
                for stage in result.stages:
                    held = stages.get(stage)
                    if held is None:  # a fused kernel, or a pass that records only some stages (rule 3)
                        result.rows.append(FormStage(form, name, strategy, stage, (), (), NOT_EXPOSED))
                        continue
                    shape = tuple(int(n) for n in held.value.shape)
                    result.rows.append(FormStage(form, name, strategy, stage, shape, tuple(held.axes), held.note))
        except (BackendNotInstalled, UnsupportedCase) as error:
            result.refused[name] = str(error)
        except (ImportError, NotImplementedError) as error:  # as the stage table: a registered adapter not there
            result.refused[name] = f"adapter not available: {error}"
    return result


def all_form_shapes(backends: list[str] | None = None, dtype: str = "float64") -> list[FormShapes]:
    """`form_shapes` of every form (`form_names`) in ``backends`` (default: every installed implementation)."""
    from .stages_table import default_backends

    names = default_backends() if backends is None else backends
    return [form_shapes(form, names, dtype) for form in form_names()]


FORMS_INTRO = (
    "The forms of 2025-26, each in each convention: the form's own stages (or the first stage it changes) on the "
    "variants' demonstration layer, with the shape and axes each implementation holds and its note on how it made "
    "them (read from the adapters' stage tensors)."
)


def _shape_text(row: FormStage) -> str:
    if not row.axes:
        return "-"
    return " x ".join(f"{symbol} {n}" for symbol, n in zip(row.axes, row.shape, strict=True))


def form_tables(forms: list[FormShapes]) -> list[tuple[str, list[str], list[list[str]]]]:
    """One table per form, (title, headers, rows): implementation (strategy), stage, axes with sizes, note."""
    tables = []
    for shapes in forms:
        rows = [[f"{r.backend} ({r.strategy})", r.stage, _shape_text(r), r.note] for r in shapes.rows]
        rows += [[name, "refused", "-", reason] for name, reason in shapes.refused.items()]
        title = f"{shapes.form}: {shapes.summary} (stages: {', '.join(shapes.stages)})"
        tables.append((title, ["implementation (strategy)", "stage", "axes and sizes", "how"], rows))
    return tables
