"""The query temperature of Llama 4's NoPE layers and of Mistral 4: each query scaled by a factor that grows with
its position.

One formula with a position offset ``floor_offset`` (``o``), the only difference between the two models::

    q_i <- q_i * (1 + attn_scale * log1p(floor((p_i + o) / floor_scale)))

* ``Llama4TextAttention`` (transformers 5.25), on a layer without rotary (``no_rope_layers[i] == 0``) and with
  ``attn_temperature_tuning``: ``o = 1`` (the default here)::

      positions = arange(seq_len) + past_seen_tokens          # the cache offset included
      attn_scales = log1p(floor((positions + 1) / floor_scale)) * attn_scale + 1
      query_states = query_states * attn_scales               # (B, N, H, d) * (B, N, 1, 1)

  The factor is 1 for the first ``floor_scale - 1`` positions (8191 with Llama 4's defaults) and steps up at
  every multiple of ``floor_scale`` minus one.
* ``Mistral4Attention`` (transformers 5.25, multi-head latent attention), always: ``o = 0``, ``attn_scale`` is
  ``rope_parameters["llama_4_scaling_beta"]``, ``floor_scale`` is
  ``rope_parameters["original_max_position_embeddings"]`` (the YaRN's own), on the concatenated query
  ``[q_nope | q_rot]`` after rotary, from ``position_ids``::

      get_llama_4_attn_scale(position_ids, beta, original_max_position_embeddings)
          = 1 + beta * log(1 + floor(position_ids / original_max_position_embeddings))

  The factor is 1 for the first ``floor_scale`` positions and steps up at every multiple of ``floor_scale``.

Keys untouched (arXiv 2501.19399: the softmax of a long context sharpened by ``log`` of the position). The spec's
stage ``q_tempered`` (B, H, Nq, Dk) sits after rotary and the QK-norm after it (where both modules multiply),
and the scores read it; under MLA it is both query parts, nope and rope. Llama 4 tunes only its NoPE layers,
which have no rotary and attend fully (no chunk); the spec applies the formula wherever it is switched on (it
composes with every other step), and the layouts' rules hold it to what each module tempers
(`models.hf_llama4`, `models.hf_mistral4`). The positions are `core.inputs`' (``p_i``), which on a decode step
include the cache offset: Llama 4 computes them from the cache's length, Mistral 4 reads ``position_ids``.
"""

from __future__ import annotations

import math

import numpy as np

from .._validate import require_bool, require_positive_number
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import (
    BenchSpec,
    CaseSpec,
    Config,
    ConfigField,
    Explanation,
    StageSpec,
    Variant,
    numbers,
    switch_option,
    value_option,
)
from ._shared import OUR_ADAPTERS

FIELD = "attn_temperature_tuning"
OFFSET = "floor_offset"
# transformers' Llama4TextConfig defaults.
FLOOR_SCALE = 8192.0
ATTN_SCALE = 0.1
# The position offset of each model's floor: what ``floor_offset`` may be, and the form each names.
LLAMA4_OFFSET, MISTRAL4_OFFSET = 1, 0
FORMS = {
    LLAMA4_OFFSET: "Llama 4: log1p(floor((p + 1) / floor_scale))",
    MISTRAL4_OFFSET: "Mistral 4: log(1 + floor(p / original_max_position_embeddings))",
}


def temperature_scales(
    positions: np.ndarray, floor_scale: float, attn_scale: float, floor_offset: int = LLAMA4_OFFSET
) -> np.ndarray:
    """``1 + attn_scale * log1p(floor((p + floor_offset) / floor_scale))`` (float64, the shape of ``positions``);
    ``floor_offset`` 1 is Llama 4's form, 0 Mistral 4's."""
    shifted = np.asarray(positions, dtype=np.float64) + float(floor_offset)
    return 1.0 + attn_scale * np.log1p(np.floor(shifted / floor_scale))


def scales_of(cfg: Config, positions: np.ndarray) -> np.ndarray:
    """`temperature_scales` of ``positions`` with ``cfg``'s floor_scale, attn_scale and floor_offset."""
    return temperature_scales(positions, cfg.floor_scale, cfg.attn_scale, getattr(cfg, OFFSET))


def temper(cfg: Config, q: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``q`` (B, H, Nq, Dk) times each query position's factor; ``positions`` (1|B, Nq)."""
    scales = scales_of(cfg, positions)  # (1|B, Nq)
    return q * scales[:, None, :, None]  # broadcast over heads and features


def temper_vjp(cfg: Config, positions: np.ndarray, d_tempered: np.ndarray) -> np.ndarray:
    """The cotangent of `temper`'s input: the same factor (it is a diagonal linear map of q; no parameter)."""
    return temper(cfg, d_tempered, positions)


def _validate(cfg: Config) -> dict:
    on = getattr(cfg, FIELD)
    require_bool(FIELD, on)
    floor_scale = require_positive_number("floor_scale", cfg.floor_scale)
    attn_scale = cfg.attn_scale
    if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)) or not math.isfinite(attn_scale):
        raise ValueError(f"MHAConfig.attn_scale must be a finite number >= 0, got {attn_scale!r}")
    if attn_scale < 0:
        raise ValueError(
            f"MHAConfig.attn_scale must be a finite number >= 0 (a negative one can turn the query's factor "
            f"1 + attn_scale * log1p(...) negative, flipping the softmax), got {attn_scale!r}"
        )
    offset = getattr(cfg, OFFSET)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset not in FORMS:
        raise ValueError(
            f"MHAConfig.{OFFSET} must be {LLAMA4_OFFSET} ({FORMS[LLAMA4_OFFSET]}) or {MISTRAL4_OFFSET} "
            f"({FORMS[MISTRAL4_OFFSET]}), got {offset!r}"
        )
    return {"floor_scale": floor_scale, "attn_scale": float(attn_scale), OFFSET: int(offset)}


def offset_reason(cfg: Config, module: str, offset: int) -> str | None:
    """A layout's rule: why ``module``, whose temperature floors ``p + offset``, cannot hold ``cfg``'s, or None."""
    if not getattr(cfg, FIELD) or getattr(cfg, OFFSET) == offset:
        return None
    return (
        f"MHAConfig.{OFFSET}={getattr(cfg, OFFSET)} ({FORMS[getattr(cfg, OFFSET)]}): {module}'s temperature is "
        f"{FORMS[offset]} ({OFFSET}={offset})"
    )


# Llama 4's NoPE layer at a small size: GQA, causal, no rotary; floor_scale 3 so the factor steps inside the case.
NOPE_LIKE = dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, bias=False, floor_scale=3, attn_scale=0.5)
NOPE_LIKE[FIELD] = True


# -- diagnose: the temperature forgotten, its floor off by one, its positions not offset by the cache (decode) ------
def _other_form(cfg: Config, positions: np.ndarray) -> np.ndarray:
    """The positions whose factors under ``cfg``'s form are the other model's: Llama 4's ``floor((p + 1) / f)`` read
    as ``floor(p / f)`` is ``p - 1``; Mistral 4's ``floor(p / f)`` read as ``floor((p + 1) / f)`` is ``p + 1``."""
    return positions - 1 if getattr(cfg, OFFSET) == LLAMA4_OFFSET else positions + 1


def _positions_read(cfg: Config, positions: np.ndarray, mistake) -> np.ndarray:
    """The positions a candidate with ``mistake`` computes the factors of: ``"not_offset"``: ``0..Nq-1`` on every call
    (a decode step's cache offset left out); ``"off_by_one"``: the other model's floor (`_other_form`)."""
    positions = np.asarray(positions)  # (1|B, Nq)
    if mistake == "not_offset":
        return np.broadcast_to(np.arange(positions.shape[-1]), positions.shape)
    return _other_form(cfg, positions) if mistake == "off_by_one" else positions


def _simulated(cfg: Config, p, q, k, positions, mistake):
    """Diagnose's simulator: the spec's `temper` of the queries at the positions ``mistake`` reads; k untouched."""
    return (q if mistake == "dropped" else temper(cfg, q, _positions_read(cfg, positions, mistake))), k


def _planted(cfg: Config, params, q, k, mistake):
    """The NumPy candidate's temperature, as ``Llama4TextAttention`` (or ``Mistral4Attention``, ``floor_offset`` 0)
    writes it (queries at positions 0..Nq-1)."""
    if mistake == "dropped":
        return q, k
    cache_position = np.arange(q.shape[2])  # (Nq,)
    offset = getattr(cfg, OFFSET)
    numerator = cache_position + (1 - offset if mistake == "off_by_one" else offset)  # the other form's, or its own
    attn_scales = np.log1p(np.floor(numerator / cfg.floor_scale)) * cfg.attn_scale + 1  # (Nq,)
    return q * attn_scales[:, None], k  # (B, H, Nq, Dk) * (Nq, 1)


def _tempers(cfg: Config, q_tokens: int) -> bool:
    """Some of positions 0..q_tokens-1 has a factor other than 1 (Llama 4's floor_scale 8192 needs 8191 tokens)."""
    return bool(np.any(scales_of(cfg, np.arange(q_tokens)) != 1.0))


def _off_by_one_shows(cfg: Config, q_tokens: int) -> bool:
    positions = np.arange(q_tokens)
    return bool(np.any(scales_of(cfg, _other_form(cfg, positions)) != scales_of(cfg, positions)))


def _unseen(cfg: Config, q_tokens: int) -> str | None:
    if not _tempers(cfg, q_tokens):
        return (
            f"the temperature is 1 at every probe position 0..{q_tokens - 1} (floor_scale {cfg.floor_scale:g}, "
            f"attn_scale {cfg.attn_scale:g}): a mistake in it cannot show here; to test it, diagnose the candidate "
            f"built with a floor_scale of at most {q_tokens} and attn_scale > 0"
        )
    return None


def _numerator(cfg: Config, offset: int | None = None) -> str:
    """``p + 1`` or ``p``: what ``cfg``'s floor (or that of ``offset``) divides."""
    return "p + 1" if (getattr(cfg, OFFSET) if offset is None else offset) == LLAMA4_OFFSET else "p"


def _fix(cfg: Config) -> str:
    if getattr(cfg, OFFSET) == LLAMA4_OFFSET:
        return (
            "multiply each query (after rotary and the QK-norm) by 1 + attn_scale * log1p(floor((p + 1) / "
            "floor_scale)), p its position with the cache offset (Llama4TextAttention on its NoPE layers; "
            "core.variants.temperature_scales)"
        )
    return (
        "multiply both query parts (nope and rope, after rotary) by 1 + llama_4_scaling_beta * log(1 + floor(p / "
        "original_max_position_embeddings)), p its position_ids with the cache offset (Mistral4Attention; "
        "core.variants.temperature_scales with floor_offset 0)"
    )


def _off_by_one_detail(cfg: Config) -> str:
    if getattr(cfg, OFFSET) == LLAMA4_OFFSET:
        return (
            f"the temperature's floor one position early: floor(p / {cfg.floor_scale:g}) where Llama 4 "
            f"has floor((p + 1) / {cfg.floor_scale:g})"
        )
    return (
        f"the temperature's floor one position late: Llama 4's floor((p + 1) / {cfg.floor_scale:g}) where Mistral 4 "
        f"has floor(p / {cfg.floor_scale:g})"
    )


CAUSES = (
    DiagnoseCause(
        "temperature",
        "dropped",
        lambda cfg: (
            f"the temperature forgotten: no query multiplied by 1 + {cfg.attn_scale:g} * "
            f"log1p(floor(({_numerator(cfg)}) / {cfg.floor_scale:g}))"
        ),
        _fix,
    ),
    DiagnoseCause("temperature", "off_by_one", _off_by_one_detail, _fix),
    DiagnoseCause(
        "decode_temperature_not_offset",
        "not_offset",
        "the temperature's positions restart at 0 on each call: a step's factors from arange(step), not from the "
        "tokens' positions",
        "compute the factors from the positions with the cache offset (Llama4TextAttention: arange(N) + "
        "past_key_values.get_seq_length(), or the positions passed in), not from arange(N) of the call",
        decode=True,
    ),
)
DIAGNOSE = DiagnoseSpec(
    rank=75,  # with the forms of 2025-26, before a variant registered from outside at 80
    causes=CAUSES,
    mistakes=(
        PlantedMistake("temperature forgotten", "temperature", "attn_scales never applied", "dropped", _tempers),
        PlantedMistake(
            "temperature floor off by one",
            "temperature",
            "log1p(floor(cache_position / floor_scale)): the + 1 left out",
            "off_by_one",
            _off_by_one_shows,
        ),
    ),
    settings=(("llama4-nope", NOPE_LIKE),),
    simulated=SimulatedSteps(rotated=_simulated),
    planted=PlantedSteps(rotated=_planted),
    unseen=_unseen,
)


def explain(demo) -> Explanation:
    on, _, stages, _, _ = demo.run("temperature")
    scales = temperature_scales(np.arange(demo.tokens), on.floor_scale, on.attn_scale)
    ratio = stages["q_tempered"][0, 0] / stages["q_rotated"][0, 0]  # (N, Dk): each row one factor
    late = temperature_scales(np.array([8191, 8192, 32767, 131071]), FLOOR_SCALE, ATTN_SCALE)
    early = temperature_scales(np.arange(demo.tokens) - 1, on.floor_scale, on.attn_scale)  # floor(p / f)
    last = np.arange(demo.tokens - 2, demo.tokens)  # a decode step of two queries at the end
    restarted = temperature_scales(last - last[0], on.floor_scale, on.attn_scale)
    return Explanation(
        f"{FIELD}=True, floor_scale, attn_scale, {OFFSET} (Llama 4: 1, on its NoPE layers, rope=None; Mistral 4: 0)",
        f"q_i <- q_i * (1 + attn_scale * log1p(floor((p_i + {OFFSET}) / floor_scale))), p_i with the cache offset",
        "on the queries after rotary and the QK-norm after it, before the scores (keys untouched; under MLA both "
        "query parts, nope and rope)",
        [
            (
                "Hugging Face",
                "Llama4TextAttention: attn_scales from arange(N) + cache.get_seq_length(), not position_ids",
            ),
            ("Hugging Face config", "attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1"),
            (
                "Hugging Face",
                "Mistral4Attention: get_llama_4_attn_scale(position_ids, rope_parameters['llama_4_scaling_beta'], "
                "rope_parameters['original_max_position_embeddings']) on [q_nope | q_rot]: floor_offset=0",
            ),
        ],
        [
            f"with floor_scale = {on.floor_scale:g} and attn_scale = {on.attn_scale:g} the factors of positions "
            f"0..{demo.tokens - 1} are {numbers(scales, 4)} (the stage's rows: {numbers(ratio[:, 0], 4)}); "
            f"Llama 4's defaults give {numbers(late, 4)} at positions 8191, 8192, 32767, 131071",
            f"positions not offset by the cache restart at 0 on every decode step: a step of queries at positions "
            f"{last[0]}, {last[1]} gets {numbers(restarted, 4)} instead of {numbers(scales[last], 4)}; "
            f"floor(p / floor_scale) for floor((p + 1) / floor_scale) gives {numbers(early, 4)} for positions "
            f"0..{demo.tokens - 1}",
            f"Mistral 4's floor(p / floor_scale) (floor_offset 0) steps one position later than Llama 4's: "
            f"{numbers(early, 4)} for positions 0..{demo.tokens - 1}: Llama 4's formula in a Mistral 4 port steps "
            "up one position too early",
        ],
    )


ENTRY = Variant(
    name="temperature",
    summary="Llama 4's NoPE layers and Mistral 4: each query times 1 + attn_scale * log1p(floor((p + floor_offset) "
    "/ floor_scale)) (floor_offset 1: Llama 4, 0: Mistral 4)",
    fields=(FIELD, "floor_scale", "attn_scale", OFFSET),
    config_fields=(
        ConfigField(FIELD, False, "bool"),
        ConfigField("floor_scale", FLOOR_SCALE, "float"),
        ConfigField("attn_scale", ATTN_SCALE, "float"),
        ConfigField(OFFSET, LLAMA4_OFFSET, "int"),
    ),
    is_on=lambda cfg: bool(getattr(cfg, FIELD)),
    validate=_validate,
    # The last step on the queries before the scores: its gradient comes right after d_scores.
    stage_specs=(
        StageSpec(
            "temperature",
            "q_tempered",
            "the queries times 1 + attn_scale * log1p(floor((p + floor_offset) / floor_scale)) (Llama 4's NoPE "
            "layers: floor_offset 1; Mistral 4: 0); only with attn_temperature_tuning",
            after="k_rotated_normed",
            like="q_rotated",
            grad_before="q_rotated_normed",
        ),
    ),
    forward=temper,
    backward=temper_vjp,
    # Through their ops object's `frameworks.ops.after_rotary`; under MLA (Mistral 4) the MLA strategies of the
    # adapters that say so apply it to both query parts (`backends._mla.QUERY_STEPS`).
    implemented_by=OUR_ADAPTERS,
    check_cases=(
        CaseSpec(
            "temperature",
            "Llama 4's NoPE layer: causal, no rotary, queries tempered by position (floor_scale 3 over 8 tokens)",
            NOPE_LIKE,
            dict(batch=2, q_tokens=8, dtypes=("float64", "float32"), seed=64),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "decode_temperature",
            "the temperature across a prefill of 4 and steps of 2: each step's factors from its cache offset",
            NOPE_LIKE,
            dict(batch=2, tokens=10, prefill=4, step=2, seed=65),
        ),
    ),
    # One elementwise product on q, against the causal layer it tunes.
    bench=BenchSpec({"causal": True, FIELD: True}, "causal", preset="forms"),
    cli=(
        switch_option("--attn-temperature-tuning", {FIELD: True}, "Llama 4's NoPE-layer query temperature", rank=12),
        value_option(
            "--floor-scale",
            "floor_scale",
            "the temperature's floor_scale (default 8192)",
            rank=13,
            needs="--attn-temperature-tuning",
            type=float,
        ),
        value_option(
            "--attn-scale",
            "attn_scale",
            "the temperature's attn_scale (default 0.1)",
            rank=14,
            needs="--attn-temperature-tuning",
            type=float,
        ),
        value_option(
            "--floor-offset",
            OFFSET,
            "what the temperature's floor adds to the position: 1 (Llama 4, the default) or 0 (Mistral 4)",
            rank=15,
            needs="--attn-temperature-tuning",
            type=int,
            choices=(LLAMA4_OFFSET, MISTRAL4_OFFSET),
        ),
    ),
    demo_on={FIELD: True, "floor_scale": 2.0, "attn_scale": 0.5},
    demo_off={FIELD: False},
    explain=explain,
    diagnose=DIAGNOSE,
)
