"""The attention candidate with planted bugs, in torch idioms: the torch column of ``diagnose --confusion``.

`torch_candidate(cfg, bug, mistakes, rope_style)` is attention written the way torch users write it
(``F.linear``, ``view(...).transpose(1, 2)``, ``masked_fill``) with one planted bug: ``bug`` a name
of `diagnose.injected.BUGS` (which checks it and calls this), ``mistakes`` the variant mistakes it
plants (variant -> a `PlantedMistake.mistake` of its entry), ``rope_style`` the rotary pairing it
rotates with (None: no rotation). It takes canonical `MHAParams` and returns a torch tensor. Its
attention, the planted bugs and the variants spelled here are written apart from diagnose's simulator
and from the NumPy candidate, so diagnosing it tests the simulator against independent code; the
variants' steps written once (below) are shared with the NumPy candidate, apart from the simulator only.

A variant whose steps are the same arithmetic in both candidates is written once in its entry over a
candidate's idioms (`DiagnoseSpec.planted_in`), which this module gives in torch (`torch_idioms`: Hugging
Face's ``torch.rsqrt`` RMSNorm, ``torch.tanh``, gpt-oss's sink column by ``torch.cat``); the rotary
frequencies of rope scaling are the entry's NumPy ones for both (the mistake is which ``rope_scaling``
is passed, not the formula). The variants whose torch idiom differs are `TORCH_STEPS`, a `PlantedSteps`
per variant: BLOOM's slopes, T5's ``_relative_position_bucket`` in torch, FlashAttention's
``window_size=(left, right)`` (a mask of blocked keys), and the forms of 2025-26 (Llama 4's temperature
and QK-norm after rotary, MLA's heads from its latents: `backends.injected_torch_forms`'). A variant
whose entry plants steps and that has neither is refused (`unspelled`): its bugs run in the NumPy
candidate only until its torch spelling is written.

torch is imported inside the functions only.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants import PlantedIdioms, PlantedSteps, planted_heads, steps_at, variants_on

from .injected_torch_forms import FORM_STEPS


def torch_rms_norm(x, w, eps):
    """Hugging Face's RMSNorm; ``w`` a NumPy weight (`core.variants.qk_norm.norm_weights` shapes it)."""
    import torch

    w = torch.from_numpy(np.ascontiguousarray(w))
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


def _positions(q_tokens: int, kv_tokens: int):
    """(context_position (Nq, 1), memory_position (1, Nk)), as Hugging Face names them."""
    import torch

    return torch.arange(q_tokens)[:, None], torch.arange(kv_tokens)[None, :]


def _alibi_bias(cfg: MHAConfig, params, q_tokens: int, kv_tokens: int, mistake):
    context_position, memory_position = _positions(q_tokens, kv_tokens)
    slopes = torch_alibi_slopes(cfg.n_heads, mistake == "power_of_two")
    distance = memory_position - context_position  # (Nq, Nk)
    if mistake == "sign":
        distance = -distance
    return slopes[:, None, None] * distance  # (H, Nq, Nk) float64


def _t5_bias(cfg: MHAConfig, params, q_tokens: int, kv_tokens: int, mistake):
    import torch

    context_position, memory_position = _positions(q_tokens, kv_tokens)
    relative_position = memory_position - context_position
    if mistake == "reversed":
        relative_position = context_position - memory_position
    bucket = torch_t5_bucket(relative_position, cfg.rel_bidirectional, cfg.rel_buckets, cfg.rel_max_distance)
    table = torch.from_numpy(np.ascontiguousarray(params.rel_bias))  # (buckets, H)
    return table[bucket].permute(2, 0, 1)  # (Nq, Nk, H) -> (H, Nq, Nk)


def _window_blocked(cfg: MHAConfig, q_tokens: int, kv_tokens: int, mistake):
    """(Nq, Nk) bool, True = blocked by FlashAttention's ``window_size=(left, right)``."""
    left = cfg.window if mistake == "one_more" else cfg.window - 1
    right = 0 if cfg.causal else left
    if mistake == "future":
        left, right = 0, cfg.window - 1
    i, j = _positions(q_tokens, kv_tokens)
    return (j < i - left) | (j > i + right)


def _chunk_blocked(cfg: MHAConfig, q_tokens: int, kv_tokens: int, mistake):
    """(Nq, Nk) bool, True = blocked: keys outside the query's chunk, as transformers' chunked mask (torch floor division)."""
    C = cfg.attention_chunk_size
    i, j = _positions(q_tokens, kv_tokens)
    if mistake == "forgotten":
        return (i < 0) & (j < 0)  # (Nq, Nk), nothing blocked: full causal attention on a chunked layer
    shift = 1 if mistake == "off_by_one" else 0
    return (i + shift) // C != (j + shift) // C


def _gated(cfg: MHAConfig, t, query, merged, mistake):
    """Qwen3-Next's ``attn_output * torch.sigmoid(gate)``; ``t``: the candidate's tensors by name."""
    import torch

    if mistake == "dropped":
        return merged
    gate = torch.nn.functional.linear(torch.as_tensor(query), t["w_gate"], t.get("b_gate"))  # (B, Nq, H*Dv)
    return merged * torch.sigmoid(gate)


def _torch_value_norm(cfg: MHAConfig, params, v, k_raw, k_rotated, mistake):
    """Gemma 4's ``v_norm`` (Gemma4RMSNorm(head_dim, with_scale=False)) on the split values, or its mistakes."""
    import torch

    if mistake == "dropped":
        return v
    normed = v * torch.pow(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps, -0.5)  # Gemma4RMSNorm._norm
    return normed * torch.from_numpy(params.k_norm) if mistake == "k_weight" else normed


# variant -> its steps in torch idioms (`PlantedSteps`), where the torch idiom differs from the NumPy candidate's
# (the others' are written once in their entries: `torch_steps`).
TORCH_STEPS: dict[str, PlantedSteps] = {
    "window": PlantedSteps(mask=_window_blocked),
    "chunked": PlantedSteps(mask=_chunk_blocked),
    "alibi": PlantedSteps(bias=_alibi_bias),
    "rel_bias": PlantedSteps(bias=_t5_bias),
    "gate": PlantedSteps(output=_gated),
    "value_norm": PlantedSteps(values=_torch_value_norm),
    **FORM_STEPS,  # Llama 4's temperature and QK-norm after rotary, MLA
}


@cache
def torch_idioms() -> PlantedIdioms:
    """torch's idioms for the entries' candidate steps written once (`core.variants.PlantedIdioms`): ``torch.tanh``,
    Hugging Face's ``torch.rsqrt`` RMSNorm, ``torch.from_numpy``, ``torch.cat``, ``expand``."""
    import torch

    return PlantedIdioms(
        tanh=torch.tanh,
        rms_norm=torch_rms_norm,
        asarray=lambda a: torch.from_numpy(np.ascontiguousarray(a)),
        concat=lambda arrays, axis: torch.cat(arrays, dim=axis),
        broadcast_to=lambda x, shape: x.expand(shape),  # a broadcast view
    )


def torch_steps(entry) -> PlantedSteps | None:
    """The torch candidate's steps of the variant ``entry``: its steps written once over torch's idioms
    (`DiagnoseSpec.planted_in`), else its torch spelling here (`TORCH_STEPS`), else None (unspelled)."""
    spec = entry.diagnose
    if spec is not None and spec.planted_in is not None:
        return spec.planted_in(torch_idioms())
    return TORCH_STEPS.get(entry.name)


def unspelled(cfg: MHAConfig) -> list[str]:
    """The variants of ``cfg`` whose entries plant steps that the torch candidate does not spell."""
    return [
        e.name
        for e in variants_on(cfg)
        if e.diagnose is not None and not e.diagnose.planted.empty and torch_steps(e) is None
    ]


def _steps(cfg: MHAConfig, place: str, mistakes):
    """(step, mistake) of each variant of ``cfg`` at ``place`` in torch idioms, in registry order."""
    return steps_at(variants_on(cfg), place, mistakes, torch_steps)


def torch_candidate(cfg: MHAConfig, bug: str | None, mistakes, rope_style: str | None):
    """candidate(params, query, key, value, mask) -> output, a torch tensor (the module docstring has the arguments)."""
    import torch
    import torch.nn.functional as F

    missing = unspelled(cfg)
    if missing:
        raise NotImplementedError(
            f"the torch candidate spells no {', '.join(missing)} (neither its entry's DiagnoseSpec.planted_in "
            "nor backends.injected_torch.TORCH_STEPS): "
            "that variant's bugs run in the NumPy candidate only"
        )
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

        def rotate(x, scaled):  # with the NumPy frequencies of rope scaling, or None: the plain ones
            return x if rope_style is None else _torch_rotary(x, rope_style, cfg, scaled)

        def project(turn):  # the projections, the head split, the QK-norms and rotary
            return _projected_heads(cfg, params, t, bug, mistakes, (x_q, x_k, x_v), turn)

        q, k, v = planted_heads(cfg, params, x_q, x_k, lambda at: _steps(cfg, at, mistakes), rotate, project)
        if Hkv != H:
            group = H // Hkv
            if bug == "kv heads tiled":
                k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)  # (B, H, Nk, d): tiled
            else:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, Nk, d)
        scale = cfg.scale
        for step, mistake in _steps(cfg, "scale", mistakes):  # MLA's YaRN mscale
            scale = step(cfg, mistake)
        if bug == "scale twice":
            q = q * scale
        scores = q @ k.transpose(-2, -1)  # (B, H, Nq, Nk)
        if bug != "scale missing":
            scores = scores * scale
        for step, mistake in _steps(cfg, "transform", mistakes):  # the logit cap
            scores = step(cfg, scores, mistake)
        for step, mistake in _steps(cfg, "bias", mistakes):  # ALiBi, T5's bias
            scores = scores + step(cfg, params, Nq, Nk, mistake).to(scores.dtype)  # (B, H, Nq, Nk)
        blocked = torch.zeros(Nq, Nk, dtype=torch.bool)
        if cfg.causal:
            offset = 0 if bug == "causal hides diagonal" else 1
            blocked = torch.ones(Nq, Nk, dtype=torch.bool).triu(offset)
        for step, mistake in _steps(cfg, "mask", mistakes):  # the window
            blocked = blocked | step(cfg, Nq, Nk, mistake)
        if mask is not None:
            m = torch.from_numpy(np.asarray(mask))
            blocked = blocked | (m if bug == "mask inverted" else ~m)
        scores = scores.masked_fill(blocked, float("-inf"))
        for step, mistake in _steps(cfg, "masked", mistakes):  # a logit cap moved after the mask
            scores = step(cfg, scores, mistake)
        drop = False
        for step, mistake in _steps(cfg, "columns", mistakes):  # a sink column: (B, H, Nq, Nk+1)
            scores, v, drop = step(cfg, params, scores, v, mistake)
        weights = torch.softmax(scores, dim=-2 if bug == "softmax over queries" else -1)
        if drop:
            weights = weights[..., :-1]  # (B, H, Nq, Nk) view: gpt-oss drops the sink's column
        context = weights @ v  # (B, H, Nq, Dv)
        if bug == "merge (Dv, H)":
            merged = context.permute(0, 2, 3, 1).reshape(B, Nq, Dv * H)  # (B, Nq, Dv, H) flattened: the bug
        else:
            merged = context.transpose(1, 2).reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv) copy
        for step, mistake in _steps(cfg, "output", mistakes):  # the output gate
            merged = step(cfg, t, x_q, merged, mistake)
        w_o = t["w_o"].T if bug == "w_o transposed" else t["w_o"]
        return F.linear(merged, w_o, t["b_o"])

    return candidate


def _projected_heads(cfg: MHAConfig, params, t, bug, mistakes, inputs, turn):
    """(q, k, v, k_raw): the projections, the head split (``view(...).transpose(1, 2)``), the QK-norms and rotary."""
    import torch.nn.functional as F

    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    x_q, x_k, x_v = inputs
    B, Nq, Nk = x_q.shape[0], x_q.shape[1], x_k.shape[1]
    w_q = t["w_q"].T if bug == "w_q transposed" else t["w_q"]
    q = F.linear(x_q, w_q, t["b_q"])  # (B, Nq, H*Dk)
    k = F.linear(x_k, t["w_k"], t["b_k"])  # (B, Nk, Hkv*Dk)
    v = F.linear(x_v, t["w_v"], t["b_v"])  # (B, Nk, Hkv*Dv)
    for step, mistake in _steps(cfg, "projection", mistakes):  # a projection QK-norm
        q, k = step(cfg, params, q, k, mistake)
    if bug == "direct reshape":
        q, k, v = q.reshape(B, H, Nq, Dk), k.reshape(B, Hkv, Nk, Dk), v.reshape(B, Hkv, Nk, Dv)
    else:
        q = q.view(B, Nq, H, Dk).transpose(1, 2)  # (B, H, Nq, Dk) view
        k = k.view(B, Nk, Hkv, Dk).transpose(1, 2)  # (B, Hkv, Nk, Dk) view
        v = v.view(B, Nk, Hkv, Dv).transpose(1, 2)  # (B, Hkv, Nk, Dv) view
    k_raw = k  # before the head norm and rotary (k_eq_v's values)
    for step, mistake in _steps(cfg, "heads", mistakes):  # a head QK-norm
        q, k = step(cfg, params, q, k, mistake)
    return turn(q), turn(k), v, k_raw


def _torch_rotary(x, style: str, cfg: MHAConfig, scaled=None):
    """Hugging Face's rotate_half for "half", Meta's complex multiplication for "interleaved".

    ``scaled``: (inv_freq, factor on cos and sin) of scaled rotary (the rope scaling entry's planted step).
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
