"""MLA's naive form in float64 (`core.variants.mla` has the entry): per-head keys and values expanded from the latent.

`head_stages` computes the stages up to ``k_rotated`` (the oracle's `core.reference.forward_stages` then scores them
as any other layer's); `head_stages_vjp` is its backward (`core.grad`). The rotary comes in as a `Rotation` of the
oracle's tables: `core.rotary` imports `core.config`, which imports this package.
"""

from __future__ import annotations

import numpy as np

from ._entry import Config
from ._shared import rms_norm, rms_norm_vjp


def _linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def _heads(merged: np.ndarray, n: int) -> np.ndarray:
    """(B, N, n*d) -> (B, n, N, d): head h owns columns h*d:(h+1)*d (a copy)."""
    B, N, width = merged.shape
    return merged.reshape(B, N, n, width // n).transpose(0, 2, 1, 3).copy()  # (B, N, n, d) view -> (B, n, N, d)


def _merge(heads: np.ndarray) -> np.ndarray:
    """The inverse of `_heads`: (B, n, N, d) -> (B, N, n*d) (a copy)."""
    B, n, N, d = heads.shape
    return heads.transpose(0, 2, 1, 3).reshape(B, N, n * d)  # (B, N, n, d) view -> (B, N, n*d) copy


class Rotation:
    """The rotary of the last ``dr`` features, from the oracle's tables (`core.rotary`, passed in: it imports us)."""

    def __init__(self, tables, apply_rotary, sign: float = 1.0):
        self.tables, self.apply, self.sign = tables, apply_rotary, sign

    def __call__(self, x: np.ndarray, side: str) -> np.ndarray:
        """``x`` (B, [H,] N, dr) turned by the query (``side="q"``) or key positions' angles."""
        t = self.tables
        cos, sin = (t.q_cos, t.q_sin) if side == "q" else (t.k_cos, t.k_sin)  # (1|B, N, dr/2)
        if x.ndim == 4:
            cos, sin = cos[:, None], sin[:, None]  # (1|B, 1, N, dr/2): broadcast over heads
        return self.apply(x, cos, self.sign * sin, t.style)

    def inverse(self) -> Rotation:
        return Rotation(self.tables, self.apply, -self.sign)


def latents(cfg: Config, p: dict, x_q, x_k, r=lambda a: a) -> dict:
    """The pre-norm projections: ``q_a`` (B, Nq, q_lora_rank) or None, ``c`` (B, Nk, R) and ``k_pe`` (B, Nk, dr)."""
    kv_a = r(_linear(x_k, p["w_kv_a"], p.get("b_kv_a")))  # (B, Nk, R + dr)
    q_a = None if p.get("w_q_a") is None else r(_linear(x_q, p["w_q_a"], p.get("b_q_a")))  # (B, Nq, Rq)
    R = cfg.kv_lora_rank
    return dict(q_a=q_a, c=kv_a[..., :R], k_pe=kv_a[..., R:])  # (B, Nk, R) view, (B, Nk, dr) view


def check_one_input(x_k, x_v) -> None:
    """MLA's keys and values are one latent of the same tokens: refuse a value input that differs from the key's."""
    if x_v.shape != x_k.shape or not np.array_equal(x_v, x_k):
        raise ValueError(
            "MLA reads keys and values from one latent of the same tokens (kv_a_proj_with_mqa): pass value=None "
            "(or value=key)"
        )


def latent_entries(cfg, p: dict, x_k, rotate: Rotation, r=lambda a: a) -> tuple[np.ndarray, np.ndarray]:
    """What the cache holds for tokens ``x_k`` (B, Nk, D): ``kv_latent`` = RMSNorm(c) (B, Nk, R), ``k_rope`` (B, Nk, dr)."""
    pre = latents(cfg, p, x_k, x_k, r)
    return r(rms_norm(pre["c"], p["kv_a_norm"], cfg.norm_eps)), r(rotate(pre["k_pe"], "k"))


def query_stages(cfg, p: dict, x_q, rotate: Rotation, r=lambda a: a) -> dict:
    """``q_latent`` (with q_lora_rank), ``q`` (B, Nq, H*Dk), ``q_heads`` and ``q_rotated`` (B, H, Nq, Dk)."""
    dn = cfg.qk_nope_head_dim
    stages = {}
    if p.get("w_q_a") is not None:
        q_a = r(_linear(x_q, p["w_q_a"], p.get("b_q_a")))  # (B, Nq, Rq)
        stages["q_latent"] = r(rms_norm(q_a, p["q_a_norm"], cfg.norm_eps))  # (B, Nq, Rq)
    q = stages["q"] = r(_linear(stages.get("q_latent", x_q), p["w_q"]))  # (B, Nq, H*Dk): q_b_proj, no bias
    q_heads = stages["q_heads"] = _heads(q, cfg.n_heads)  # (B, H, Nq, Dk)
    stages["q_rotated"] = np.concatenate([q_heads[..., :dn], r(rotate(q_heads[..., dn:], "q"))], axis=-1)
    return stages


def expand(cfg, p: dict, kv_latent, r=lambda a: a) -> tuple[np.ndarray, np.ndarray]:
    """The naive form's expansion: ``k_nope = kv_latent W_UK^T`` (B, Nk, H*dn) and ``v = kv_latent W_UV^T`` (B, Nk, H*dv)."""
    return r(_linear(kv_latent, p["w_k"])), r(_linear(kv_latent, p["w_v"]))


def head_stages(cfg, p: dict, x_q, x_k, x_v, rotate: Rotation, r=lambda a: a) -> dict:
    """The stages up to ``k_rotated`` of the naive form: per-head keys and values expanded from the latent."""
    check_one_input(x_k, x_v)
    H = cfg.n_heads
    k_pe = latents(cfg, p, x_k, x_k, r)["k_pe"]  # (B, Nk, dr), before its rotation
    kv_latent, k_rope = latent_entries(cfg, p, x_k, rotate, r)
    stages = dict(kv_latent=kv_latent, k_rope=k_rope)  # in `core.stages` order: kv_latent, k_rope, q_latent, q, ...
    query = query_stages(cfg, p, x_q, rotate, r)
    k_nope, v = expand(cfg, p, kv_latent, r)  # (B, Nk, H*dn), (B, Nk, H*dv)
    shared = (k_pe.shape[0], H, *k_pe.shape[1:])  # (B, H, Nk, dr): the one key head, read by every head
    k_heads = np.concatenate([_heads(k_nope, H), np.broadcast_to(k_pe[:, None], shared)], axis=-1)  # (B, H, Nk, Dk)
    k_rot = np.concatenate([k_heads[..., : cfg.qk_nope_head_dim], np.broadcast_to(k_rope[:, None], shared)], axis=-1)
    stages.update((name, query[name]) for name in ("q_latent", "q") if name in query)
    stages.update(k=_merge(k_heads), v=v, q_heads=query["q_heads"], k_heads=k_heads, v_heads=_heads(v, H))
    stages.update(q_rotated=query["q_rotated"], k_rotated=k_rot)  # (B, H, Nq, Dk), (B, H, Nk, Dk)
    return stages


def head_stages_vjp(cfg: Config, p: dict, fwd: dict, x_q, x_k, d_q_rot, d_k_rot, d_v_heads, rotate: Rotation, r):
    """The backward of `head_stages`: (d_x_q, d_x_k, parameter gradients by name, backward stages by name).

    The shared rotary key ``k_pe`` feeds every head: its gradient is the sum over the heads. The latent feeds
    both ``w_k`` and ``w_v``: its gradient is the sum of both products.
    """
    dn = cfg.qk_nope_head_dim
    undo = rotate.inverse()
    pre = latents(cfg, p, x_q, x_k, r)
    d_q_heads = np.concatenate([d_q_rot[..., :dn], r(undo(d_q_rot[..., dn:], "q"))], axis=-1)  # (B, H, Nq, Dk)
    d_k_heads = np.concatenate([d_k_rot[..., :dn], r(undo(d_k_rot[..., dn:], "k"))], axis=-1)  # (B, H, Nk, Dk)
    d_k_rope = r(d_k_rot[..., dn:].sum(axis=1))  # (B, Nk, dr): every head read the one key
    d_k_pe = r(undo(d_k_rope, "k"))
    d_q, d_v = _merge(d_q_heads), _merge(d_v_heads)  # (B, Nq, H*Dk), (B, Nk, H*dv)
    d_k_nope = _merge(d_k_rot[..., :dn])  # (B, Nk, H*dn)
    kv_latent = fwd["kv_latent"]
    d_kv_latent = r(d_k_nope @ p["w_k"] + d_v @ p["w_v"])  # (B, Nk, R)
    grads = dict(w_k=r(_outer(d_k_nope, kv_latent)), w_v=r(_outer(d_v, kv_latent)))
    d_c, grads["kv_a_norm"] = rms_norm_vjp(pre["c"], p["kv_a_norm"], cfg.norm_eps, d_kv_latent)
    d_kv_a = np.concatenate([d_c, d_k_pe], axis=-1)  # (B, Nk, R + dr)
    d_x_k = r(d_kv_a @ p["w_kv_a"])
    grads["w_kv_a"] = r(_outer(d_kv_a, x_k))
    if p.get("b_kv_a") is not None:
        grads["b_kv_a"] = r(d_kv_a.sum(axis=(0, 1)))
    stages = dict(d_kv_latent=d_kv_latent, d_k_rope=d_k_rope, d_q=d_q, d_k=_merge(d_k_heads), d_v=d_v)
    stages.update(d_q_heads=d_q_heads, d_k_heads=d_k_heads)
    q_in = fwd.get("q_latent", x_q)
    grads["w_q"] = r(_outer(d_q, q_in))
    d_q_in = r(d_q @ p["w_q"])
    if "q_latent" in fwd:
        stages["d_q_latent"] = d_q_in
        d_q_a, grads["q_a_norm"] = rms_norm_vjp(pre["q_a"], p["q_a_norm"], cfg.norm_eps, d_q_in)
        d_q_in = r(d_q_a @ p["w_q_a"])
        grads["w_q_a"] = r(_outer(d_q_a, x_q))
        if p.get("b_q_a") is not None:
            grads["b_q_a"] = r(d_q_a.sum(axis=(0, 1)))
    return d_q_in, d_x_k, grads, stages


def _outer(d_y, x):
    """A linear layer's weight gradient: ``dY^T X`` summed over batch and tokens, (out, in)."""
    return np.einsum("bno,bni->oi", d_y, x)
