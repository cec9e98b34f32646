"""What several variants share: the key-minus-query distance, the softmax whose empty rows are zeros, RMSNorm and
its backward (QK-norm's, Llama 4's after rotary, Gemma 4's value norm, MLA's latent norms), the
entry keywords of a variant one bool field switches on, those of an additive bias on the scores (ALiBi, T5's
buckets: their stage, place and ops call), the entry keywords, validation and explainer grid of the positional masks
one optional integer switches on (window, chunks), and the NumPy candidate's idioms of diagnose's steps written once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from .._validate import require_positive_int
from ._diagnose import PlantedIdioms, PlantedSteps
from ._entry import ConfigField, OpsCall, ScoreStep, StageSpec


def relative_distances(positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``p_j - p_i``: (1|B, Nq) and (1|B, Nk) int positions -> (1|B, Nq, Nk), key minus query."""
    return kv_positions[:, None, :] - positions[:, :, None]


def rms_norm(x: np.ndarray, weight: np.ndarray | float, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2, last axis) + eps) * weight``: RMSNorm over the last axis (a new array)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rms_norm_vjp(
    x: np.ndarray, weight: np.ndarray | float, eps: float, d_y: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(d_x, d_weight summed over every leading axis) of `rms_norm` for the cotangent ``d_y``.

    With ``r = (mean(x**2) + eps) ** -1/2`` and ``g = d_y * weight``:
    ``d_x = r g - x r**3 mean(g x)`` (the mean over the normalised axis), ``d_weight = sum(d_y x r)``.
    """
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = d_y * weight
    d_x = r * g - x * r**3 * np.mean(g * x, axis=-1, keepdims=True)
    d_weight = (d_y * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return d_x, d_weight


def softmax_with_empty_rows(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis where rows of all -inf give zeros instead of NaN."""
    row_max = np.max(scores, axis=-1, keepdims=True)
    empty = np.isneginf(row_max)
    # Subtracting the row maximum keeps exp() in range for logits of any size.
    shifted = scores - np.where(empty, 0.0, row_max)
    exp = np.exp(shifted)
    total = np.sum(exp, axis=-1, keepdims=True)
    return np.where(empty, 0.0, exp / np.where(empty, 1.0, total))


# The NumPy candidate's idioms (`PlantedIdioms`): what the entries' candidate steps written once call in NumPy.
NUMPY_IDIOMS = PlantedIdioms(
    tanh=np.tanh, rms_norm=rms_norm, asarray=np.asarray, concat=np.concatenate, broadcast_to=np.broadcast_to
)


def written_once(planted_in: Callable[[PlantedIdioms], PlantedSteps]) -> dict:
    """`DiagnoseSpec` keywords (``**written_once(planted_in)``) of candidate steps written once over a candidate's
    idioms: ``planted_in`` itself (the torch candidate calls it with torch's) and the NumPy candidate's steps."""
    return dict(planted=planted_in(NUMPY_IDIOMS), planted_in=planted_in)


def every_candidate(steps: PlantedSteps) -> dict:
    """`DiagnoseSpec` keywords (``**every_candidate(steps)``) of candidate steps that no library spells: every
    candidate runs them as they are (NumPy frequencies of rotary, which tensor is read for which)."""
    return written_once(lambda idioms: steps)


# The ops libraries whose adapters apply a form no third-party kernel or oracle knows (`Variant.implemented_by`):
# in every convention (numpy, torch, jax, einops on all three, mlx, and the sharded backends on their heads),
# forward, backward and decode, through their ops object; the third-party oracles and the best paths do not claim
# such a form and refuse it by name.
OUR_ADAPTERS = ("numpy", "torch", "jax", "mlx")


def optional_positive_int(field: str) -> Callable[[object], dict]:
    """The `Variant.validate` of a variant one optional integer field switches on (``window``,
    ``attention_chunk_size``): None is off, any other value must be a positive int."""

    def validate(cfg) -> dict:
        value = getattr(cfg, field)
        if value is not None:
            require_positive_int(field, value)
        return {}

    return validate


def given(field: str, *more: str) -> dict:
    """`Variant` keywords (``**given(field)``) of a variant one optional `MHAConfig` field switches on (None: off):
    its fields (``field`` and the ``more`` it also reads) and its rule, on where ``field`` is not None."""
    return dict(fields=(field, *more), is_on=lambda cfg: getattr(cfg, field) is not None)


# With causality and the user's mask as well as the window and the chunks: always a stage, the last score itself
# without one.
MASK_CALL = OpsCall(
    "masked_scores",
    "blocked positions set to -inf",
    forward=lambda ops, cfg, scores, parts: (
        scores if parts["blocked"] is None else ops.positional_mask(scores, parts["blocked"])
    ),
)
# One bias, ALiBi's and T5's tables summed in the scores' layout by the caller (adding them one at a time would
# round differently where both are on).
BIAS_CALL = OpsCall(
    "biased_scores",
    "+ ALiBi's m_h (p_j - p_i) / T5's rel_bias[bucket(p_j - p_i), h]",
    forward=lambda ops, cfg, scores, parts: ops.add_score_bias(scores, parts["bias"]),
)


def positional_mask(field: str) -> dict:
    """`Variant` keywords (``**positional_mask(field)``) of a positional mask one optional integer field switches
    on (``window``, ``attention_chunk_size``): `given`'s, `optional_positive_int`'s validation, and its step in the
    score pipeline's mask."""
    return dict(
        **given(field),
        validate=optional_positive_int(field),
        score_step=ScoreStep("mask", "positional_mask", call=MASK_CALL),
    )


# The one stage every additive bias adds into, after the softcap's and before the mask: each entry gives its term.
BIAS_STAGE = StageSpec("score bias", "biased_scores", "plus {terms}; only with either", after="capped_scores")
# Where the additive biases sit in the pipeline, in the explainer's words (`Explanation.place`).
BIAS_PLACE = "after the softcap, before the mask"


def additive_bias(term: str) -> dict:
    """`Variant` keywords (``**additive_bias(term)``) of a bias added to the scores (ALiBi, T5's buckets): every such
    entry adds into the one stage ``biased_scores`` (their terms summed in registry order, `ScoreStep`'s "bias" place),
    through the ops object's ``add_score_bias``; ``term``: what it adds, in the stage's meaning."""
    return dict(
        stage_specs=(replace(BIAS_STAGE, term=term),),
        score_step=ScoreStep("bias", "add_score_bias", call=BIAS_CALL),
    )


def flag(field: str, declare: bool = True) -> dict:
    """`Variant` keywords (``**flag(field)``) of a variant one bool `MHAConfig` field switches on (False: off): its
    field, on where true, its demonstration with the field on and off, and, with ``declare``, the field's
    declaration (`ConfigField`; False for a field `MHAConfig` writes out itself, ``alibi``, ``sinks``)."""
    declared = dict(config_fields=(ConfigField(field, False, "bool"),)) if declare else {}
    return dict(
        fields=(field,),
        is_on=lambda cfg: bool(getattr(cfg, field)),
        demo_on={field: True},
        demo_off={field: False},
        **declared,
    )


def resolved_head_dims(cfg) -> tuple[int, int]:
    """(d_k, d_v) as `MHAConfig` resolves them, for a ``validate`` that runs before it writes its defaults back."""
    d_k = cfg.d_model // cfg.n_heads if cfg.d_k is None else cfg.d_k
    return d_k, d_k if cfg.d_v is None else cfg.d_v


def position_grid(tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A positional mask's explainer grid over ``tokens`` tokens at positions 0..N-1: (positions (1, N),
    query index i (N, 1), key index j (1, N))."""
    index = np.arange(tokens)
    return index[None], index[:, None], index[None, :]
