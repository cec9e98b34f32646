"""What each backend holds at each stage: shape, axis meaning, strides, contiguity, view or copy.

Every number comes from the tensors of a real forward pass: each backend prepares the
same configuration, parameters and input, and `Prepared.native_stages()` hands back the
stage tensors in the backend's own layout with the symbol of every axis. The only
words typed here are the meanings of those symbols.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, STAGE_NAMES, MHAConfig, MHAParams

from .memory import XLA_MANAGED, array_library, contiguity, shares_memory, strides_in_elements

# What each axis symbol of `core.stages` means, in the words of the seed's picture:
# samples (batch items, tokens), features, heads, and the scorers that make features.
AXIS_MEANING = {
    "B": "samples (batch)",
    "Nq": "query tokens",
    "Nk": "key/value tokens",
    "H": "heads",
    "Hkv": "kv heads",
    "Dk": "features of one head (its Dk scorers)",
    "Dv": "value features of one head",
    "D": "features (d_model)",
    "H*Dk": "features: the H*Dk query scorers of all heads",
    "Hkv*Dk": "features: the key scorers of all kv heads",
    "Hkv*Dv": "features: the value scorers of all kv heads",
    "H*Dv": "features: all heads' context side by side",
}

# The stage each split/merge/mask step starts from: a view of it costs nothing, a copy moves memory.
DERIVED_FROM = {
    "q_heads": "q",
    "k_heads": "k",
    "v_heads": "v",
    "q_rotated": "q_heads",
    "k_rotated": "k_heads",
    "masked_scores": "scores",
    "weights": "masked_scores",
    "merged": "context",
}


@dataclass(frozen=True)
class StageRow:
    """One stage tensor of one backend, measured."""

    backend: str
    stage: str
    step: str
    library: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    strides: tuple[int, ...] | None  # in elements; None where XLA manages the layout
    contiguous: str
    memory: str  # "view of q", "copy of context", "new buffer", or n/a for JAX
    note: str

    @property
    def strides_text(self) -> str:
        return XLA_MANAGED if self.strides is None else str(self.strides)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["axis_meaning"] = [AXIS_MEANING.get(symbol, symbol) for symbol in self.axes]
        return data


@dataclass(frozen=True)
class BackendSummary:
    """One backend's convention, read off its projection stage."""

    backend: str
    convention: str
    samples: str  # "row samples (tokens before features)" or "column samples (...)"
    scorers: str  # where the weights' scorers are for this backend
    dtype: str
    skipped: str = ""  # the reason, when the backend could not run here

    def to_dict(self) -> dict:
        return asdict(self)


_RELATION = re.compile(r"\b(view|copy) of (\w+)")
_NEW_BUFFER = "new buffer"


def recorded_relation(name: str, note: str) -> str | None:
    """The relation an adapter's note records to another stage ("view of q", "copy of context").

    A note that starts "new buffer" records that the step wrote fresh memory.
    """
    for kind, other in _RELATION.findall(note):
        if other in STAGE_BY_NAME and other != name:
            return f"{kind} of {other}"
    if note.startswith(_NEW_BUFFER):
        return f"{_NEW_BUFFER} (computed)"
    return None


def _made_from(name: str, note: str) -> str | None:
    """The stage that stage ``name``'s note says it is a view or copy of."""
    relation = recorded_relation(name, note)
    return relation.split(" of ")[1] if relation and relation.startswith(("view of ", "copy of ")) else None


def memory_relation(name: str, tensors: dict, note: str = "", notes: dict[str, str] | None = None) -> str:
    """Whether stage ``name`` is a view of the stage it was made from, a copy, or a new buffer.

    The adapters record snapshots (so later in-place steps cannot change them) and
    measure view-or-copy on the live tensors at that moment, writing e.g. "view of q"
    or "copy of context" in the note; that measurement is used when present. Otherwise
    the recorded tensors themselves are compared (an adapter may record live tensors).
    ``notes`` (every stage's note) tells where an adapter makes the stages the other way
    round: einops computes q_heads and makes q from it, so q_heads is not a view of q.
    """
    value = tensors[name]
    if array_library(value) == "jax":
        return "n/a (immutable; XLA places buffers)"
    measured = recorded_relation(name, note)
    if measured:
        return measured
    earlier = list(STAGE_NAMES[: STAGE_NAMES.index(name)])
    parent = DERIVED_FROM.get(name)
    made_from_this = {other for other, text in (notes or {}).items() if _made_from(other, text) == name}
    if parent in made_from_this:
        return f"{_NEW_BUFFER} (computed)"  # the usual parent was made from this stage
    if parent in tensors:
        earlier.remove(parent)
        earlier.insert(0, parent)  # report the parent first when several share memory
    for other in earlier:
        if other in tensors and shares_memory(value, tensors[other]):
            return f"view of {other}" if other == parent else f"shares memory with {other}"
    if parent is not None:
        return "not recorded (see note)"
    return "new buffer (computed)"


def scorer_location(axes_of_q: tuple[str, ...] | None) -> tuple[str, str]:
    """Sample layout and scorer position, read from the axis order of the query projection."""
    if axes_of_q is None:
        return "n/a (projection not exposed)", "n/a (inside a fused kernel)"
    features, tokens = axes_of_q.index("H*Dk"), axes_of_q.index("Nq")
    if features < tokens:
        return (
            "column samples: features x tokens, one token per column",
            "rows of W (Y = W @ X): row i of w_q is the scorer of feature i",
        )
    return (
        "row samples: tokens x features, one token per row",
        "columns of the applied matrix (Y = X @ W_B with W_B = w_q.T); rows of the stored (out, in) weight",
    )


def measure_backend(
    name: str,
    cfg: MHAConfig,
    params: MHAParams,
    x: np.ndarray,
    dtype: str = "float32",
) -> tuple[BackendSummary, list[StageRow]]:
    """Run one backend once and measure every stage tensor it exposes."""
    from mha_rosetta.backends import BackendNotInstalled, UnsupportedCase, get_backend

    try:
        backend = get_backend(name)
        prepared, _ = backend.prepare(cfg, params, x, dtype=dtype)
        stages = prepared.native_stages()
    except (BackendNotInstalled, UnsupportedCase) as error:
        return BackendSummary(name, "", "", "", dtype, skipped=str(error)), []
    except (ImportError, NotImplementedError) as error:
        # The registry names the backend but its adapter module is missing or unfinished.
        return BackendSummary(name, "", "", "", dtype, skipped=f"adapter not available: {error}"), []

    tensors = {stage_name: stage.value for stage_name, stage in stages.items()}
    notes = {stage_name: stage.note for stage_name, stage in stages.items()}
    rows = []
    for stage_name in STAGE_NAMES:
        if stage_name not in stages:
            continue
        stage = stages[stage_name]
        value = stage.value
        rows.append(
            StageRow(
                backend=name,
                stage=stage_name,
                step=STAGE_BY_NAME[stage_name].step,
                library=array_library(value),
                shape=tuple(int(n) for n in value.shape),
                axes=tuple(stage.axes),
                strides=strides_in_elements(value),
                contiguous=contiguity(value),
                memory=memory_relation(stage_name, tensors, stage.note, notes),
                note=stage.note,
            )
        )
    q_axes = tuple(stages["q"].axes) if "q" in stages else None
    samples, scorers = scorer_location(q_axes)
    return BackendSummary(name, backend.convention, samples, scorers, dtype), rows


def default_backends() -> list[str]:
    """Every installed implementation backend (the third-party oracles hide their stages)."""
    from mha_rosetta.backends import REGISTRY, available_backends

    implementations = {"numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax"}
    installed = set(available_backends())
    return [name for name in REGISTRY if name in implementations and name in installed]


def build_stage_tables(
    cfg: MHAConfig,
    params: MHAParams,
    x: np.ndarray,
    backends: list[str] | None = None,
    dtype: str = "float32",
) -> tuple[list[BackendSummary], list[StageRow]]:
    """Measure every backend in ``backends`` (default: all installed implementations)."""
    summaries, rows = [], []
    for name in default_backends() if backends is None else backends:
        summary, backend_rows = measure_backend(name, cfg, params, x, dtype)
        summaries.append(summary)
        rows.extend(backend_rows)
    return summaries, rows
