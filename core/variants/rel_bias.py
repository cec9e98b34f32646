"""T5's learned relative position bias: ``rel_bias[bucket(p_j - p_i), h]`` added to head h's scores."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .._validate import require_positive_int
from ._diagnose import REPAIRS, DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, Explanation, ParamSpec, Variant, switch_option, value_option
from ._shared import BIAS_PLACE, additive_bias, given, relative_distances


def t5_buckets(distance: np.ndarray, buckets: int, max_distance: int, bidirectional: bool) -> np.ndarray:
    """T5's ``_relative_position_bucket`` of ``distance = p_j - p_i`` (key minus query), int64.

    Bidirectional (the encoder): half the buckets for keys after the query (``distance > 0``),
    half for the rest. Unidirectional (the decoder): future keys fall in bucket 0 with the
    query itself, past ones by how far back they are. Within a half, ``max_exact = n // 2``
    buckets hold one distance each and the rest are log-spaced up to ``max_distance``, every
    farther distance sharing the last bucket. The log is taken in float32, as T5 does, so that
    a distance whose exact logarithm lands on a bucket edge truncates as T5's does. Measured: for
    T5's own 32 buckets up to 128 float32 and float64 agree at every distance below 1000; with 6
    decoder buckets up to 7, distance 7 is an edge where they differ before the last-bucket cap.
    """
    distance = np.asarray(distance, dtype=np.int64)
    result = np.zeros(distance.shape, dtype=np.int64)
    n = buckets
    if bidirectional:
        n //= 2
        result += (distance > 0).astype(np.int64) * n
        distance = np.abs(distance)
    else:
        distance = -np.minimum(distance, 0)
    max_exact = n // 2
    is_small = distance < max_exact
    with np.errstate(divide="ignore"):  # log(0) in the small entries, which np.where discards
        ratio = np.log(distance.astype(np.float32) / np.float32(max_exact))
        scaled = ratio / np.float32(math.log(max_distance / max_exact)) * np.float32(n - max_exact)
    large = np.minimum(max_exact + np.where(is_small, 0, scaled).astype(np.int64), n - 1)
    return result + np.where(is_small, distance, large)


def relative_bias(cfg: Config, table: np.ndarray, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``table[bucket(p_j - p_i), h]``: T5's bias for every head, float64 (1|B, H, Nq, Nk)."""
    assert cfg.rel_buckets is not None
    bucket = t5_buckets(
        relative_distances(positions, kv_positions), cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional
    )  # (1|B, Nq, Nk)
    return np.moveaxis(table[bucket], -1, 1)  # (1|B, Nq, Nk, H) -> (1|B, H, Nq, Nk)


def relative_bias_vjp(cfg: Config, d_bias: np.ndarray, positions: np.ndarray, kv_positions: np.ndarray):
    """Gradient of `relative_bias`'s table: each bucket's entry sums the score gradients that read it."""
    assert cfg.rel_buckets is not None
    bucket = t5_buckets(
        relative_distances(positions, kv_positions), cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional
    )  # (1|B, Nq, Nk)
    bucket = np.broadcast_to(bucket[:, None], d_bias.shape)  # (B, H, Nq, Nk)
    heads = np.broadcast_to(np.arange(cfg.n_heads)[None, :, None, None], d_bias.shape)
    d_table = np.zeros((cfg.rel_buckets, cfg.n_heads), dtype=d_bias.dtype)
    np.add.at(d_table, (bucket.ravel(), heads.ravel()), d_bias.ravel())
    return d_table


def _forward(cfg: Config, p, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    return relative_bias(cfg, p["rel_bias"], positions, kv_positions)  # the registry's bias step (`ScoreStep`)


def _backward(cfg: Config, d_biased: np.ndarray, positions: np.ndarray, kv_positions: np.ndarray) -> dict:
    return {"rel_bias": relative_bias_vjp(cfg, d_biased, positions, kv_positions)}


def _validate(cfg: Config) -> dict:
    """T5's bucket function needs exact buckets below a log-spaced range that reaches max_distance."""
    buckets, max_distance, bidirectional = cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional
    if not isinstance(bidirectional, bool):
        raise TypeError(f"MHAConfig.rel_bidirectional must be a bool, got {bidirectional!r}")
    require_positive_int("rel_max_distance", max_distance)
    if buckets is None:
        return {}
    require_positive_int("rel_buckets", buckets)
    # Bidirectional: half the buckets per sign. Half of those (max_exact) are one distance each,
    # the rest log-spaced from max_exact to max_distance, so both halves need at least one bucket.
    per_side = buckets // 2 if bidirectional else buckets
    max_exact = per_side // 2
    if max_exact < 1 or (bidirectional and buckets % 2):
        need = "an even number of at least 4" if bidirectional else "at least 2"
        raise ValueError(
            f"MHAConfig.rel_buckets must be {need} (T5's buckets: half exact distances, half log-spaced"
            f"{', per sign' if bidirectional else ''}), got {buckets}"
        )
    if max_distance <= max_exact:
        raise ValueError(
            f"MHAConfig.rel_max_distance must exceed the {max_exact} exact-distance buckets "
            f"(rel_buckets={buckets}), got {max_distance}"
        )
    return {}


def _bucket_edges(buckets: int, max_distance: int) -> list[tuple[int, float, float]]:
    """(distance, T5's float32 log-position, the float64 one) where the exact log-position is a whole number.

    The log-position ``log(d / max_exact) / log(max_distance / max_exact) * (n - max_exact)`` of a past
    distance d (bidirectional halves, n = buckets / 2) is truncated to its bucket; on a whole number a
    last-bit rounding down moves d to the bucket below.
    """
    n = buckets // 2
    max_exact = n // 2
    d = np.arange(max_exact + 1, max_distance)
    f64 = np.log(d / max_exact) / math.log(max_distance / max_exact) * (n - max_exact)
    f32 = (
        np.log(d.astype(np.float32) / np.float32(max_exact))
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(n - max_exact)
    )
    whole = np.abs(f64 - np.round(f64)) < 1e-9
    return [(int(a), float(b), float(c)) for a, b, c in zip(d[whole], f32[whole], f64[whole], strict=True)]


def explain(demo) -> Explanation:
    distances = np.arange(-demo.tokens, demo.tokens + 1)  # p_j - p_i
    encoder = t5_buckets(distances, 32, 128, True)
    decoder = t5_buckets(distances, 32, 128, False)
    edges = "; ".join(f"d = {d}: {v32!r} in float32, {v64!r} in float64" for d, v32, v64 in _bucket_edges(32, 128))
    return Explanation(
        "rel_buckets, rel_max_distance, rel_bidirectional",
        "s_h <- s_h + rel_bias[bucket(p_j - p_i), h], T5's _relative_position_bucket",
        f"{BIAS_PLACE} (with ALiBi)",
        [
            ("Hugging Face config", "relative_attention_num_buckets = 32, relative_attention_max_distance = 128 (T5)"),
            (
                "Hugging Face",
                "relative_attention_bias = Embedding(buckets, n_heads) in layer 0, shared; T5 has scale 1",
            ),
            ("Hugging Face", "bidirectional = not is_decoder: the encoder both ways, the decoder past keys only"),
        ],
        [
            f"32 buckets, max distance 128, p_j - p_i = {distances[0]} .. {distances[-1]}: encoder buckets "
            f"{[int(b) for b in encoder]}, decoder {[int(b) for b in decoder]}",
            f"T5 takes the logarithm in float32; at the bucket edges, where the exact log-position is a whole "
            f"number, it is {edges}: a log that rounds one last bit down puts that distance in the bucket below",
            "the distance is key minus query (memory_position - context_position); query minus key exchanges the "
            "encoder's halves and puts every past key of the decoder in bucket 0",
        ],
    )


# The T5 decoder's layer (causal, past distances only, no scaling): the check case and the decode case read it.
T5_DECODER = dict(
    d_model=16,
    n_heads=4,
    d_k=3,
    bias=False,
    scale=1.0,
    causal=True,
    rel_buckets=6,
    rel_max_distance=7,
    rel_bidirectional=False,
)


# -- diagnose: the distance measured query minus key -------------------------------------------------------------
def mirror_relative_buckets(cfg: Config, params):
    """T5's table for code that buckets p_i - p_j: its two halves exchanged (bidirectional buckets; self-inverse).

    With n = rel_buckets / 2, distance d > 0 falls in bucket n + f(d) and -d in f(d), while
    d = 0 is bucket 0 either way; so bucket x and bucket n + x trade places for x = 1 .. n-1
    (`diagnose.repairs` has it).
    """
    n = cfg.rel_buckets // 2
    order = np.arange(cfg.rel_buckets)
    order[1:n], order[n + 1 :] = np.arange(n + 1, 2 * n), np.arange(1, n)
    return replace(params, rel_bias=params.rel_bias[order])  # (buckets, H) rows exchanged, copy


_FIX = (
    "T5 buckets relative_position = memory_position - context_position (key minus query, p_j - p_i) in "
    "_relative_position_bucket"
)


def _simulated_bias(cfg: Config, p, positions, kv_positions, mistake):
    distance = relative_distances(positions, kv_positions)  # (1|B, Nq, Nk), p_j - p_i
    measured = -distance if mistake == "reversed" else distance
    bucket = t5_buckets(measured, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)  # (1|B, Nq, Nk)
    return np.moveaxis(p.rel_bias[bucket], -1, 1)  # (1|B, Nq, Nk, H) -> (1|B, H, Nq, Nk)


def _planted_bias(cfg: Config, params, q_tokens: int, kv_tokens: int, mistake):
    i, j = np.arange(q_tokens)[:, None], np.arange(kv_tokens)[None, :]
    relative = (i - j) if mistake == "reversed" else (j - i)  # memory minus context in T5
    bucket = t5_buckets(relative, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)  # (Nq, Nk)
    return params.rel_bias[bucket].transpose(2, 0, 1)  # (Nq, Nk, H) -> (H, Nq, Nk)


DIAGNOSE = DiagnoseSpec(
    rank=70,
    causes=(
        DiagnoseCause(
            "rel_bias",
            "reversed",
            "buckets of p_i - p_j (query minus key): future and past exchanged",
            f"{_FIX}; or feed {REPAIRS}.mirror_relative_buckets(cfg, params), the table with its halves exchanged",
            when=lambda cfg: cfg.rel_bidirectional,
            repair=lambda cfg, p, m: (mirror_relative_buckets(cfg, p), m),
        ),
        DiagnoseCause(
            "rel_bias",
            "reversed",
            "buckets of p_i - p_j (query minus key): every past key in bucket 0",
            _FIX,
            when=lambda cfg: not cfg.rel_bidirectional,
        ),
    ),
    mistakes=(PlantedMistake("t5 buckets reversed", "rel_bias", "relative_position = query - key", "reversed"),),
    # T5's relative buckets: the encoder (both directions, no scale) and the decoder (past only, causal), with
    # d_k = 4 (square projections: the transposed-weight bugs run).
    settings=(
        ("t5-encoder", dict(d_model=16, n_heads=4, bias=False, scale=1.0, rel_buckets=8, rel_max_distance=5)),
        ("t5-decoder", dict(T5_DECODER, d_k=None)),
    ),
    simulated=SimulatedSteps(bias=_simulated_bias),
    planted=PlantedSteps(bias=_planted_bias),
    regroup_heads=lambda cfg, params, order: {"rel_bias": params.rel_bias[:, order]},  # (buckets, H) columns
)


ENTRY = Variant(
    name="rel_bias",
    summary="T5's learned relative position buckets added to the scores",
    **given("rel_buckets", "rel_max_distance", "rel_bidirectional"),
    validate=_validate,
    # T5 bucket biases 0.5 N(0, 1).
    params=(
        ParamSpec(
            "rel_bias",
            "rel_buckets",
            lambda cfg: None if cfg.rel_buckets is None else (cfg.rel_buckets, cfg.n_heads),
            centre=0.0,
            spread=0.5,
            head_axis=1,  # one column per query head
        ),
    ),
    **additive_bias("rel_bias[bucket(p_j - p_i), h] (rel_buckets)"),
    forward=_forward,
    backward=_backward,
    check_cases=(
        CaseSpec(
            "t5_encoder",
            "T5 encoder: learned bidirectional relative position buckets (8 buckets, max distance 5), no scaling",
            dict(d_model=16, n_heads=4, d_k=5, bias=False, scale=1.0, rel_buckets=8, rel_max_distance=5),
            dict(q_tokens=9, dtypes=("float64", "float32"), seed=28),
        ),
        CaseSpec(
            "t5_decoder",
            "T5 decoder: causal, past distances only (6 buckets, max distance 7), no scaling",
            T5_DECODER,
            dict(q_tokens=10, dtypes=("float64",), seed=29),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "rel_bias",
            "T5 decoder's relative position buckets (causal, 6 buckets, max distance 7), no scaling",
            T5_DECODER,
            dict(tokens=11, prefill=3, seed=116),
        ),
    ),
    bench=BenchSpec({"rel_buckets": 32, "rel_max_distance": 128}, "plain"),  # T5's own
    cli=(
        value_option(
            "--rel-buckets", "rel_buckets", "T5's relative position buckets (params.rel_bias)", rank=70, type=int
        ),
        value_option(
            "--rel-max-distance",
            "rel_max_distance",
            "T5's max distance (default 128)",
            rank=71,
            needs="--rel-buckets",
            type=int,
        ),
        switch_option(
            "--rel-decoder",
            {"rel_bidirectional": False},
            "T5's decoder buckets: past keys only",
            rank=72,
            needs="--rel-buckets",
        ),
    ),
    demo_on={"rel_buckets": 8, "rel_max_distance": 5, "rel_bidirectional": False},
    demo_off={"rel_buckets": None, "rel_max_distance": 128, "rel_bidirectional": True},
    explain=explain,
    diagnose=DIAGNOSE,
)
