"""What each backend holds at each stage: shape, axis meaning, strides, contiguity, view or copy.

Every number comes from the tensors of a real forward pass: each backend prepares the
same configuration, parameters and input, and `Prepared.native_stages()` hands back the
stage tensors in the backend's own layout with the symbol of every axis. The only
words typed here are the meanings of those symbols.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, STAGE_NAMES, MHAConfig, MHAParams

from .memory import array_library, contiguity, layout_unknown_of, provenance_unknown, strides_in_elements

# What each axis symbol of `core.stages` means, in the words of the column/row-sample article's picture:
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
    memory: str  # "view of q", "copy of context", "new buffer (computed)", or n/a for JAX
    note: str
    relation: str = "new"  # the adapter's StageTensor.relation: view, copy or new
    parent: str | None = None  # the stage it was made from

    @property
    def strides_text(self) -> str:
        if self.strides is not None:
            return str(self.strides)
        return layout_unknown_of(self.library)

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


def memory_relation(stage) -> str:
    """Whether a stage tensor is a view of the stage it was made from, a copy, or a new buffer.

    Read from the provenance the adapter recorded where it made the tensor
    (`StageTensor.relation` and `.parent`, measured on the live tensors); JAX arrays are
    immutable and XLA places their buffers, so there the question has no answer.
    """
    unknown = provenance_unknown(stage.value)
    if unknown is not None:
        return unknown
    if stage.relation == "new":
        return "new buffer (computed)"
    return f"{stage.relation} of {stage.parent}"


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
                memory=memory_relation(stage),
                note=stage.note,
                relation=stage.relation,
                parent=stage.parent,
            )
        )
    q_axes = tuple(stages["q"].axes) if "q" in stages else None
    samples, scorers = scorer_location(q_axes)
    return BackendSummary(name, backend.convention, samples, scorers, dtype), rows


def default_backends() -> list[str]:
    """Every installed implementation backend (the third-party oracles hide their stages)."""
    from mha_rosetta.backends import available_backends

    return available_backends(kind="implementation")


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
