"""The three ways checkpoints pack q, k and v into one tensor, as exact NumPy reshapes.

Every function works on the canonical ``(out, in)`` rows (a weight) or on a bias
``(out,)``: the packing only reorders rows, so one function serves both.

* blocks: ``[Q; K; V]``, every q row, then every k row, then every v row
  (``nn.MultiheadAttention.in_proj_weight``, timm's ``qkv``, GPT-2's ``c_attn`` along ``out``);
* per group: for each kv group ``g``, ``[q rows of the group's query heads; k_g; v_g]``
  (Megatron-LM's ``linear_qkv``);
* per head: the per-group packing with one query head per group, ``[q_h; k_h; v_h]`` for
  each head (GPT-NeoX's ``query_key_value``, which came out of Megatron-LM).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig


def pack_blocks(cfg: MHAConfig, q: np.ndarray | None, k: np.ndarray | None, v: np.ndarray | None) -> np.ndarray | None:
    """Rows ``[Q; K; V]``: ``(H*Dk + Hkv*Dk + Hkv*Dv, ...)``, a copy."""
    if q is None:
        return None
    return np.concatenate([q, k, v], axis=0)


def unpack_blocks(cfg: MHAConfig, packed: np.ndarray | None) -> tuple[np.ndarray | None, ...]:
    """Inverse of `pack_blocks`: three views of ``packed``'s rows."""
    if packed is None:
        return None, None, None
    return tuple(np.split(packed, [cfg.q_width, cfg.q_width + cfg.k_width], axis=0))


def pack_groups(cfg: MHAConfig, q: np.ndarray | None, k: np.ndarray | None, v: np.ndarray | None) -> np.ndarray | None:
    """Rows per kv group ``g``: ``[q heads g*Q:(g+1)*Q; k_g; v_g]`` with ``Q = n_heads / n_kv_heads``.

    Query head ``h`` sits in group ``h // Q``: the grouping of `MHAConfig.kv_head_of`.
    """
    if q is None:
        return None
    G, Dk, Dv = cfg.n_kv_heads, cfg.d_k, cfg.d_v
    tail = q.shape[1:]  # (in,) for a weight, () for a bias
    groups_q = q.reshape(G, cfg.group_size * Dk, *tail)  # (G, Q*Dk, ...): view
    # k and v are None exactly when q is (the three weights, or the three biases of one layer).
    groups_k = k.reshape(G, Dk, *tail)  # type: ignore[union-attr]  # (G, Dk, ...): view
    groups_v = v.reshape(G, Dv, *tail)  # type: ignore[union-attr]  # (G, Dv, ...): view
    packed = np.concatenate([groups_q, groups_k, groups_v], axis=1)  # (G, Q*Dk + Dk + Dv, ...): copy
    return packed.reshape(-1, *tail)  # (G*(Q*Dk + Dk + Dv), ...): view of the copy


def unpack_groups(cfg: MHAConfig, packed: np.ndarray | None) -> tuple[np.ndarray | None, ...]:
    """Inverse of `pack_groups` (the split Megatron-LM's attention does after its ``linear_qkv``)."""
    if packed is None:
        return None, None, None
    G, Dk, Dv = cfg.n_kv_heads, cfg.d_k, cfg.d_v
    tail = packed.shape[1:]
    q_rows = cfg.group_size * Dk
    groups = packed.reshape(G, q_rows + Dk + Dv, *tail)  # (G, Q*Dk + Dk + Dv, ...): view
    q, k, v = np.split(groups, [q_rows, q_rows + Dk], axis=1)  # (G, Q*Dk, ...), (G, Dk, ...), (G, Dv, ...)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)  # copies of the strided pieces
