"""Attention candidates with one injected convention bug each, written the way users write them.

`numpy_candidate(cfg, bug)` (row samples, ``x @ W.T + b``, reshape + transpose) and
`torch_candidate(cfg, bug)` (``F.linear``, ``view(...).transpose(1, 2)``, ``masked_fill``)
take canonical `MHAParams` and return the output, with the bug named by ``bug`` (a key of
`BUGS`) or none. They are independent code from `diagnose.simulate`, so diagnosing them
tests the simulator, and they feed the confusion table (`diagnose.confusion`) and the
example of docs/your-own-implementation.md.

The variants and the bugs planted in them (`VARIANT_BUGS`) are their registry entries'
(`core.variants`: each entry's `PlantedMistake`s, and its NumPy `PlantedSteps` written apart
from its simulated steps, the way ported code writes them). The torch candidate, the
variants' torch spellings with it, is `backends.injected_torch` (torch imported there, inside
its functions): `torch_candidate` here checks the bug and hands it the variant mistakes.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.backends import injected_torch
from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants import planted_heads, steps_at, variants_on

from .causes import diagnosed_variants, latent_form
from .probes import Q_TOKENS
from .simulate import packing_applies

# The bugs planted in the variants, in diagnose's order (an entry's `PlantedMistake`s; the QK-norm pair shares its two).
_PLANTED = {m.name: m for entry in diagnosed_variants() for m in entry.planted_mistakes}
# bug -> (the cause code it must be diagnosed as, what the code does wrong); `BUGS` adds them.
VARIANT_BUGS: dict[str, tuple[str, str]] = {name: (m.code, m.what) for name, m in _PLANTED.items()}

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
    **VARIANT_BUGS,
}


def bugs_for(cfg: MHAConfig) -> list[str]:
    """The bugs that can run (the shapes allow them) and change the output for ``cfg``."""
    latent = latent_form(cfg)  # MLA: no projection of the tokens to swap, pack, split or bias (but w_o's)
    runs = {
        "w_q transposed": cfg.q_width == cfg.d_model and not latent,
        "w_o transposed": cfg.context_width == cfg.d_model,
        "q/k swapped": cfg.q_width == cfg.k_width and cfg.kdim == cfg.d_model and not latent,
        # with attention_k_eq_v w_v is w_k: swapping them changes nothing
        "k/v swapped": cfg.k_width == cfg.v_width and cfg.kdim == cfg.vdim and not cfg.attention_k_eq_v and not latent,
        "packed blocks, read per head": packing_applies(cfg) and cfg.n_heads > 1 and not latent,  # one head: same
        "scale twice": cfg.scale != 1.0,
        "scale missing": cfg.scale != 1.0,
        "causal hides diagonal": cfg.causal,
        "direct reshape": cfg.n_heads > 1 and not latent,
        "merge (Dv, H)": cfg.n_heads > 1 and cfg.d_v > 1,
        "kv heads tiled": 1 < cfg.n_kv_heads < cfg.n_heads,
        "b_q dropped": cfg.bias and not latent,
        "b_o dropped": cfg.output_bias,
        # With two rotated features the two pairings are the same pair.
        "rope pairs swapped": cfg.rope is not None and cfg.rope_dims > 2,
        "rope missing": cfg.rope is not None,
        # A variant's bugs run only with their variant.
        **dict.fromkeys(VARIANT_BUGS, False),
        **{m.name: m.applies(cfg, Q_TOKENS) for entry in variants_on(cfg) for m in entry.planted_mistakes},
    }
    return [name for name in BUGS if runs.get(name, True)]


def planted_mistakes(cfg: MHAConfig, bug: str | None) -> dict[str, str]:
    """variant -> the mistake ``bug`` plants in it, among ``cfg``'s variants (empty: a 2017-23 bug, or none)."""
    return {e.name: m.mistake for e in variants_on(cfg) for m in e.planted_mistakes if m.name == bug}


def _steps(cfg: MHAConfig, place: str, mistakes: dict[str, str]):
    """(step, mistake) of each variant of ``cfg`` at ``place`` (a field of `PlantedSteps`), in registry order."""
    return steps_at(variants_on(cfg), place, mistakes, lambda e: e.diagnose and e.diagnose.planted)


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
    mistakes = planted_mistakes(cfg, bug)

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
        style = _rope_style(cfg, bug)  # with the frequencies of rope scaling, or None: the plain ones

        def project(turn):  # (q, k, v, k_raw): the projections, the head split, the QK-norms and rotary
            q = linear(query, w_q, b_q, bug == "w_q transposed")  # (B, Nq, H*Dk)
            k = linear(key, w_k, b_k)  # (B, Nk, Hkv*Dk)
            v = linear(value, w_v, b_v)  # (B, Nk, Hkv*Dv)
            for step, mistake in _steps(cfg, "projection", mistakes):  # a projection QK-norm
                q, k = step(cfg, params, q, k, mistake)
            if bug == "direct reshape":
                q, k, v = q.reshape(B, H, Nq, Dk), k.reshape(B, Hkv, Nk, Dk), v.reshape(B, Hkv, Nk, Dv)
            else:
                q = q.reshape(B, Nq, H, Dk).transpose(0, 2, 1, 3)  # (B, H, Nq, Dk)
                k = k.reshape(B, Nk, Hkv, Dk).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dk)
                v = v.reshape(B, Nk, Hkv, Dv).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dv)
            k_raw = k  # before the head norm and rotary (k_eq_v's values)
            for step, mistake in _steps(cfg, "heads", mistakes):  # a head QK-norm
                q, k = step(cfg, params, q, k, mistake)
            return turn(q), turn(k), v, k_raw

        def rotate(x, scaled):  # (B, n, N, d) rotated in the candidate's pairing (MLA: its latent step's too)
            return x if style is None else _numpy_rotary(x, style, cfg, scaled)

        q, k, v = planted_heads(cfg, params, query, key, lambda at: _steps(cfg, at, mistakes), rotate, project)
        if Hkv != H:
            group = H // Hkv
            if bug == "kv heads tiled":
                k, v = np.tile(k, (1, group, 1, 1)), np.tile(v, (1, group, 1, 1))  # (B, H, Nk, d)
            else:
                k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (B, H, Nk, d)
        scale = cfg.scale
        for step, mistake in _steps(cfg, "scale", mistakes):  # MLA's YaRN mscale
            scale = step(cfg, mistake)
        if bug == "scale twice":
            q = q * scale
        scores = q @ k.transpose(0, 1, 3, 2)  # (B, H, Nq, Nk)
        if bug != "scale missing":
            scores = scores * scale
        for step, mistake in _steps(cfg, "transform", mistakes):  # the logit cap
            scores = step(cfg, scores, mistake)
        for step, mistake in _steps(cfg, "bias", mistakes):  # ALiBi, T5's bias
            scores = scores + step(cfg, params, Nq, Nk, mistake)  # (B, H, Nq, Nk)
        allowed = np.ones((Nq, Nk), dtype=bool)
        if cfg.causal:
            allowed = np.tril(allowed, -1 if bug == "causal hides diagonal" else 0)
        for step, mistake in _steps(cfg, "mask", mistakes):  # the window
            allowed = allowed & step(cfg, Nq, Nk, mistake)
        if mask is not None:
            allowed = allowed & (~mask if bug == "mask inverted" else mask)
        scores = np.where(allowed, scores, -np.inf)
        for step, mistake in _steps(cfg, "masked", mistakes):  # a logit cap moved after the mask
            scores = step(cfg, scores, mistake)
        drop = False
        for step, mistake in _steps(cfg, "columns", mistakes):  # a sink column: (B, H, Nq, Nk+1)
            scores, v, drop = step(cfg, params, scores, v, mistake)
        axis = -2 if bug == "softmax over queries" else -1
        with np.errstate(invalid="ignore"):
            e = np.exp(scores - scores.max(axis=axis, keepdims=True))
            weights = e / e.sum(axis=axis, keepdims=True)
        if drop:
            weights = weights[..., :-1]  # (B, H, Nq, Nk) view: the sink's column dropped
        context = weights @ v  # (B, H, Nq, Dv)
        if bug == "merge (Dv, H)":
            merged = context.transpose(0, 2, 3, 1).reshape(B, Nq, Dv * H)  # (B, Nq, Dv, H) flattened: the bug
        else:
            merged = context.transpose(0, 2, 1, 3).reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv) copy
        for step, mistake in _steps(cfg, "output", mistakes):  # the output gate
            merged = step(cfg, params, query, merged, mistake)
        return linear(merged, w_o, b_o, bug == "w_o transposed")

    return candidate


def _numpy_rotary(x, style: str, cfg: MHAConfig, scaled=None):
    """Rotate the first rope_dims features of (B, heads, N, d) by position: half = rotate_half, else pairs.

    ``scaled``: (inv_freq, factor on cos and sin) of scaled rotary (the rope scaling entry's planted step).
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
    """The same bugs in torch idioms (`backends.injected_torch`: F.linear, view/transpose, masked_fill); returns a torch tensor."""
    _check_bug(bug)
    return injected_torch.torch_candidate(cfg, bug, planted_mistakes(cfg, bug), _rope_style(cfg, bug))
