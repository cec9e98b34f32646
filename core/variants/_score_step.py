"""Where a variant acts in the score pipeline (`ScoreStep`) and how the pipeline calls its op on an array
library's ops object (`OpsCall`): the score-step types of a registry entry (`_entry.Variant.score_step`, which
re-exports them). Plain data of the standard library only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The places of the score pipeline, in the order it applies them (`score_steps` sorts by this):
# scale * q.k -> an elementwise transform of the scores (the logit cap) -> additive biases ->
# positional masks -> the softmax (and what joins its denominator).
SCORE_PLACES = ("scale", "transform", "bias", "mask", "softmax")


@dataclass(frozen=True)
class OpsCall:
    """How the score pipeline (`backends.frameworks.ops`) calls a score op on a library's ops object: plain callables
    over an ops object, so that an entry says how its step runs in every library without importing one.

    stage:   the stage it makes; how: the step in words (the stage notes every adapter records, each adding its
             own layout and whether it wrote in place).
    forward: ``forward(ops, cfg, scores, parts)`` -> the stage (``parts``: the caller's ``bias`` and ``blocked``).
    backward: ``backward(ops, cfg, d_stage, step_input)`` -> the gradient of its input (None: the identity, an
             addition or a mask, whose blocked cells the softmax's backward already gave zero).
    saves_input: the backward reads the step's input (kept by ``score_steps`` when asked to save; None otherwise).
    """

    stage: str
    how: str
    forward: Callable
    backward: Callable | None = None
    saves_input: bool = False


@dataclass(frozen=True)
class ScoreStep:
    """Where a variant acts in the score pipeline, and the ops method an array library implements for it.

    place: one of `SCORE_PLACES`.
    op:    the name of the method on a framework's ops object that computes the step
           (e.g. ``"add_score_bias"``, ``"positional_mask"``; each entry's module names its own).
    variant: the entry's name; filled in by `score_steps` (an entry leaves it empty).
    call:  how the pipeline calls ``op`` on an ops object (`OpsCall`), or None: the softmax's (the pipeline's own
           call), or one a module of the group ``mha_rosetta.score_ops`` registers with its methods
           (`backends.frameworks.ops.register_score_op`). Entries that share an op share its call.

    The entry's float64 ``forward`` and ``backward`` (`Variant`) take the arguments of its place, so that
    the oracles (`core.reference`, `core.grad`) run every step from the registry without naming one:

    * ``"transform"``: ``forward(cfg, scores) -> scores``; ``backward(cfg, scores, d_out) -> d_scores``
      (``scores``: the step's input). Its stage is the entry's first in ``stages``.
    * ``"bias"``: ``forward(cfg, p, positions, kv_positions) -> term`` (1|B, H, Nq, Nk), the terms of every
      bias entry summed in registry order (one stage, ``biased_scores``); ``backward(cfg, d_biased,
      positions, kv_positions) -> {parameter: gradient}`` or None (no parameter).
    * ``"mask"``: ``forward(cfg, positions, kv_positions) -> allowed`` bool (1|B, 1, Nq, Nk), ANDed into the mask.
    * ``"softmax"``: ``forward(cfg, p, masked) -> weights``; ``backward(cfg, weights_h, row_dot_h) ->
      {parameter: one head's gradient}`` (``weights_h`` (B, Nq, Nk), ``row_dot_h`` = ``sum_j dA_ij A_ij``).

    ``p``: the parameters by name (float64, or rounded on the oracle's rounding path).
    """

    place: str
    op: str
    variant: str = ""
    call: OpsCall | None = None

    def __post_init__(self) -> None:
        if self.place not in SCORE_PLACES:
            raise ValueError(f"ScoreStep.place must be one of {SCORE_PLACES}, got {self.place!r}")
