"""What an adapter's `prepare` hands back: the stage tensors, the prepared forward, decode run and
forward+backward pass, and their conversion to the canonical layout (`backends.base` re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, MHAGrads, MHAInputs, MHAParams, fold_defaulted_inputs
from mha_rosetta.core.grad import GRAD_PARAM_NAMES, GRAD_STAGES

from .frameworks import to_numpy as tensor_to_numpy

RELATIONS = ("view", "copy", "new")


@dataclass
class StageTensor:
    """One stage tensor as an adapter holds it, with the meaning of each axis.

    ``axes`` uses the symbols of `core.stages` (B, Nq, Nk, H, Hkv, Dk, Dv, D and the
    merged widths H*Dk, Hkv*Dk, Hkv*Dv, H*Dv), so the column-sample query projection
    is ``axes=("B", "H*Dk", "Nq")`` and its canonical form follows by a transpose.
    """

    value: object  # a NumPy array, torch tensor or JAX array
    axes: tuple[str, ...]
    note: str = ""  # how the step made it, in words, for the explainer (e.g. "view(B, N, H, d).transpose(1, 2)")
    # Provenance, filled where the tensor is made: "view" (the live tensor used ``parent``'s
    # memory: a reshape, a slice, an in-place step), "copy" (``parent``'s numbers moved to
    # fresh memory) or "new" (a computation wrote fresh memory; ``parent`` is the stage it
    # was computed from, or None when it has several inputs).
    relation: str = "new"
    parent: str | None = None

    def __post_init__(self) -> None:
        if self.relation not in RELATIONS:
            raise ValueError(f"relation must be one of {', '.join(RELATIONS)}; got {self.relation!r}")
        if self.relation != "new" and self.parent is None:
            raise ValueError(f"a {self.relation} needs the stage it was made from (parent); got None")


@dataclass
class Prepared:
    """Everything needed to run and inspect one forward pass, already converted.

    forward:      the timed region; returns the native result.
    synchronize:  waits until a native result is computed (GPU, async dispatch).
    to_numpy:     native result -> NumPy output (B, Nq, D); untimed.
    native_stages: runs the pass again, untimed, and returns its stage tensors.
    compile:      optional ahead-of-time compilation (JIT backends), timed apart.
    stage_cuts:   optional, the path's own stage-truncated programs (a `stage_cuts.StageCuts`), what
                  ``bench --breakdown`` times where a recorder cannot cut the pass (the best paths).
    """

    forward: Callable[[], object]
    to_numpy: Callable[[object], np.ndarray]
    native_stages: Callable[[], dict[str, StageTensor]]
    synchronize: Callable[[object], None] = lambda result: None
    compile: Callable[[], None] | None = None
    info: dict = field(default_factory=dict)  # e.g. {"tf32": False, "matmul_precision": "highest"}
    stage_cuts: object | None = None  # a backends.stage_cuts.StageCuts

    def output(self) -> np.ndarray:
        """One forward pass, waited for and converted: the batched NumPy output (B, Nq, D)."""
        result = self.forward()
        self.synchronize(result)
        return self.to_numpy(result)


@dataclass
class PreparedDecode:
    """A whole decode run, already converted: the prefill forward, then each step through the cache.

    run:          the prefill and every step (`core.decode.DecodeInputs.chunks`), nothing else;
                  returns the native outputs of every token.
    to_numpy:     native outputs -> NumPy (B, N, D) in token order; untimed.
    step_stages:  runs again, untimed; for each chunk, its token-wise stage tensors
                  (`core.decode.decode_stage_names`, the chunk's tokens on the token axis:
                  the new keys as written to the cache), or None if none are exposed.
    info:         at least ``cache``: ``{"kind", "layout", "slots", "bytes"}`` (the layout in the
                  adapter's axis symbols, e.g. "(B, Hkv, T, Dk)"; ``slots`` per sequence; ``bytes``
                  of K and V together), and ``compilations`` where a JIT compiles.
    """

    run: Callable[[], object]
    to_numpy: Callable[[object], np.ndarray]
    step_stages: Callable[[], list[dict[str, StageTensor]]] | None = None
    synchronize: Callable[[object], None] = lambda result: None
    compile: Callable[[], None] | None = None
    info: dict = field(default_factory=dict)

    def output(self) -> np.ndarray:
        """The whole run, waited for and converted: (B, N, D)."""
        result = self.run()
        self.synchronize(result)
        return self.to_numpy(result)


@dataclass
class PreparedVJP:
    """One forward+backward pass, already converted (the training-step analogue of `Prepared`).

    run:         the timed region: the forward pass and the backward pass of the prepared
                 cotangent, nothing else; returns the native gradients.
    to_grads:    native gradients -> a dict of NumPy arrays, untimed: ``d_x_q (B, Nq, D)``,
                 ``d_x_k``, ``d_x_v`` (the three inputs as separate variables, even when they
                 are one array), ``w_q`` ... ``b_o`` in the canonical layout (biases absent
                 without bias), and optionally ``stages``: backward stages as `StageTensor`.
    """

    run: Callable[[], object]
    to_grads: Callable[[object], dict]
    synchronize: Callable[[object], None] = lambda result: None
    compile: Callable[[], None] | None = None
    info: dict = field(default_factory=dict)


def canonical_stage(name: str, stage: StageTensor, label: str | None = None) -> np.ndarray:
    """Transpose a native stage tensor into the canonical axis order of `core.stages`.

    ``label`` names it in errors when it is not the forward stage itself (a gradient of it).
    """
    canonical_axes = STAGE_BY_NAME[name].shape
    if sorted(stage.axes) != sorted(canonical_axes):
        raise ValueError(
            f"stage {label or name!r} has axes {stage.axes}, which are not a permutation of {canonical_axes}"
        )
    array = tensor_to_numpy(stage.value)
    return np.transpose(array, [stage.axes.index(symbol) for symbol in canonical_axes])


def grads_from_native(grads: dict, inputs: MHAInputs, key_given: bool, value_given: bool) -> MHAGrads:
    """A `PreparedVJP.to_grads` dict -> `MHAGrads` in the caller's form (defaulted inputs folded)."""
    d_query, d_key, d_value = fold_defaulted_inputs(
        grads["d_x_q"], grads["d_x_k"], grads["d_x_v"], key_given, value_given
    )
    params = MHAParams(**{name: grads.get(name) for name in GRAD_PARAM_NAMES})  # type: ignore[arg-type]  # biases may be None
    forward_stage = dict(GRAD_STAGES)
    stages = {
        name: canonical_stage(forward_stage[name], stage, name) for name, stage in grads.get("stages", {}).items()
    }

    def unbatched(d):
        return None if d is None else inputs.unbatch(d)

    return MHAGrads(unbatched(d_query), unbatched(d_key), unbatched(d_value), params, stages)
