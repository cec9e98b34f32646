"""The variants in the injected candidates (`injected`), with their mistakes, in NumPy and in torch idioms.

Written apart from the simulator's steps (`variant_steps`), the way ported code writes them:
NumPy with ``np.where`` masks and a concatenated sink column; torch with Hugging Face's
idioms (``torch.rsqrt`` RMSNorm, BLOOM's slopes, T5's ``_relative_position_bucket`` in torch,
FlashAttention's ``window_size=(left, right)``, gpt-oss's sink column dropped after the
softmax). The rotary frequencies come from ``core.rope_scaling.scaled_frequencies`` for both
(the mistake is which ``rope_scaling`` is passed, not the formula); the NumPy candidate takes
T5's buckets from ``core.t5_buckets`` (the mistake is the sign of the distance it is given).
torch is imported inside the torch functions only.
"""

from __future__ import annotations

import math

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.rope_scaling import scaled_frequencies
from mha_rosetta.core.variants import t5_buckets

# bug -> (the cause code it must be diagnosed as, what the code does wrong); `injected.BUGS` adds them.
VARIANT_BUGS: dict[str, tuple[str, str]] = {
    "softcap after mask": ("softcap", "masked_fill(-inf), then c * tanh(s / c): blocked scores become -c"),
    "softcap dropped": ("softcap", "scores never capped (SDPA with Gemma 2's attn_logit_softcapping)"),
    "window W+1": ("window", "FlashAttention's window_size=(W, 0) for a window of W keys"),
    "window wrong end": ("window", "keys i <= j < i + W instead of i - W < j <= i"),
    "alibi power-of-two slopes": ("alibi", "slopes 2**(-8k/H) whatever H"),
    "alibi sign": ("alibi", "m_h (p_i - p_j) added instead of m_h (p_j - p_i)"),
    "qk-norm per head": ("qk_norm", "RMSNorm of each head's slice where the projection is normalised"),
    "qk-norm over projection": ("qk_norm", "RMSNorm of the whole projection where each head is normalised"),
    "sinks ignored": ("sinks", "the plain softmax, no sink column"),
    "sink with a value": ("sinks", "the sink column kept, with the first key's value"),
    "rope scaling linear": ("rope_scaling", "rope_scaling read as linear with its factor"),
    "rope scaling ignored": ("rope_scaling", "the plain rotary frequencies"),
    "t5 buckets reversed": ("rel_bias", "relative_position = query - key"),
}


def variant_bugs_for(cfg: MHAConfig, q_tokens: int) -> dict[str, bool]:
    """Which variant bugs can run and change the output for ``cfg`` (probes of ``q_tokens`` queries)."""
    scaling = cfg.rope_scaling
    return {
        "softcap after mask": cfg.softcap is not None,
        "softcap dropped": cfg.softcap is not None,
        # One more key shows only where the window is shorter than the probes.
        "window W+1": cfg.window is not None and cfg.window < q_tokens,
        # A window of one key is the diagonal from either end.
        "window wrong end": cfg.window is not None and cfg.causal and cfg.window > 1,
        "alibi power-of-two slopes": cfg.alibi and bool(cfg.n_heads & (cfg.n_heads - 1)),
        "alibi sign": cfg.alibi,
        "qk-norm per head": cfg.qk_norm == "projection" and cfg.n_heads > 1,
        "qk-norm over projection": cfg.qk_norm == "head" and cfg.n_heads > 1,
        "sinks ignored": cfg.sinks,
        "sink with a value": cfg.sinks,
        "rope scaling linear": scaling is not None and scaling["rope_type"] != "linear",
        "rope scaling ignored": scaling is not None,
        "t5 buckets reversed": cfg.rel_buckets is not None,
    }


def norm_place(cfg: MHAConfig, bug: str | None) -> str | None:
    """Where the candidate takes its RMSNorm: cfg.qk_norm, or the other place."""
    if bug == "qk-norm per head":
        return "head"
    if bug == "qk-norm over projection":
        return "projection"
    return cfg.qk_norm


def norm_weights(cfg: MHAConfig, bug: str | None, params, place: str):
    """The spec's q_norm and k_norm shaped for the place the candidate normalises (NumPy arrays)."""
    w_q, w_k = params.q_norm, params.k_norm
    if place == cfg.qk_norm:
        return w_q, w_k
    if place == "projection":  # a (d_k,) head weight tiled over the heads
        return np.tile(w_q, cfg.n_heads), np.tile(w_k, cfg.n_kv_heads)  # (H*Dk,), (Hkv*Dk,)
    return w_q.reshape(cfg.n_heads, 1, cfg.d_k), w_k.reshape(cfg.n_kv_heads, 1, cfg.d_k)  # per head slices, views


def rope_frequencies(cfg: MHAConfig, bug: str | None, seq_len: int) -> tuple[np.ndarray, float] | None:
    """(inv_freq, factor on cos and sin) for scaled rotary, or None for the plain frequencies."""
    scaling = cfg.rope_scaling
    if bug == "rope scaling ignored":
        scaling = None
    elif bug == "rope scaling linear":
        scaling = {"rope_type": "linear", "factor": scaling["factor"]}
    if scaling is None:
        return None
    return scaled_frequencies(cfg.rope_dims, cfg.rope_base, scaling, seq_len)


# -- NumPy ------------------------------------------------------------------------------------
def numpy_rms_norm(x, w, eps):
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * w


def numpy_alibi_slopes(n_heads: int, power_of_two_formula: bool) -> np.ndarray:
    if power_of_two_formula or not n_heads & (n_heads - 1):
        return 2.0 ** (-8.0 * np.arange(1, n_heads + 1) / n_heads)
    c = 1 << (n_heads.bit_length() - 1)  # the power of two below n_heads
    first = 2.0 ** (-8.0 * np.arange(1, c + 1) / c)
    second = 2.0 ** (-4.0 * np.arange(1, 2 * (n_heads - c), 2) / c)  # odd terms of the 2c series
    return np.concatenate([first, second])


def numpy_score_variants(cfg: MHAConfig, bug: str | None, params, scores):
    """(B, H, Nq, Nk) scores with the softcap, ALiBi and T5's bias as the candidate adds them (before the mask)."""
    Nq, Nk = scores.shape[-2:]
    if cfg.softcap is not None and bug not in ("softcap after mask", "softcap dropped"):
        scores = cfg.softcap * np.tanh(scores / cfg.softcap)
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    if cfg.alibi:
        slopes = numpy_alibi_slopes(cfg.n_heads, bug == "alibi power-of-two slopes")
        offset = (i - j) if bug == "alibi sign" else (j - i)  # (Nq, Nk)
        scores = scores + slopes[:, None, None] * offset
    if cfg.rel_buckets is not None:
        relative = (i - j) if bug == "t5 buckets reversed" else (j - i)  # memory minus context in T5
        bucket = t5_buckets(relative, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)  # (Nq, Nk)
        scores = scores + params.rel_bias[bucket].transpose(2, 0, 1)  # (Nq, Nk, H) -> (H, Nq, Nk)
    return scores


def numpy_window(cfg: MHAConfig, bug: str | None, q_tokens: int, kv_tokens: int):
    """(Nq, Nk) bool: the keys the candidate's window lets through, or None without a window."""
    if cfg.window is None:
        return None
    i, j = np.arange(q_tokens)[:, None], np.arange(kv_tokens)[None, :]
    w = cfg.window + 1 if bug == "window W+1" else cfg.window
    if bug == "window wrong end":
        return (j >= i) & (j < i + w)
    return (j > i - w) if cfg.causal else (np.abs(i - j) < w)


def numpy_sink_column(cfg: MHAConfig, bug: str | None, params, scores, v):
    """gpt-oss's sink: one more logit column (and, mistaken, a value row); (scores, v, drop the column after)."""
    if not cfg.sinks or bug == "sinks ignored":
        return scores, v, False
    sink = np.broadcast_to(params.sinks[:, None, None], (*scores.shape[:-1], 1))  # (B, H, Nq, 1)
    scores = np.concatenate([scores, sink], axis=-1)  # (B, H, Nq, Nk+1)
    if bug == "sink with a value":
        return scores, np.concatenate([v, v[:, :, :1]], axis=2), False  # (B, H, Nk+1, Dv): the first key's value
    return scores, v, True


# -- torch ------------------------------------------------------------------------------------
def torch_rms_norm(x, w, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def torch_alibi_slopes(n_heads: int, power_of_two_formula: bool):
    """BLOOM's ``build_alibi_tensor`` slopes (or the power-of-two formula for every head count)."""
    import torch

    if power_of_two_formula:
        return torch.pow(torch.tensor(2 ** (-8 / n_heads), dtype=torch.float64), torch.arange(1, 1 + n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float64)
    slopes = torch.pow(base, torch.arange(1, 1 + closest))
    if closest != n_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float64)
        remaining = min(closest, n_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2))])
    return slopes


def torch_t5_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """Hugging Face's ``T5Attention._relative_position_bucket``."""
    import torch

    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    return relative_buckets + torch.where(is_small, relative_position, relative_position_if_large)


def torch_score_variants(cfg: MHAConfig, bug: str | None, t: dict, scores):
    import torch

    Nq, Nk = scores.shape[-2:]
    if cfg.softcap is not None and bug not in ("softcap after mask", "softcap dropped"):
        scores = torch.tanh(scores / cfg.softcap) * cfg.softcap
    context_position = torch.arange(Nq)[:, None]
    memory_position = torch.arange(Nk)[None, :]
    if cfg.alibi:
        slopes = torch_alibi_slopes(cfg.n_heads, bug == "alibi power-of-two slopes")
        distance = memory_position - context_position  # (Nq, Nk)
        if bug == "alibi sign":
            distance = -distance
        scores = scores + (slopes[:, None, None] * distance).to(scores.dtype)
    if cfg.rel_buckets is not None:
        relative_position = memory_position - context_position
        if bug == "t5 buckets reversed":
            relative_position = context_position - memory_position
        bucket = torch_t5_bucket(relative_position, cfg.rel_bidirectional, cfg.rel_buckets, cfg.rel_max_distance)
        scores = scores + t["rel_bias"][bucket].permute(2, 0, 1)  # (Nq, Nk, H) -> (H, Nq, Nk)
    return scores


def torch_window_blocked(cfg: MHAConfig, bug: str | None, q_tokens: int, kv_tokens: int):
    """(Nq, Nk) bool, True = blocked by FlashAttention's ``window_size=(left, right)``, or None without a window."""
    import torch

    if cfg.window is None:
        return None
    left = cfg.window if bug == "window W+1" else cfg.window - 1
    right = 0 if cfg.causal else left
    if bug == "window wrong end":
        left, right = 0, cfg.window - 1
    i, j = torch.arange(q_tokens)[:, None], torch.arange(kv_tokens)[None, :]
    return (j < i - left) | (j > i + right)


def torch_sink_column(cfg: MHAConfig, bug: str | None, t: dict, scores, v):
    import torch

    if not cfg.sinks or bug == "sinks ignored":
        return scores, v, False
    sink = t["sinks"].reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)  # (B, H, Nq, 1)
    scores = torch.cat([scores, sink], dim=-1)  # (B, H, Nq, Nk+1)
    if bug == "sink with a value":
        return scores, torch.cat([v, v[:, :, :1]], dim=2), False  # (B, H, Nk+1, Dv)
    return scores, v, True
