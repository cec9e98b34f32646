"""The forms of 2025-26 in the torch diagnose candidate's idioms (`backends.injected_torch`'s `TORCH_STEPS` for them).

Written as ``transformers`` writes them, apart from diagnose's simulator and from the NumPy candidate's entry steps:
Llama 4's temperature (``Llama4TextAttention``: ``attn_scales`` from the cache positions) and its weightless
``Llama4TextL2Norm`` after rotary (or, planted, over a tensor-parallel shard's whole projection, vllm #16311), and
MLA's heads as ``DeepseekV3Attention`` builds them from its latents (``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``'s halves, the one shared rotary key), with the planted mistakes of `core.variants.mla_diagnose`: the
cached ``k_rot`` in the de-interleaved order of ``apply_rotary_pos_emb_interleave``, the values read at the key
head's stride (``as_strided``), ``W_UK`` read transposed. MLA's softmax scale is the entry's (a float from the
config: the mistake is which YaRN ``mscale`` is passed, not the arithmetic).

Each step takes the canonical `MHAParams` (NumPy) and the candidate's tensors; torch is imported inside them.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants import PlantedSteps, variant


def _tensor(a):
    import torch

    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def _llama4_temperature(cfg: MHAConfig, params, q, k, mistake):
    """``query_states * attn_scales``, ``attn_scales = log1p(floor((cache_position + o) / floor_scale)) * attn_scale + 1``
    with ``o`` the ``floor_offset`` (1: Llama 4, 0: Mistral 4; queries at positions 0..Nq-1); planted: never applied,
    or the other model's offset."""
    import torch

    if mistake == "dropped":
        return q, k
    cache_position = torch.arange(q.shape[2], dtype=torch.float64)  # (Nq,)
    offset = cfg.floor_offset
    numerator = cache_position + float(
        1 - offset if mistake == "off_by_one" else offset
    )  # the other form's, or its own
    attn_scales = torch.log1p(torch.floor(numerator / cfg.floor_scale)) * cfg.attn_scale + 1.0  # (Nq,)
    return q * attn_scales.view(1, 1, -1, 1), k  # (B, H, Nq, Dk) * (1, 1, Nq, 1)


def _l2_norm(x, eps):  # Llama4TextL2Norm: x * rsqrt(mean(x^2) + eps), no weight
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _llama4_qk_norm(cfg: MHAConfig, params, q, k, mistake):
    """``Llama4TextL2Norm`` of each rotated head; planted: forgotten, or over each token's whole projection."""
    if mistake == "dropped":
        return q, k
    if mistake != "across_heads":
        return _l2_norm(q, cfg.norm_eps), _l2_norm(k, cfg.norm_eps)

    def shard(x):  # (B, n, N, d) -> (B, N, n*d) normed at once -> back (a tensor-parallel shard's projection)
        B, n, N, d = x.shape
        flat = _l2_norm(x.transpose(1, 2).reshape(B, N, n * d), cfg.norm_eps)  # (B, N, n*d) copy
        return flat.view(B, N, n, d).transpose(1, 2)  # (B, n, N, d) view

    return shard(q), shard(k)


def _deepseek_rms_norm(x, weight, eps):  # DeepseekV3RMSNorm
    import torch

    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _deepseek_heads(cfg: MHAConfig, params, query, key, rotate, mistake):
    """(q (B, H, Nq, Dk), k (B, H, Nk, Dk), v (B, H, Nk, d_v)) as ``DeepseekV3Attention.forward`` builds them;
    ``rotate(x)`` turns (B, n, N, d_rope) as the candidate rotates."""
    import torch
    import torch.nn.functional as F

    H, dn, dr, dv, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.d_v, cfg.kv_lora_rank
    t = {name: _tensor(a) for name, a in params.as_dict().items()}
    B, Nq, Nk = query.shape[0], query.shape[1], key.shape[1]
    if t.get("w_q_a") is None:
        q_states = F.linear(query, t["w_q"])  # q_proj
    else:
        q_latent = _deepseek_rms_norm(F.linear(query, t["w_q_a"], t.get("b_q_a")), t["q_a_norm"], cfg.norm_eps)
        q_states = F.linear(q_latent, t["w_q"])  # q_b_proj(q_a_layernorm(q_a_proj(x)))
    q_states = q_states.view(B, Nq, H, dn + dr).transpose(1, 2)  # (B, H, Nq, Dk) view
    q_pass, q_rot = torch.split(q_states, [dn, dr], dim=-1)
    compressed_kv = F.linear(key, t["w_kv_a"], t.get("b_kv_a"))  # (B, Nk, R + dr): kv_a_proj_with_mqa
    kv_nope, k_rot = torch.split(compressed_kv, [R, dr], dim=-1)
    kv_nope = _deepseek_rms_norm(kv_nope, t["kv_a_norm"], cfg.norm_eps)  # (B, Nk, R): what the cache holds
    if mistake == "w_uk_transposed":  # the absorbed form's einsum with W_UK_h (dn, R) read as (R, dn)
        k_nope = torch.einsum("bnr,hrd->bhnd", kv_nope, t["w_k"].view(H, dn, R))  # (B, H, Nk, dn)
    else:
        k_nope = F.linear(kv_nope, t["w_k"]).view(B, Nk, H, dn).transpose(1, 2)  # (B, H, Nk, dn) view
    values = F.linear(kv_nope, t["w_v"])  # (B, Nk, H*dv), contiguous
    if mistake == "key_stride":  # head h's dv values from column h * d_k: the key head's stride
        values = values.as_strided((B, Nk, H, dv), (Nk * H * dv, H * dv, dn + dr, 1))  # (B, Nk, H, dv) view
    else:
        values = values.view(B, Nk, H, dv)  # (B, Nk, H, dv) view
    k_rot = rotate(k_rot.view(B, 1, Nk, dr))  # (B, 1, Nk, dr): the one rotated key
    if mistake == "deinterleaved_keys":  # apply_rotary_pos_emb_interleave's order, [evens | odds], kept in k_rot
        k_rot = k_rot.view(B, 1, Nk, dr // 2, 2).transpose(4, 3).reshape(B, 1, Nk, dr)
    key_states = torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], dim=-1)  # (B, H, Nk, Dk) copy
    return torch.cat([q_pass, rotate(q_rot)], dim=-1), key_states, values.transpose(1, 2)  # v (B, H, Nk, dv) view


FORM_STEPS: dict[str, PlantedSteps] = {
    "qk_norm_after_rope": PlantedSteps(rotated=_llama4_qk_norm),
    "temperature": PlantedSteps(rotated=_llama4_temperature),
    "mla": PlantedSteps(latent=_deepseek_heads, scale=variant("mla").diagnose.planted.scale),  # the module's float
}
