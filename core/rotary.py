"""Rotary position embeddings (RoPE): the frequencies, the two pairings, and the converter between them.

A rotary embedding turns each pair of features ``(a, b)`` of a query or key head by an
angle that grows with the token's position::

    theta_i = position * base ** (-2 i / r)        i = 0 .. r/2 - 1, r = cfg.rope_dims
    (a, b) -> (a cos theta_i - b sin theta_i,  b cos theta_i + a sin theta_i)

so that ``<R(m) q, R(n) k>`` depends on ``m - n`` only. The two conventions in use differ
only in *which* features form pair ``i``:

* ``"half"`` (rotate_half: Hugging Face Llama, GPT-NeoX): features ``i`` and ``i + r/2``;
* ``"interleaved"`` (Meta Llama, GPT-J): features ``2i`` and ``2i + 1``.

Features ``r .. d_k - 1`` are not rotated (partial rotary, ``cfg.rope_dims < d_k``).

Because a dot product does not care in which order its features come, moving each
interleaved pair to the slots of the matching half pair in the rows of ``w_q`` and
``w_k`` (and their biases) makes "half" on the moved weights compute the same scores as
"interleaved" on the originals. That is the permutation Hugging Face's conversion of
Meta's checkpoints applies to ``wq`` and ``wk``::

    w.view(n_heads, d_k // 2, 2, d_in).transpose(1, 2).reshape(n_heads * d_k, d_in)

`rope_permutation`, `to_rotate_half_params` and `to_interleaved_params` are that
permutation, its inverse and their application. NumPy only; every table is float64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import ROPE_STYLES, MHAConfig, require_config
from .params import MHAParams, validate_params
from .rope_scaling import scaled_frequencies


def inverse_frequencies(rope_dims: int, base: float) -> np.ndarray:
    """``base ** (-2i / rope_dims)`` for ``i = 0 .. rope_dims/2 - 1``: the turn per position of each pair."""
    return base ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)  # (r/2,)


def rotary_pairs(style: str, rope_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, second): feature ``first[i]`` turns together with feature ``second[i]``."""
    i = np.arange(rope_dims // 2)
    if style == "half":
        return i, i + rope_dims // 2
    if style == "interleaved":
        return 2 * i, 2 * i + 1
    raise ValueError(f"rotary style must be one of {', '.join(map(repr, ROPE_STYLES))}, got {style!r}")


@dataclass(frozen=True)
class RotaryTables:
    """cos and sin of every (token, pair) angle, for the queries and for the keys (float64).

    ``q_cos``/``q_sin`` are ``(1|B, Nq, r/2)``, ``k_cos``/``k_sin`` ``(1|B, Nk, r/2)``: one
    row per token, one column per pair (the leading axis is 1 when every batch item has
    the same positions). Every backend takes these same numbers and applies them in its
    own layout and pairing.
    """

    style: str
    rope_dims: int
    q_cos: np.ndarray
    q_sin: np.ndarray
    k_cos: np.ndarray
    k_sin: np.ndarray


def rotated_dims(cfg: MHAConfig) -> int:
    """``cfg.rope_dims``, which `MHAConfig` resolves to an int exactly when rope is on."""
    if cfg.rope_dims is None:
        raise ValueError(f"rotary needs MHAConfig.rope='half' or 'interleaved', got rope={cfg.rope!r}")
    return cfg.rope_dims


def frequencies(cfg: MHAConfig, seq_len: int) -> tuple[np.ndarray, float]:
    """(inv_freq ``(r/2,)``, attention factor) of ``cfg``: `inverse_frequencies`, or scaled by ``cfg.rope_scaling``.

    ``seq_len`` is 1 + the largest position of the call; only dynamic (NTK) scaling reads it.
    The attention factor (YaRN's) multiplies cos and sin; it is 1.0 without scaling.
    """
    if cfg.rope_scaling is None:
        return inverse_frequencies(rotated_dims(cfg), cfg.rope_base), 1.0
    return scaled_frequencies(rotated_dims(cfg), cfg.rope_base, cfg.rope_scaling, seq_len)


def angles(cfg: MHAConfig, positions: np.ndarray, seq_len: int | None = None) -> np.ndarray:
    """``positions[..., n] * inv_freq[i]``: (..., N) integer positions -> (..., N, r/2) angles.

    ``seq_len`` (dynamic rope scaling only) defaults to 1 + the largest of ``positions``.
    """
    positions = np.asarray(positions)
    seq_len = int(positions.max()) + 1 if seq_len is None else seq_len
    return positions[..., None].astype(np.float64) * frequencies(cfg, seq_len)[0]


def rotary_tables(cfg: MHAConfig, inputs) -> RotaryTables | None:
    """The tables for ``inputs`` (an `MHAInputs`: its positions and kv_positions), or None without rope.

    With YaRN's attention factor the tables hold ``factor * cos`` and ``factor * sin``: the
    rotation is then scaled, and its transpose (the backward pass) is still the same tables
    with ``sin`` negated.
    """
    if cfg.rope is None:
        return None
    seq_len = int(max(inputs.positions.max(), inputs.kv_positions.max())) + 1
    inv_freq, factor = frequencies(cfg, seq_len)  # once for queries and keys: (r/2,), a float
    q_angles = inputs.positions[..., None].astype(np.float64) * inv_freq  # (1|B, Nq, r/2)
    k_angles = inputs.kv_positions[..., None].astype(np.float64) * inv_freq  # (1|B, Nk, r/2)
    return RotaryTables(
        cfg.rope,
        rotated_dims(cfg),
        factor * np.cos(q_angles),
        factor * np.sin(q_angles),
        factor * np.cos(k_angles),
        factor * np.sin(k_angles),
    )


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate the features on the last axis of ``x`` (..., N, d_k) by tables (..., N, r/2); a new array.

    The formula of the module docstring, pair by pair; features past ``r`` pass through.
    """
    first, second = rotary_pairs(style, 2 * cos.shape[-1])
    a, b = x[..., first], x[..., second]  # (..., N, r/2) each, copies
    out = np.array(x, dtype=np.result_type(x, cos), copy=True)
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def rope_permutation(d_k: int, rope_dims: int) -> np.ndarray:
    """Row order within one head that turns interleaved weights into half weights.

    ``new_rows = old_rows[perm]``: the half pair ``(i, i + r/2)`` receives the interleaved
    pair ``(2i, 2i + 1)``, and rows past ``rope_dims`` stay where they are. For
    ``rope_dims = d_k`` this is Hugging Face's ``view(d/2, 2).transpose`` of each head.
    """
    perm = np.arange(d_k)
    half_first, half_second = rotary_pairs("half", rope_dims)
    inter_first, inter_second = rotary_pairs("interleaved", rope_dims)
    perm[half_first], perm[half_second] = inter_first, inter_second
    return perm


def _permute_heads(cfg: MHAConfig, params: MHAParams, perm: np.ndarray) -> MHAParams:
    """``params`` with the rows of every head of w_q/w_k (and b_q/b_k) reordered by ``perm``.

    QK-norm weights move with the features they scale: a per-head ``(d_k,)`` weight is one head's
    worth, a projection-wide one ``(n_heads*d_k,)`` is reordered head by head. RMSNorm's mean of
    squares does not depend on the order of the features, so the layer computes the same.
    """

    def rows(array, n_heads):  # (n_heads*Dk, ...) -> the same with each head's rows reordered
        if array is None:
            return None
        n_heads = array.shape[0] // cfg.d_k if n_heads is None else n_heads
        per_head = array.reshape(n_heads, cfg.d_k, *array.shape[1:])  # (heads, Dk, ...), view
        return per_head[:, perm].reshape(array.shape)  # (heads*Dk, ...), copy

    return dataclasses.replace(
        params,
        w_q=rows(params.w_q, cfg.n_heads),
        b_q=rows(params.b_q, cfg.n_heads),
        w_k=rows(params.w_k, cfg.n_kv_heads),
        b_k=rows(params.b_k, cfg.n_kv_heads),
        # a norm weight spans as many heads as it has d_k's: 1 per head, all of them over the projection
        q_norm=rows(params.q_norm, None),
        k_norm=rows(params.k_norm, None),
    )


def _convert(cfg: MHAConfig, params: MHAParams, source: str, target: str) -> tuple[MHAConfig, MHAParams]:
    require_config(cfg)
    if cfg.rope != source:
        raise ValueError(f"cfg.rope must be {source!r} to convert to {target!r}, got {cfg.rope!r}")
    validate_params(cfg, params)
    if getattr(cfg, "attention_k_eq_v", False):
        raise ValueError(
            f"cannot convert the rotary pairing of a layer with attention_k_eq_v=True to {target!r}: w_v is w_k, and "
            "permuting the key rows would permute the values too (the pairing changes only in the code there)"
        )
    perm = rope_permutation(cfg.d_k, rotated_dims(cfg))
    if target == "interleaved":
        perm = np.argsort(perm)  # the inverse permutation
    return dataclasses.replace(cfg, rope=target), _permute_heads(cfg, params, perm)


def to_rotate_half_params(cfg: MHAConfig, params: MHAParams) -> tuple[MHAConfig, MHAParams]:
    """Meta's interleaved weights -> Hugging Face's rotate-half weights computing the same layer.

    Returns ``(cfg with rope="half", params with permuted q/k rows)``; v and o are untouched.
    """
    return _convert(cfg, params, "interleaved", "half")


def to_interleaved_params(cfg: MHAConfig, params: MHAParams) -> tuple[MHAConfig, MHAParams]:
    """The inverse of `to_rotate_half_params`: rotate-half weights -> interleaved weights."""
    return _convert(cfg, params, "half", "interleaved")
