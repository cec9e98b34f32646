"""The passes the torch oracles run (`backends.oracles.torch` re-exports them): ``nn.MultiheadAttention``
loaded with the canonical parameters, its blocked-mask polarity and whether its fast path applies, and
``F.scaled_dot_product_attention``'s whole pass (which ``torch-best`` runs too)."""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAInputs,
    MHAParams,
    allowed_positions,
    causal_on_indices,
    to_torch_mha_state_dict,
)
from mha_rosetta.core.variants import steps_at_place

from ..torch.common import (
    bool_tensor,
    torch_device,
    torch_dtype,
)
from ..torch.variants import ScoreBias
from .torch_heads import float_score_mask, projected_heads_pass


def loaded_torch_mha(cfg: MHAConfig, params: MHAParams, dtype: str, device: str, batch_first: bool):
    """``nn.MultiheadAttention`` for ``cfg`` with the canonical parameters loaded, in eval mode (no dropout)."""
    import torch

    module = torch.nn.MultiheadAttention(
        cfg.d_model,
        cfg.n_heads,
        dropout=0.0,
        bias=cfg.bias,
        kdim=cfg.kdim,
        vdim=cfg.vdim,
        batch_first=batch_first,
        device=torch_device(device),
        dtype=torch_dtype(dtype),
    )
    state = {name: torch.from_numpy(array) for name, array in to_torch_mha_state_dict(cfg, params).items()}
    module.load_state_dict(state)  # strict: every tensor torch expects, no more (copy_ casts the dtype)
    module.eval()
    return module


def torch_blocked_mask(allowed: np.ndarray | None, batch: int, heads: int, q_tokens: int, kv_tokens: int, device: str):
    """Spec mask (True = may attend, broadcastable (1|B, 1|H, 1|Nq, Nk)) -> nn.MultiheadAttention attn_mask.

    torch wants True = blocked, shaped (Nq, Nk) for one mask shared by every batch item
    and head, else (B*H, Nq, Nk) with index b*H + h. (A pure key-padding mask could go
    to key_padding_mask (B, Nk) instead; one attn_mask covers every case the spec allows.)
    """
    if allowed is None:
        return None
    if allowed.shape[:2] == (1, 1):
        shared = np.broadcast_to(allowed[0, 0], (q_tokens, kv_tokens))  # (Nq, Nk)
        return bool_tensor(~shared, device)
    full = np.broadcast_to(allowed, (batch, heads, q_tokens, kv_tokens))  # (B, H, Nq, Nk)
    return bool_tensor(~full.reshape(batch * heads, q_tokens, kv_tokens), device)  # (B*H, Nq, Nk), copy


def fast_path_expected(cfg: MHAConfig, batch_first: bool, self_attention: bool) -> str:
    """Whether torch's documented fast-path conditions hold (a description, not a probe)."""
    reasons = []
    if not batch_first:
        reasons.append("batch_first=False")
    if not self_attention:
        reasons.append("query, key and value are not one tensor")
    if not cfg.bias:
        reasons.append("bias=False")
    if cfg.n_heads % 2:
        reasons.append("odd number of heads")
    if not cfg.is_self_attention_shaped:
        reasons.append("kdim/vdim differ from embed_dim")
    return "yes" if not reasons else "no: " + ", ".join(reasons)


def sdpa_pass(cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str):
    """The SDPA oracle's pass for these inputs: ``(forward, attn_mask, use_is_causal)``.

    ``forward(p, x_q, x_k, x_v, rec=None)`` (see `projected_heads_pass`) runs the kernel on the
    oracle's own projected, normed and rotated heads; the backward (`_prepare_vjp`)
    differentiates this same function. ``attn_mask``: the boolean mask (True = may attend),
    None with ``is_causal`` or without a mask; with ALiBi or T5's bias the kernel gets a float
    mask instead, built in the forward from ``p["rel_bias"]`` so that autograd reaches the table.
    """
    import torch.nn.functional as F

    # No user mask: is_causal says it all and lets torch pick its causal kernels, where its top-left rule
    # is the positions' (a decode step's bottom-right causality goes in the explicit mask instead).
    # A positional mask entry of core's registry (the window, Llama 4's chunks) goes in the explicit mask.
    use_is_causal = cfg.causal and inputs.mask is None and not cfg.has_score_bias and not steps_at_place(cfg, "mask")
    use_is_causal = use_is_causal and causal_on_indices(inputs)
    allowed = None if use_is_causal else allowed_positions(cfg, inputs)
    attn_mask = bool_tensor(allowed, device)  # (1|B, 1|H, Nq, Nk), True = may attend
    score_bias = ScoreBias(cfg, inputs, dtype, device) if cfg.has_score_bias else None
    gqa = {"enable_gqa": True} if cfg.n_kv_heads != cfg.n_heads else {}

    def attend(p: dict, q_rotated, k_rotated, v_heads):
        mask = attn_mask
        if score_bias is not None:  # float: the bias where allowed, -inf where blocked, (1|B, H, Nq, Nk)
            mask = float_score_mask(score_bias(p.get("rel_bias")), attn_mask, q_rotated.dtype)
        return F.scaled_dot_product_attention(
            q_rotated, k_rotated, v_heads, attn_mask=mask, is_causal=use_is_causal, scale=cfg.scale, **gqa
        )  # (B, H, Nq, Dv)

    forward = projected_heads_pass(cfg, inputs, dtype, device, attend, "F.scaled_dot_product_attention (fused)")
    return forward, attn_mask, use_is_causal


def sdpa_has_enable_gqa() -> bool:
    """torch >= 2.5 accepts enable_gqa in scaled_dot_product_attention.

    Read from the installed distribution's metadata, not by importing torch: the check's parent
    process plans the runs (this decides whether a GQA case is supported) and imports no
    framework; importing torch there cost 1.7 s of its start. A torch without metadata (built
    in place) is asked directly.
    """
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        version = torch.__version__
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (2, 5)
