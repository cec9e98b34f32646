"""The variants' parameters that the score steps read, laid out by each convention from core's registry.

A variant's parameter that feeds a part of the score pipeline (`core.variants.ParamSpec.score_part`: the
keyword of `ops.score_steps` it is passed as, with the per-head axis it has, ``head_axis``) is found here,
in the registry, and never named by an adapter. Each convention gives only what differs between
conventions: how a per-head vector is laid out against its scores (``lay_out``: ``(H,)`` -> ``(1, H, 1, 1)``
for heads-first scores, ``(1, Hkv, G, 1, 1)`` for NumPy's grouped tiles, one head's scalar for a head loop,
the vector itself under a head vmap). So a new parameter of this kind is its entry's `ParamSpec`, its
method on each ops object, and nothing in the adapters.

Every path uses these: the forward (`score_parts`), the chunked paths' online softmax (`ops.online_start`
reads the same dict), the sharded paths (`head_slice`: each rank's heads) and the hand-written backward
(`part_params`: which gradients to accumulate, `softmax_part`: the one the softmax's backward returns).

A bias step that is a per-head slope times the key-minus-query distance (ALiBi) is read the same way:
`distance_slopes` gives the slopes from its entry (`core.variants.Variant.distance_slopes`), and each
convention multiplies them by its own distances, in its own arithmetic, where it used to test the variant's flag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants import VARIANT_REGISTRY, ParamSpec, variants_on


def part_params(cfg: MHAConfig | None = None) -> tuple[ParamSpec, ...]:
    """The registered parameters that feed a part of the score steps, in registry order; with ``cfg``, only
    those it has (`ParamSpec.shape` not None)."""
    specs = [spec for entry in VARIANT_REGISTRY.values() for spec in entry.params if spec.score_part]
    return tuple(spec for spec in specs if cfg is None or spec.shape(cfg) is not None)


def part_names() -> tuple[str, ...]:
    """The names of every registered parameter that feeds a part of the score steps (attributes, leaves, keys)."""
    return tuple(spec.name for spec in part_params())


def score_parts(cfg: MHAConfig, source, lay_out: Callable) -> dict:
    """``{part: lay_out(value)}`` for each parameter ``cfg`` has that feeds the score steps: the keywords
    `ops.score_steps` (and `ops.online_start`) take, so that ``score_steps(ops, cfg, scores, **parts, ...)``.

    ``source``: the parameters, a mapping by name or an object with them as attributes (`MHAParams`, a layer
    holding its converted ones); ``lay_out``: the convention's layout of a per-head vector against its scores.
    """

    def read(name: str):
        return source[name] if isinstance(source, Mapping) else getattr(source, name)

    return {spec.score_part: lay_out(read(spec.name)) for spec in part_params(cfg)}


def picked_parts(cfg: MHAConfig, owned: Mapping) -> dict:
    """The score parts among ``owned`` (a dict keyed by part, with other entries: JAX's per-head dict, which
    `score_parts` filled), as `ops.score_steps` takes them."""
    return {spec.score_part: owned[spec.score_part] for spec in part_params(cfg)}


def _softmax_params() -> tuple[ParamSpec, ...]:
    """The registered parameters a softmax step reads (its entry's score step at the softmax), in registry order."""
    return tuple(
        spec
        for entry in VARIANT_REGISTRY.values()
        if entry.score_step is not None and entry.score_step.place == "softmax"
        for spec in entry.params
        if spec.score_part
    )


def softmax_part(cfg: MHAConfig) -> ParamSpec | None:
    """The parameter ``cfg`` has that the softmax reads (its score step's place is the softmax), or None: the
    one whose gradient per query the softmax's backward returns (`ops.score_steps_backward`)."""
    names = {spec.name for spec in part_params(cfg)}
    return next((spec for spec in _softmax_params() if spec.name in names), None)


def softmax_keywords() -> tuple[str, ...]:
    """The keywords of the score parts a softmax reads, whatever the configuration (each head's logit that joins
    every denominator: the sinks); `ops.online_start` starts an online softmax from the one it is given."""
    return tuple(spec.score_part for spec in _softmax_params())


def part_keywords() -> tuple[str, ...]:
    """The keywords of every registered score part (`ParamSpec.score_part`): what `ops.score_steps` accepts."""
    return tuple(spec.score_part for spec in part_params())


def head_params() -> tuple[ParamSpec, ...]:
    """The registered parameters that hold one entry per query head (`ParamSpec.head_axis`), in registry order:
    what a split by head (GQA groups, sharded ranks) cuts along that axis."""
    return tuple(spec for entry in VARIANT_REGISTRY.values() for spec in entry.params if spec.head_axis is not None)


def head_slice(spec: ParamSpec, heads: slice) -> tuple:
    """The index that takes the query heads ``heads`` of ``spec``'s parameter along its head axis."""
    assert spec.head_axis is not None
    return (slice(None),) * spec.head_axis + (heads,)


def distance_slopes(cfg: MHAConfig) -> np.ndarray | None:
    """The per-head factors of the key-minus-query distance that ``cfg``'s bias steps add (ALiBi's slopes
    ``m_h``: `core.variants.Variant.distance_slopes`), float64 ``(n_heads,)``; None where no such step is on.
    Each convention multiplies them by its distances in its own arithmetic. Several such entries would be
    summed here (their terms add up: ``(m + m') d = m d + m' d``, to rounding); one is registered."""
    slopes = None
    for entry in variants_on(cfg):
        if entry.distance_slopes is not None:
            term = entry.distance_slopes(cfg)
            slopes = term if slopes is None else slopes + term
    return slopes
