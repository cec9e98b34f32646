"""The variants' steps of the simulated pipeline (`simulate`), each with the mistakes people make in it.

`simulate` calls these at the places `core.variants` gives (its docstring has the order):
the projection QK-norm before the head split, the head QK-norm after it, the rotary
frequencies, the softcap and the score biases, the window in the mask, the softcap moved
after the mask, the softmax with the sinks and a sink that adds a value. Each reads the
configuration's variant and the `simulate.Bug` knob that says what a candidate does instead:

- ``qk_norm``: where the candidate normalises, ``"head"`` or ``"projection"``, when that is not
  ``cfg.qk_norm``. It holds the spec's weights: a ``(d_k,)`` head weight is tiled over the heads
  to normalise the projection; a projection weight is cut into each head's slice.
- ``rope_scaling``: the rope_type the candidate scales with: ``"none"`` (the plain frequencies)
  or ``"linear"`` with the same factor (`mistaken_rope_scaling`).
- ``softcap``: ``"dropped"`` or ``"after_mask"`` (blocked scores become ``c*tanh(-inf) = -c``).
- ``alibi``: ``"power_of_two"`` (the slopes ``2**(-8k/H)`` for a head count that is not a power
  of two) or ``"sign"`` (``m_h (p_i - p_j)``).
- ``rel_direction``: T5's buckets of ``p_i - p_j`` (query minus key) instead of ``p_j - p_i``.
- ``window``: ``"one_more"`` (W + 1 keys: FlashAttention's ``window_size=(W, 0)`` read as W
  keys) or ``"future"`` (causal only: the W keys from the query's own forward, so with the
  causal mask only the diagonal is left).
- ``sinks``: ``"ignored"`` (the plain softmax) or ``"value"`` (the sink's share of each row is
  given to the first key's value, a sink token with a value vector, instead of discarded).

Positions are the defaults ``0 .. N-1`` of queries and keys (the probes pass none).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.rope_scaling import scaled_frequencies
from mha_rosetta.core.rotary import inverse_frequencies, rotated_dims
from mha_rosetta.core.variants import alibi_slopes, relative_distances, rms_norm, softcap, t5_buckets


def _norm_place(cfg: MHAConfig, bug) -> str | None:
    return cfg.qk_norm if bug.qk_norm is None else bug.qk_norm


def projection_normed(cfg: MHAConfig, p: MHAParams, q, k, bug):
    """q (B, Nq, H*Dk), k (B, Nk, Hkv*Dk) after a projection RMSNorm, if the candidate takes one there."""
    if _norm_place(cfg, bug) != "projection":
        return q, k
    w_q, w_k = p.q_norm, p.k_norm
    if cfg.qk_norm == "head":  # the mistake: the one (d_k,) weight tiled over the heads
        w_q, w_k = np.tile(w_q, cfg.n_heads), np.tile(w_k, cfg.n_kv_heads)  # (H*Dk,), (Hkv*Dk,)
    return rms_norm(q, w_q, cfg.norm_eps), rms_norm(k, w_k, cfg.norm_eps)


def head_normed(cfg: MHAConfig, p: MHAParams, q_h, k_h, bug):
    """q_h (B, H, Nq, Dk), k_h (B, Hkv, Nk, Dk) after a per-head RMSNorm, if the candidate takes one there."""
    if _norm_place(cfg, bug) != "head":
        return q_h, k_h
    w_q, w_k = p.q_norm, p.k_norm
    if cfg.qk_norm == "projection":  # the mistake: each head's slice of the projection weight
        w_q = w_q.reshape(cfg.n_heads, 1, cfg.d_k)  # (H, 1, Dk) view, broadcast over tokens
        w_k = w_k.reshape(cfg.n_kv_heads, 1, cfg.d_k)  # (Hkv, 1, Dk) view
    return rms_norm(q_h, w_q, cfg.norm_eps), rms_norm(k_h, w_k, cfg.norm_eps)


def mistaken_rope_scaling(cfg: MHAConfig, rope_type: str) -> dict | None:
    """The rope_scaling a candidate with the wrong type uses: None for ``"none"``, else ``rope_type`` with cfg's factor."""
    if rope_type == "none":
        return None
    assert cfg.rope_scaling is not None and rope_type == "linear"
    return {"rope_type": "linear", "factor": cfg.rope_scaling["factor"]}


def scaled_rotary_frequencies(cfg: MHAConfig, seq_len: int, bug) -> tuple[np.ndarray, float]:
    """(inv_freq (r/2,), the factor on cos and sin) the candidate rotates with."""
    scaling = cfg.rope_scaling if bug.rope_scaling is None else mistaken_rope_scaling(cfg, bug.rope_scaling)
    if scaling is None:
        return inverse_frequencies(rotated_dims(cfg), cfg.rope_base), 1.0
    return scaled_frequencies(rotated_dims(cfg), cfg.rope_base, scaling, seq_len)


def _positions(q_tokens: int, kv_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(q_tokens)[None], np.arange(kv_tokens)[None]  # (1, Nq), (1, Nk)


def capped_and_biased(cfg: MHAConfig, p: MHAParams, scores, bug):
    """(B, H, Nq, Nk) scores after the softcap (unless dropped or moved after the mask) and ALiBi / T5's bias."""
    Nq, Nk = scores.shape[-2:]
    if cfg.softcap is not None and bug.softcap is None:
        scores = softcap(scores, cfg.softcap)
    positions, kv_positions = _positions(Nq, Nk)
    distance = relative_distances(positions, kv_positions)  # (1, Nq, Nk), p_j - p_i
    if cfg.alibi:
        if bug.alibi == "power_of_two":
            slopes = 2.0 ** (-8.0 * np.arange(1, cfg.n_heads + 1) / cfg.n_heads)  # (H,), right for 2**k heads only
        else:
            slopes = alibi_slopes(cfg.n_heads)  # (H,)
        sign = -1.0 if bug.alibi == "sign" else 1.0
        scores = scores + sign * slopes[None, :, None, None] * distance[:, None]  # (1, H, Nq, Nk) broadcast
    if cfg.rel_buckets is not None:
        measured = -distance if bug.rel_direction else distance
        bucket = t5_buckets(measured, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)  # (1, Nq, Nk)
        scores = scores + np.moveaxis(p.rel_bias[bucket], -1, 1)  # (1, Nq, Nk, H) -> (1, H, Nq, Nk)
    return scores


def capped_after_mask(cfg: MHAConfig, masked, bug):
    """The softcap a candidate applies after the mask: a blocked score becomes -c, not -inf."""
    if bug.softcap == "after_mask":
        return softcap(masked, cfg.softcap)
    return masked


def window_allowed(cfg: MHAConfig, q_tokens: int, kv_tokens: int, bug) -> np.ndarray | None:
    """The window a candidate applies, bool (1, 1, Nq, Nk), or None without a window."""
    if cfg.window is None:
        return None
    d = relative_distances(*_positions(q_tokens, kv_tokens))[:, None]  # (1, 1, Nq, Nk), p_j - p_i
    w = cfg.window + 1 if bug.window == "one_more" else cfg.window
    if bug.window == "future":
        return (d >= 0) & (d < w)
    return d > -w if cfg.causal else np.abs(d) < w


def sink_logits(cfg: MHAConfig, p: MHAParams, bug) -> np.ndarray | None:
    """The sinks the candidate's softmax reads, (H,), or None (no sinks, or ignored)."""
    return p.sinks if cfg.sinks and bug.sinks != "ignored" else None


def sink_value(cfg: MHAConfig, weights, values, bug):
    """What a sink with a value adds to the context: its share of each row times the first key's value, or 0."""
    if not (cfg.sinks and bug.sinks == "value"):
        return 0.0
    share = 1.0 - weights.sum(axis=-1, keepdims=True)  # (B, H, Nq, 1): the sink's weight
    return share * values[:, :, :1]  # (B, H, Nq, Dv)
