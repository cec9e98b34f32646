"""Llama 4's temperature tuning on its NoPE layers: each query scaled by a factor that grows with its position.

``Llama4TextAttention`` (transformers 5.25), on a layer without rotary (``no_rope_layers[i] == 0``) and with
``attn_temperature_tuning``::

    positions = arange(seq_len) + past_seen_tokens          # the cache offset included
    attn_scales = log1p(floor((positions + 1) / floor_scale)) * attn_scale + 1
    query_states = query_states * attn_scales               # (B, N, H, d) * (B, N, 1, 1)

so ``q_i <- q_i * (1 + attn_scale * log1p(floor((p_i + 1) / floor_scale)))``, keys untouched (arXiv 2501.19399:
the softmax of a long context sharpened by ``log`` of the position). The factor is 1 for the first
``floor_scale - 1`` positions (8191 with Llama 4's defaults) and steps up at every multiple of ``floor_scale``.

The spec's stage ``q_tempered`` (B, H, Nq, Dk) sits after rotary and the QK-norm after it (where the module
multiplies), and the scores read it. Llama 4 tunes only its NoPE layers, which have no rotary and attend fully
(no chunk); the spec applies the formula wherever it is switched on (it composes with every other step), and
the ``hf-llama4`` layout's rules hold it to the NoPE layers the module tempers (`models.hf_llama4`). The
positions are `core.inputs`' (``p_i``), which on a decode step include the cache offset: the module computes
them from the cache's length, not from ``position_ids`` (left padding would shift the two apart).
"""

from __future__ import annotations

import math

import numpy as np

from .._validate import require_bool, require_positive_number
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, ConfigField, Explanation, Variant, numbers, switch_option, value_option

FIELD = "attn_temperature_tuning"
# transformers' Llama4TextConfig defaults.
FLOOR_SCALE = 8192.0
ATTN_SCALE = 0.1


def temperature_scales(positions: np.ndarray, floor_scale: float, attn_scale: float) -> np.ndarray:
    """``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (float64, the shape of ``positions``)."""
    return 1.0 + attn_scale * np.log1p(np.floor((np.asarray(positions, dtype=np.float64) + 1.0) / floor_scale))


def temper(cfg: Config, q: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``q`` (B, H, Nq, Dk) times each query position's factor; ``positions`` (1|B, Nq)."""
    scales = temperature_scales(positions, cfg.floor_scale, cfg.attn_scale)  # (1|B, Nq)
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
    return {"floor_scale": floor_scale, "attn_scale": float(attn_scale)}


# Llama 4's NoPE layer at a small size: GQA, causal, no rotary; floor_scale 3 so the factor steps inside the case.
NOPE_LIKE = dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, bias=False, floor_scale=3, attn_scale=0.5)
NOPE_LIKE[FIELD] = True


# -- diagnose: the temperature forgotten, its floor off by one, its positions not offset by the cache (decode) ------
def _positions_read(positions: np.ndarray, mistake) -> np.ndarray:
    """The positions a candidate with ``mistake`` computes the factors of: ``"not_offset"``: ``0..Nq-1`` on every call
    (a decode step's cache offset left out); ``"off_by_one"``: ``p - 1`` (``floor(p / f)`` for ``floor((p + 1) / f)``)."""
    positions = np.asarray(positions)  # (1|B, Nq)
    if mistake == "not_offset":
        return np.broadcast_to(np.arange(positions.shape[-1]), positions.shape)
    return positions - 1 if mistake == "off_by_one" else positions


def _simulated(cfg: Config, p, q, k, positions, mistake):
    """Diagnose's simulator: the spec's `temper` of the queries at the positions ``mistake`` reads; k untouched."""
    return (q if mistake == "dropped" else temper(cfg, q, _positions_read(positions, mistake))), k


def _planted(cfg: Config, params, q, k, mistake):
    """The NumPy candidate's temperature, as ``Llama4TextAttention`` writes it (queries at positions 0..Nq-1)."""
    if mistake == "dropped":
        return q, k
    cache_position = np.arange(q.shape[2])  # (Nq,)
    numerator = cache_position if mistake == "off_by_one" else cache_position + 1
    attn_scales = np.log1p(np.floor(numerator / cfg.floor_scale)) * cfg.attn_scale + 1  # (Nq,)
    return q * attn_scales[:, None], k  # (B, H, Nq, Dk) * (Nq, 1)


def _tempers(cfg: Config, q_tokens: int) -> bool:
    """Some of positions 0..q_tokens-1 has a factor other than 1 (Llama 4's floor_scale 8192 needs 8191 tokens)."""
    return bool(np.any(temperature_scales(np.arange(q_tokens), cfg.floor_scale, cfg.attn_scale) != 1.0))


def _off_by_one_shows(cfg: Config, q_tokens: int) -> bool:
    positions = np.arange(q_tokens)
    scales = temperature_scales(positions, cfg.floor_scale, cfg.attn_scale)
    return bool(np.any(temperature_scales(positions - 1, cfg.floor_scale, cfg.attn_scale) != scales))


def _unseen(cfg: Config, q_tokens: int) -> str | None:
    if not _tempers(cfg, q_tokens):
        return (
            f"the temperature is 1 at every probe position 0..{q_tokens - 1} (floor_scale {cfg.floor_scale:g}, "
            f"attn_scale {cfg.attn_scale:g}): a mistake in it cannot show here; to test it, diagnose the candidate "
            f"built with a floor_scale of at most {q_tokens} and attn_scale > 0"
        )
    return None


_FIX = (
    "multiply each query (after rotary and the QK-norm) by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), "
    "p its position with the cache offset (Llama4TextAttention on its NoPE layers; core.variants.temperature_scales)"
)
CAUSES = (
    DiagnoseCause(
        "temperature",
        "dropped",
        lambda cfg: (
            f"the temperature forgotten: no query multiplied by 1 + {cfg.attn_scale:g} * "
            f"log1p(floor((p + 1) / {cfg.floor_scale:g}))"
        ),
        _FIX,
    ),
    DiagnoseCause(
        "temperature",
        "off_by_one",
        lambda cfg: (
            f"the temperature's floor one position early: floor(p / {cfg.floor_scale:g}) where Llama 4 "
            f"has floor((p + 1) / {cfg.floor_scale:g})"
        ),
        _FIX,
    ),
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
        f"{FIELD}=True, floor_scale, attn_scale (Llama 4: on its NoPE layers, rope=None)",
        "q_i <- q_i * (1 + attn_scale * log1p(floor((p_i + 1) / floor_scale))), p_i with the cache offset",
        "on the queries after rotary and the QK-norm after it, before the scores (keys untouched)",
        [
            (
                "Hugging Face",
                "Llama4TextAttention: attn_scales from arange(N) + cache.get_seq_length(), not position_ids",
            ),
            ("Hugging Face config", "attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1"),
        ],
        [
            f"with floor_scale = {on.floor_scale:g} and attn_scale = {on.attn_scale:g} the factors of positions "
            f"0..{demo.tokens - 1} are {numbers(scales, 4)} (the stage's rows: {numbers(ratio[:, 0], 4)}); "
            f"Llama 4's defaults give {numbers(late, 4)} at positions 8191, 8192, 32767, 131071",
            f"positions not offset by the cache restart at 0 on every decode step: a step of queries at positions "
            f"{last[0]}, {last[1]} gets {numbers(restarted, 4)} instead of {numbers(scales[last], 4)}; "
            f"floor(p / floor_scale) for floor((p + 1) / floor_scale) gives {numbers(early, 4)} for positions "
            f"0..{demo.tokens - 1}",
        ],
    )


ENTRY = Variant(
    name="temperature",
    summary="Llama 4's NoPE layers: each query times 1 + attn_scale * log1p(floor((p + 1) / floor_scale))",
    fields=(FIELD, "floor_scale", "attn_scale"),
    config_fields=(
        ConfigField(FIELD, False, "bool"),
        ConfigField("floor_scale", FLOOR_SCALE, "float"),
        ConfigField("attn_scale", ATTN_SCALE, "float"),
    ),
    is_on=lambda cfg: bool(getattr(cfg, FIELD)),
    validate=_validate,
    stages=("q_tempered",),
    forward=temper,
    backward=temper_vjp,
    # Our adapters apply it in every convention (numpy, torch, jax, einops on all three, mlx, and the sharded
    # backends on their heads), forward, backward and decode, through their ops object (`frameworks.ops.after_rotary`);
    # the third-party oracles and the best paths do not claim it and refuse it by name.
    implemented_by=("numpy", "torch", "jax", "mlx"),
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
    ),
    demo_on={FIELD: True, "floor_scale": 2.0, "attn_scale": 0.5},
    demo_off={FIELD: False},
    explain=explain,
    diagnose=DIAGNOSE,
)
