"""The matmul FLOP count of one multi-head attention forward pass.

Only the matrix products are counted (a multiply and an add = 2 FLOPs); softmax, bias,
scale and masking are left out, as is usual for attention GFLOP/s figures, because
they are a vanishing share of the work at any size worth timing. With

    B batch, Nq query tokens, Nk key/value tokens, D = d_model,
    kdim/vdim the widths of the key/value inputs (cross-attention; D for self-attention),
    H query heads, Hkv key/value heads (GQA/MQA; H for plain MHA),
    Dk the per-head query/key width, Dv the per-head value width,

the count is

    2·B·(Nq·D·H·Dk + Nk·kdim·Hkv·Dk + Nk·vdim·Hkv·Dv + Nq·H·Dv·D)    projections q, k, v, out
  + 2·B·H·Nq·Nk·(Dk + Dv)                                             scores QKᵀ and weights·V

For self-attention with H·Dk = H·Dv = D (and Hkv = H) this is the familiar
``8·B·N·D² + 4·B·N²·D``. Every query head does its own score and weighted-sum products
even under GQA (the kv heads are shared, the products are not), so the attention term
uses H while the k/v projections use Hkv. A causal mask is not subtracted: the dense
products are computed anyway by every unfused implementation; a fused kernel that skips
masked blocks shows up with a higher GFLOP/s than the work it really did.
"""

from __future__ import annotations

from .pinning import require_positive_int


def attention_matmul_flops(
    *,
    batch: int,
    q_tokens: int,
    kv_tokens: int,
    d_model: int,
    heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    kdim: int,
    vdim: int,
) -> int:
    """Matmul FLOPs of one forward pass (see the module docstring for the formula)."""
    sizes = dict(
        batch=batch, q_tokens=q_tokens, kv_tokens=kv_tokens, d_model=d_model, heads=heads,
        kv_heads=kv_heads, d_k=d_k, d_v=d_v, kdim=kdim, vdim=vdim,
    )  # fmt: skip
    for name, value in sizes.items():
        require_positive_int(name, value)
    projections = (
        q_tokens * d_model * heads * d_k  # X_q (Nq, D) @ W_q^T (D, H·Dk)
        + kv_tokens * kdim * kv_heads * d_k  # X_k (Nk, kdim) @ W_k^T (kdim, Hkv·Dk)
        + kv_tokens * vdim * kv_heads * d_v  # X_v (Nk, vdim) @ W_v^T (vdim, Hkv·Dv)
        + q_tokens * heads * d_v * d_model  # context (Nq, H·Dv) @ W_o^T (H·Dv, D)
    )
    attention = heads * q_tokens * kv_tokens * (d_k + d_v)  # per head: Q Kᵀ, then weights @ V
    return 2 * batch * projections + 2 * batch * attention


def config_matmul_flops(cfg, batch: int, q_tokens: int, kv_tokens: int | None = None) -> int:
    """The same count for an `MHAConfig` (kv_tokens defaults to q_tokens: self-attention)."""
    return attention_matmul_flops(
        batch=batch,
        q_tokens=q_tokens,
        kv_tokens=q_tokens if kv_tokens is None else kv_tokens,
        d_model=cfg.d_model,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        d_k=cfg.d_k,
        d_v=cfg.d_v,
        kdim=cfg.kdim,
        vdim=cfg.vdim,
    )


def gemm_flops(m: int, k: int, n: int) -> int:
    """FLOPs of one (m, k) @ (k, n) product."""
    return 2 * require_positive_int("m", m) * require_positive_int("k", k) * require_positive_int("n", n)


# Forward+backward ("fwdbwd") cells count 3x the forward's matrix products: every forward
# product Y = A @ B has two backward products of the same size, dA = dY @ B.T and
# dB = A.T @ dY. (Products that need no gradient, e.g. dX of an input nobody asked about,
# are computed anyway by every implementation here: run_vjp returns every input gradient.)
FWD_BWD_FLOP_FACTOR = 3
MODES = ("fwd", "fwdbwd")


def mode_flops(forward_flops: int, mode: str) -> int:
    """The FLOPs of one timed call in ``mode``: the forward's count, or 3x it for forward+backward."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    return forward_flops * (FWD_BWD_FLOP_FACTOR if mode == "fwdbwd" else 1)
