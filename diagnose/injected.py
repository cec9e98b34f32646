"""Attention candidates with one injected convention bug each, written the way users write them.

`numpy_candidate(cfg, bug)` (row samples, ``x @ W.T + b``, reshape + transpose) and
`torch_candidate(cfg, bug)` (``F.linear``, ``view(...).transpose(1, 2)``, ``masked_fill``)
take canonical `MHAParams` and return the output, with the bug named by ``bug`` (a key of
`BUGS`) or none. They are independent code from `diagnose.simulate`, so diagnosing them
tests the simulator, and they feed the confusion table (`diagnose.confusion`) and the
example of docs/your-own-implementation.md. torch is imported inside `torch_candidate` only.
The variants (and their mistakes, `VARIANT_BUGS`) are written in `injected_variants`.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig

from . import injected_variants as iv
from .probes import Q_TOKENS
from .simulate import packing_applies

# bug -> (the cause code it must be diagnosed as, what the code does wrong)
BUGS: dict[str, tuple[str, str]] = {
    "w_q transposed": ("weight_transposed", "x @ w_q instead of x @ w_q.T"),
    "w_o transposed": ("weight_transposed", "merged @ w_o instead of merged @ w_o.T"),
    "q/k swapped": ("qkv_swapped", "w_q/b_q loaded into the key projection and w_k/b_k into the query one"),
    "k/v swapped": ("qkv_swapped", "w_k/b_k loaded into the value projection and w_v/b_v into the key one"),
    "packed blocks, read per head": ("qkv_packing", "in_proj = cat(w_q, w_k, w_v), unpacked as view(H, 3, d, E)"),
    "scale missing": ("scale", "scores = q @ k.T"),
    "scale twice": ("scale", "q scaled by 1/sqrt(d), then the scores again"),
    "softmax over queries": ("softmax_axis", "softmax(scores, axis=-2)"),
    "mask inverted": ("mask_polarity", "masked_fill(mask, -inf): True read as blocked"),
    "causal hides diagonal": ("causal_offset", "tril(ones, -1): query i sees keys j < i"),
    "direct reshape": ("head_split", "q.reshape(B, H, N, d) instead of reshape(B, N, H, d).transpose"),
    "merge (Dv, H)": ("head_merge_order", "context.permute(0, 2, 3, 1).reshape(B, N, Dv*H)"),
    "kv heads tiled": ("gqa_grouping", "k.repeat(1, group, 1, 1) instead of repeat_interleave(group, dim=1)"),
    "b_q dropped": ("bias", "query projection without its bias"),
    "b_o dropped": ("bias", "output projection without its bias"),
    "rope pairs swapped": ("rope_convention", "rotate_half where the weights are interleaved, or the reverse"),
    "rope missing": ("rope_convention", "q and k used without the rotary embedding"),
    **iv.VARIANT_BUGS,
}


def bugs_for(cfg: MHAConfig) -> list[str]:
    """The bugs that can run (the shapes allow them) and change the output for ``cfg``."""
    runs = {
        "w_q transposed": cfg.q_width == cfg.d_model,
        "w_o transposed": cfg.context_width == cfg.d_model,
        "q/k swapped": cfg.q_width == cfg.k_width and cfg.kdim == cfg.d_model,
        "k/v swapped": cfg.k_width == cfg.v_width and cfg.kdim == cfg.vdim,
        "packed blocks, read per head": packing_applies(cfg) and cfg.n_heads > 1,  # one head: same layout
        "scale twice": cfg.scale != 1.0,
        "scale missing": cfg.scale != 1.0,
        "causal hides diagonal": cfg.causal,
        "direct reshape": cfg.n_heads > 1,
        "merge (Dv, H)": cfg.n_heads > 1 and cfg.d_v > 1,
        "kv heads tiled": 1 < cfg.n_kv_heads < cfg.n_heads,
        "b_q dropped": cfg.bias,
        "b_o dropped": cfg.output_bias,
        # With two rotated features the two pairings are the same pair.
        "rope pairs swapped": cfg.rope is not None and cfg.rope_dims > 2,
        "rope missing": cfg.rope is not None,
        **iv.variant_bugs_for(cfg, Q_TOKENS),
    }
    return [name for name in BUGS if runs.get(name, True)]


def _check_bug(bug: str | None) -> None:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be None or one of {', '.join(map(repr, BUGS))}; got {bug!r}")


def _rope_style(cfg: MHAConfig, bug: str | None) -> str | None:
    """The pairing the candidate rotates with: cfg.rope, the other one, or None (no rotation)."""
    if cfg.rope is None or bug == "rope missing":
        return None
    if bug == "rope pairs swapped":
        return "interleaved" if cfg.rope == "half" else "half"
    return cfg.rope


def numpy_candidate(cfg: MHAConfig, bug: str | None = None):
    """A NumPy attention with ``bug`` injected: candidate(params, query, key, value, mask) -> output."""
    _check_bug(bug)
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    def candidate(params, query, key, value, mask):
        w_q, w_k, w_v, w_o = params.w_q, params.w_k, params.w_v, params.w_o
        b_q, b_k, b_v, b_o = params.b_q, params.b_k, params.b_v, params.b_o
        if bug == "q/k swapped":
            w_q, w_k, b_q, b_k = w_k, w_q, b_k, b_q
        if bug == "k/v swapped":
            w_k, w_v, b_k, b_v = w_v, w_k, b_v, b_k
        if bug == "packed blocks, read per head":
            in_proj = np.concatenate([w_q, w_k, w_v])  # (3E, E), q;k;v blocks
            per_head = in_proj.reshape(H, 3, Dk, -1)  # read as [q_h; k_h; v_h] per head: the bug
            w_q, w_k, w_v = (per_head[:, i].reshape(H * Dk, -1) for i in range(3))
            if b_q is not None:
                b_per_head = np.concatenate([b_q, b_k, b_v]).reshape(H, 3, Dk)
                b_q, b_k, b_v = (b_per_head[:, i].reshape(H * Dk) for i in range(3))
        if bug == "b_q dropped":
            b_q = None
        if bug == "b_o dropped":
            b_o = None

        def linear(x, w, b, transposed=False):
            y = x @ (w if transposed else w.T)
            return y if b is None else y + b

        B, Nq, Nk = query.shape[0], query.shape[1], key.shape[1]
        q = linear(query, w_q, b_q, bug == "w_q transposed")  # (B, Nq, H*Dk)
        k = linear(key, w_k, b_k)  # (B, Nk, Hkv*Dk)
        v = linear(value, w_v, b_v)  # (B, Nk, Hkv*Dv)
        place = iv.norm_place(cfg, bug)
        if place is not None:
            w_qn, w_kn = iv.norm_weights(cfg, bug, params, place)
        if place == "projection":
            q, k = iv.numpy_rms_norm(q, w_qn, cfg.norm_eps), iv.numpy_rms_norm(k, w_kn, cfg.norm_eps)
        if bug == "direct reshape":
            q, k, v = q.reshape(B, H, Nq, Dk), k.reshape(B, Hkv, Nk, Dk), v.reshape(B, Hkv, Nk, Dv)
        else:
            q = q.reshape(B, Nq, H, Dk).transpose(0, 2, 1, 3)  # (B, H, Nq, Dk)
            k = k.reshape(B, Nk, Hkv, Dk).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dk)
            v = v.reshape(B, Nk, Hkv, Dv).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dv)
        if place == "head":
            q, k = iv.numpy_rms_norm(q, w_qn, cfg.norm_eps), iv.numpy_rms_norm(k, w_kn, cfg.norm_eps)
        style = _rope_style(cfg, bug)
        if style is not None:
            scaled = iv.rope_frequencies(cfg, bug, max(Nq, Nk))
            q, k = _numpy_rotary(q, style, cfg, scaled), _numpy_rotary(k, style, cfg, scaled)
        if Hkv != H:
            group = H // Hkv
            if bug == "kv heads tiled":
                k, v = np.tile(k, (1, group, 1, 1)), np.tile(v, (1, group, 1, 1))  # (B, H, Nk, d)
            else:
                k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (B, H, Nk, d)
        scale = cfg.scale
        if bug == "scale twice":
            q = q * scale
        scores = q @ k.transpose(0, 1, 3, 2)  # (B, H, Nq, Nk)
        if bug != "scale missing":
            scores = scores * scale
        scores = iv.numpy_score_variants(cfg, bug, params, scores)  # softcap, ALiBi, T5's bias
        allowed = np.ones((Nq, Nk), dtype=bool)
        if cfg.causal:
            allowed = np.tril(allowed, -1 if bug == "causal hides diagonal" else 0)
        window = iv.numpy_window(cfg, bug, Nq, Nk)
        if window is not None:
            allowed = allowed & window
        if mask is not None:
            allowed = allowed & (~mask if bug == "mask inverted" else mask)
        scores = np.where(allowed, scores, -np.inf)
        if bug == "softcap after mask":
            scores = cfg.softcap * np.tanh(scores / cfg.softcap)
        scores, v, drop_sink = iv.numpy_sink_column(cfg, bug, params, scores, v)  # (B, H, Nq, Nk[+1])
        axis = -2 if bug == "softmax over queries" else -1
        with np.errstate(invalid="ignore"):
            e = np.exp(scores - scores.max(axis=axis, keepdims=True))
            weights = e / e.sum(axis=axis, keepdims=True)
        if drop_sink:
            weights = weights[..., :-1]  # (B, H, Nq, Nk) view: the sink's column dropped
        context = weights @ v  # (B, H, Nq, Dv)
        if bug == "merge (Dv, H)":
            merged = context.transpose(0, 2, 3, 1).reshape(B, Nq, Dv * H)  # (B, Nq, Dv, H) flattened: the bug
        else:
            merged = context.transpose(0, 2, 1, 3).reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv) copy
        return linear(merged, w_o, b_o, bug == "w_o transposed")

    return candidate


def _numpy_rotary(x, style: str, cfg: MHAConfig, scaled=None):
    """Rotate the first rope_dims features of (B, heads, N, d) by position: half = rotate_half, else pairs.

    ``scaled``: (inv_freq, factor on cos and sin) of scaled rotary (`injected_variants.rope_frequencies`).
    """
    r = cfg.rope_dims
    theta = np.arange(x.shape[2])[:, None] / cfg.rope_base ** (np.arange(0, r, 2) / r)  # (N, r/2)
    cos, sin = np.cos(theta), np.sin(theta)
    if scaled is not None:
        inv_freq, factor = scaled
        theta = np.arange(x.shape[2])[:, None] * inv_freq  # (N, r/2)
        cos, sin = factor * np.cos(theta), factor * np.sin(theta)
    rot, rest = x[..., :r], x[..., r:]
    if style == "half":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        turned = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)  # (..., r/2, 2) view: (2i, 2i+1)
        a, b = pairs[..., 0], pairs[..., 1]
        turned = np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)  # copy
    return np.concatenate([turned, rest], axis=-1)


def torch_candidate(cfg: MHAConfig, bug: str | None = None):
    """The same bugs in torch idioms (F.linear, view/transpose, masked_fill); returns a torch tensor."""
    import torch
    import torch.nn.functional as F

    _check_bug(bug)
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    def candidate(params, query, key, value, mask):
        t = {
            name: None if a is None else torch.from_numpy(np.ascontiguousarray(a))
            for name, a in params.as_dict().items()
        }
        if bug == "q/k swapped":
            t["w_q"], t["w_k"], t["b_q"], t["b_k"] = t["w_k"], t["w_q"], t["b_k"], t["b_q"]
        if bug == "k/v swapped":
            t["w_k"], t["w_v"], t["b_k"], t["b_v"] = t["w_v"], t["w_k"], t["b_v"], t["b_k"]
        if bug == "packed blocks, read per head":
            in_proj = torch.cat([t["w_q"], t["w_k"], t["w_v"]])  # (3E, E) like nn.MultiheadAttention
            w = in_proj.view(H, 3, Dk, -1)  # the bug: read per head
            t["w_q"], t["w_k"], t["w_v"] = (w[:, i].reshape(H * Dk, -1) for i in range(3))
            if t["b_q"] is not None:
                b = torch.cat([t["b_q"], t["b_k"], t["b_v"]]).view(H, 3, Dk)
                t["b_q"], t["b_k"], t["b_v"] = (b[:, i].reshape(H * Dk) for i in range(3))
        if bug in ("b_q dropped", "b_o dropped"):
            t[bug[:3]] = None
        x_q, x_k, x_v = (torch.from_numpy(a) for a in (query, key, value))
        B, Nq, Nk = x_q.shape[0], x_q.shape[1], x_k.shape[1]
        w_q = t["w_q"].T if bug == "w_q transposed" else t["w_q"]
        q = F.linear(x_q, w_q, t["b_q"])  # (B, Nq, H*Dk)
        k = F.linear(x_k, t["w_k"], t["b_k"])  # (B, Nk, Hkv*Dk)
        v = F.linear(x_v, t["w_v"], t["b_v"])  # (B, Nk, Hkv*Dv)
        place = iv.norm_place(cfg, bug)
        if place is not None:
            w_qn, w_kn = (torch.from_numpy(np.ascontiguousarray(w)) for w in iv.norm_weights(cfg, bug, params, place))
        if place == "projection":
            q, k = iv.torch_rms_norm(q, w_qn, cfg.norm_eps), iv.torch_rms_norm(k, w_kn, cfg.norm_eps)
        if bug == "direct reshape":
            q, k, v = q.reshape(B, H, Nq, Dk), k.reshape(B, Hkv, Nk, Dk), v.reshape(B, Hkv, Nk, Dv)
        else:
            q = q.view(B, Nq, H, Dk).transpose(1, 2)  # (B, H, Nq, Dk) view
            k = k.view(B, Nk, Hkv, Dk).transpose(1, 2)  # (B, Hkv, Nk, Dk) view
            v = v.view(B, Nk, Hkv, Dv).transpose(1, 2)  # (B, Hkv, Nk, Dv) view
        if place == "head":
            q, k = iv.torch_rms_norm(q, w_qn, cfg.norm_eps), iv.torch_rms_norm(k, w_kn, cfg.norm_eps)
        style = _rope_style(cfg, bug)
        if style is not None:
            scaled = iv.rope_frequencies(cfg, bug, max(Nq, Nk))
            q, k = _torch_rotary(q, style, cfg, scaled), _torch_rotary(k, style, cfg, scaled)
        if Hkv != H:
            group = H // Hkv
            if bug == "kv heads tiled":
                k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)  # (B, H, Nk, d): tiled
            else:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, Nk, d)
        scale = cfg.scale
        if bug == "scale twice":
            q = q * scale
        scores = q @ k.transpose(-2, -1)  # (B, H, Nq, Nk)
        if bug != "scale missing":
            scores = scores * scale
        scores = iv.torch_score_variants(cfg, bug, t, scores)  # softcap, ALiBi, T5's bias
        blocked = torch.zeros(Nq, Nk, dtype=torch.bool)
        if cfg.causal:
            offset = 0 if bug == "causal hides diagonal" else 1
            blocked = torch.ones(Nq, Nk, dtype=torch.bool).triu(offset)
        outside = iv.torch_window_blocked(cfg, bug, Nq, Nk)
        if outside is not None:
            blocked = blocked | outside
        if mask is not None:
            m = torch.from_numpy(np.asarray(mask))
            blocked = blocked | (m if bug == "mask inverted" else ~m)
        scores = scores.masked_fill(blocked, float("-inf"))
        if bug == "softcap after mask":
            scores = torch.tanh(scores / cfg.softcap) * cfg.softcap
        scores, v, drop_sink = iv.torch_sink_column(cfg, bug, t, scores, v)  # (B, H, Nq, Nk[+1])
        weights = torch.softmax(scores, dim=-2 if bug == "softmax over queries" else -1)
        if drop_sink:
            weights = weights[..., :-1]  # (B, H, Nq, Nk) view: gpt-oss drops the sink's column
        context = weights @ v  # (B, H, Nq, Dv)
        if bug == "merge (Dv, H)":
            merged = context.permute(0, 2, 3, 1).reshape(B, Nq, Dv * H)  # (B, Nq, Dv, H) flattened: the bug
        else:
            merged = context.transpose(1, 2).reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv) copy
        w_o = t["w_o"].T if bug == "w_o transposed" else t["w_o"]
        return F.linear(merged, w_o, t["b_o"])

    return candidate


def _torch_rotary(x, style: str, cfg: MHAConfig, scaled=None):
    """Hugging Face's rotate_half for "half", Meta's complex multiplication for "interleaved".

    ``scaled``: (inv_freq, factor on cos and sin) of scaled rotary (`injected_variants.rope_frequencies`).
    """
    import torch

    r = cfg.rope_dims
    inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)  # (r/2,)
    factor = 1.0
    if scaled is not None:
        inv_freq, factor = torch.from_numpy(scaled[0]), scaled[1]
    freqs = torch.outer(torch.arange(x.shape[2], dtype=torch.float64), inv_freq)  # (N, r/2)
    rot, rest = x[..., :r], x[..., r:]
    if style == "half":
        emb = torch.cat([freqs, freqs], dim=-1)  # (N, r)
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        turned = rot * (emb.cos() * factor) + torch.cat([-x2, x1], dim=-1) * (emb.sin() * factor)
    else:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], r // 2, 2).contiguous())  # (..., r/2) complex
        turned = torch.view_as_real(pairs * torch.polar(factor * torch.ones_like(freqs), freqs)).flatten(-2)  # (..., r)
    return torch.cat([turned, rest], dim=-1)
