"""The variants of 2024-26 attention, each as one NumPy formula the oracle and the backends share.

Where each sits in the score pipeline (`MHAConfig`'s docstring has the fields)::

    q, k = x @ w.T + b                               (bias="qkv": no b_o later)
    q, k = RMSNorm(q), RMSNorm(k)                    qk_norm: "projection" before the head split,
                                                     "head" after it; stages q_normed / k_normed
    q, k = rotary(q), rotary(k)                      rope_scaling changes the frequencies only
    s    = scale * q @ k.T                           stage scores
    s    = c * tanh(s / c)                           softcap; stage capped_scores
    s    = s + m_h (p_j - p_i) + rel_bias[bucket]    alibi, rel_buckets; stage biased_scores
    s    = s where allowed else -inf                 causal, window, the user's mask; masked_scores
    a    = exp(s) / (exp(sink_h) + sum_k exp(s_k))   sinks (softmax_with_sinks); stage weights

Every function here is float64 NumPy, has no state, and is what `reference_stages` calls;
the backends compute the same numbers in their own frameworks and conventions.
"""

from __future__ import annotations

import math

import numpy as np

from .config import MHAConfig


# -- QK-norm ------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2, last axis) + eps) * weight``: RMSNorm over the last axis (a new array)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rms_norm_vjp(x: np.ndarray, weight: np.ndarray, eps: float, d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d_x, d_weight summed over every leading axis) of `rms_norm` for the cotangent ``d_y``.

    With ``r = (mean(x**2) + eps) ** -1/2`` and ``g = d_y * weight``:
    ``d_x = r g - x r**3 mean(g x)`` (the mean over the normalised axis), ``d_weight = sum(d_y x r)``.
    """
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = d_y * weight
    d_x = r * g - x * r**3 * np.mean(g * x, axis=-1, keepdims=True)
    d_weight = (d_y * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return d_x, d_weight


# -- softcap ------------------------------------------------------------------------------
def softcap(scores: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(scores / cap)``: every score pressed into (-cap, cap), nearly unchanged near 0."""
    return cap * np.tanh(scores / cap)


# -- ALiBi --------------------------------------------------------------------------------
def alibi_slopes(n_heads: int) -> np.ndarray:
    """BLOOM's ``_get_alibi_slopes``: head h's slope m_h, float64 ``(n_heads,)``.

    For a power of two n the slopes are the geometric series ``2**(-8 k / n)``, k = 1..n.
    Otherwise the first ``c = 2**floor(log2 n)`` heads take the series for c, and the
    remaining ``n - c`` heads take every other term (the odd ones) of the series for 2c:
    the interleaved second series. 6 heads: the 4-head series, then terms 1 and 3 of the 8-head one.
    """
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))  # 2**(-8/closest)
    slopes = base ** np.arange(1, 1 + closest, dtype=np.float64)
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))  # 2**(-4/closest)
        remaining = min(closest, n_heads - closest)
        slopes = np.concatenate([slopes, extra_base ** np.arange(1, 1 + 2 * remaining, 2, dtype=np.float64)])
    return slopes


def relative_distances(positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``p_j - p_i``: (1|B, Nq) and (1|B, Nk) int positions -> (1|B, Nq, Nk), key minus query."""
    return kv_positions[:, None, :] - positions[:, :, None]


def alibi_bias(n_heads: int, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``m_h * (p_j - p_i)``: float64 (1|B, H, Nq, Nk); zero on the diagonal, negative for past keys."""
    distance = relative_distances(positions, kv_positions).astype(np.float64)  # (1|B, Nq, Nk)
    return alibi_slopes(n_heads)[None, :, None, None] * distance[:, None]


# -- T5 relative buckets ------------------------------------------------------------------
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


def relative_bias(cfg: MHAConfig, table: np.ndarray, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``table[bucket(p_j - p_i), h]``: T5's bias for every head, float64 (1|B, H, Nq, Nk)."""
    assert cfg.rel_buckets is not None
    bucket = t5_buckets(
        relative_distances(positions, kv_positions), cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional
    )  # (1|B, Nq, Nk)
    return np.moveaxis(table[bucket], -1, 1)  # (1|B, Nq, Nk, H) -> (1|B, H, Nq, Nk)


def relative_bias_vjp(cfg: MHAConfig, d_bias: np.ndarray, positions: np.ndarray, kv_positions: np.ndarray):
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


def score_bias(cfg: MHAConfig, rel_table, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray | None:
    """What ALiBi and T5's relative bias add to the scores, (1|B, H, Nq, Nk) float64, or None if neither is on."""
    bias = None
    if cfg.alibi:
        bias = alibi_bias(cfg.n_heads, positions, kv_positions)
    if cfg.rel_buckets is not None:
        rel = relative_bias(cfg, rel_table, positions, kv_positions)
        bias = rel if bias is None else bias + rel
    return bias


# -- window -------------------------------------------------------------------------------
def window_allowed(window: int, causal: bool, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """The sliding window on positions, bool (1|B, 1, Nq, Nk): W keys including the query's own.

    Causal: ``p_i - W < p_j`` (the causal mask adds ``p_j <= p_i``); otherwise two-sided,
    ``|p_i - p_j| < W``.
    """
    distance = relative_distances(positions, kv_positions)  # (1|B, Nq, Nk), p_j - p_i
    allowed = distance > -window if causal else np.abs(distance) < window
    return allowed[:, None]


# -- softmax, and sinks -------------------------------------------------------------------
def softmax_with_empty_rows(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis where rows of all -inf give zeros instead of NaN."""
    row_max = np.max(scores, axis=-1, keepdims=True)
    empty = np.isneginf(row_max)
    # Subtracting the row maximum keeps exp() in range for logits of any size.
    shifted = scores - np.where(empty, 0.0, row_max)
    exp = np.exp(shifted)
    total = np.sum(exp, axis=-1, keepdims=True)
    return np.where(empty, 0.0, exp / np.where(empty, 1.0, total))


def softmax_with_sinks(scores: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis of (B, H, Nq, Nk) scores, with head h's sink in every denominator.

    ``a_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik))``: the sink takes a share of each row and
    gives nothing back, so a row sums to less than 1. A row with no allowed key is all zeros
    (the spec's rule, with or without sinks). ``sinks`` None is the plain softmax.
    """
    if sinks is None:
        return softmax_with_empty_rows(scores)
    sink = np.broadcast_to(np.asarray(sinks, dtype=scores.dtype)[None, :, None, None], (*scores.shape[:-1], 1))
    row_max = np.maximum(np.max(scores, axis=-1, keepdims=True), sink)  # finite: the sink always is
    exp = np.exp(scores - row_max)
    return exp / (np.exp(sink - row_max) + np.sum(exp, axis=-1, keepdims=True))
