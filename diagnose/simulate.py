"""The spec pipeline with switchable convention errors: what a candidate with one bug computes.

`Bug` holds one knob per cause code; `simulate(cfg, params, probe, bug)` runs the float64
pipeline of `core.reference` with those knobs turned (an empty `Bug()` gives the oracle's
output). The diagnosis ranks hypotheses by how well each simulated output matches the
candidate's. This code is written apart from the injected candidates of `diagnose.injected`
(which make the same mistakes the way a user's code would), so a test that diagnoses those
candidates checks the simulator against independent code.

Every knob says what the candidate does instead of the spec:

- ``transposed``: weights used as ``x @ W`` instead of ``x @ W.T`` (square weights only).
- ``swapped``: two projections' weights and biases exchanged (``("q", "k")``).
- ``packing``: the candidate packs q, k, v into one ``(3E, E)`` matrix in one layout and
  reads it back in the other (``"blocks->interleaved"`` or ``"interleaved->blocks"``).
- ``scale``: the factor applied to ``Q K^T`` instead of ``cfg.scale``.
- ``softmax_axis``: -2 normalises over queries instead of keys.
- ``mask_inverted``: the boolean mask read as True = blocked.
- ``causal``: ``"strict"`` (the diagonal hidden too, j < i), ``"ahead"`` (j <= i + 1),
  ``"bottom_right"`` (aligned to the last key when Nk != Nq).
- ``head_split``: ``"direct"``: (B, N, H*Dk) reshaped straight to (B, H, N, Dk);
  ``"direct_undone"``: and merged back the same way.
- ``merge_order``: context merged as (Dv, H) instead of (H, Dv).
- ``gqa_tiled``: query head h reads kv head ``h % Hkv`` instead of ``h // (H / Hkv)``.
- ``bias_dropped``: biases left out (names); ``bias_misplaced``: ``"b_o before w_o"``.
- ``rope``: ``"other"`` rotates with the other pairing than ``cfg.rope`` (interleaved for
  half, or the reverse), ``"none"`` leaves q and k unrotated.
- ``mistakes``: (variant, mistake) pairs, the variants' mistakes. The variants' steps, right and
  mistaken, are their registry entries' (`core.variants`: each entry's ``diagnose.simulated``,
  `SimulatedSteps`, with the mistakes its `DiagnoseCause`s name); the simulator runs the steps of
  the variants the configuration has, in registry order, at the places `SimulatedSteps` lists:
  the projection's QK-norm before the head split, the head QK-norm after it, the rotary
  frequencies, Llama 4's QK-norm and temperature after rotary, the scores' transform (the logit
  cap) and biases (ALiBi, T5), the window in the mask, what a candidate does after the mask (a
  logit cap moved there), the softmax (with a sink) and what it adds to the context (a sink with a
  value). Positions are the defaults ``0 .. N-1`` of
  queries and keys (the probes pass none).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAParams,
    apply_rotary,
    causal_mask,
    inverse_frequencies,
    linear,
    softmax_with_empty_rows,
)
from mha_rosetta.core.config import ROPE_STYLES
from mha_rosetta.core.variants import steps_at, variants_on
from mha_rosetta.core.variants.mla import mla_on
from mha_rosetta.core.variants.mla_heads import head_stages


@dataclass(frozen=True)
class Bug:
    transposed: tuple[str, ...] = ()  # weight names, e.g. ("w_q",)
    swapped: tuple[str, str] | None = None
    packing: str | None = None
    scale: float | None = None
    softmax_axis: int = -1
    mask_inverted: bool = False
    causal: str | None = None
    head_split: str | None = None
    merge_order: bool = False
    gqa_tiled: bool = False
    bias_dropped: tuple[str, ...] = ()
    bias_misplaced: str | None = None
    rope: str | None = None
    # The variants' mistakes: (variant, a `DiagnoseCause.mistake` of its entry), e.g. (("window", "one_more"),).
    mistakes: tuple[tuple[str, str], ...] = ()

    def combine(self, other: Bug) -> Bug:
        """Both bugs at once (knobs of ``other`` that differ from the default win; the variants' mistakes add up)."""
        changes = {k: v for k, v in other.__dict__.items() if v != getattr(Bug(), k)}
        if other.mistakes:
            changes["mistakes"] = tuple({**dict(self.mistakes), **dict(other.mistakes)}.items())
        return replace(self, **changes)


def _variant_steps(cfg: MHAConfig, place: str, bug: Bug):
    """(step, mistake) of each variant of ``cfg`` that acts at ``place`` (a field of `SimulatedSteps`), in registry order."""
    return steps_at(variants_on(cfg), place, dict(bug.mistakes), lambda e: e.diagnose and e.diagnose.simulated)


def normed(cfg: MHAConfig, p: MHAParams, q, k, place: str, bug: Bug = Bug()):
    """q and k after the variants' steps at ``place``: "projection" (before the head split) or "heads" (after it)."""
    for step, mistake in _variant_steps(cfg, place, bug):
        q, k = step(cfg, p, q, k, mistake)
    return q, k


def after_rotary(cfg: MHAConfig, p: MHAParams, q_h, k_h, positions, bug: Bug = Bug()):
    """Rotated q (B, H, Nq, Dk) and k (B, Hkv, Nk, Dk) after the variants' steps there (Llama 4's QK-norm after
    rotary, then its temperature), the queries at ``positions`` (1|B, Nq)."""
    for step, mistake in _variant_steps(cfg, "rotated", bug):
        q_h, k_h = step(cfg, p, q_h, k_h, positions, mistake)
    return q_h, k_h


def transformed(cfg: MHAConfig, scores, bug: Bug = Bug()):
    """The scaled (B, H, Nq, Nk) scores after the variants' elementwise transforms (the logit cap)."""
    for step, mistake in _variant_steps(cfg, "transform", bug):
        scores = step(cfg, scores, mistake)
    return scores


def weights_of(cfg: MHAConfig, p: MHAParams, masked, bug: Bug = Bug()):
    """The softmax over keys of the masked (B, H, Nq, Nk) scores: a variant's (with a sink logit), or the spec's plain one."""
    for step, mistake in _variant_steps(cfg, "softmax", bug):
        return step(cfg, p, masked, mistake)
    return softmax_with_empty_rows(masked)


def pack_qkv(cfg: MHAConfig, w_q, w_k, w_v, layout: str) -> np.ndarray:
    """Stack three (H*Dk, ...) arrays as blocks [q; k; v] or per head [q_0; k_0; v_0; q_1; ...]."""
    if layout == "blocks":
        return np.concatenate([w_q, w_k, w_v], axis=0)  # (3*H*Dk, ...) copy
    per_head = np.stack([a.reshape(cfg.n_heads, cfg.d_k, *a.shape[1:]) for a in (w_q, w_k, w_v)], axis=1)
    return per_head.reshape(3 * cfg.n_heads * cfg.d_k, *w_q.shape[1:])  # (H, 3, Dk, ...) -> (3*H*Dk, ...) copy


def unpack_qkv(cfg: MHAConfig, packed, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of `pack_qkv` for the same layout."""
    width = cfg.n_heads * cfg.d_k
    if layout == "blocks":
        return packed[:width], packed[width : 2 * width], packed[2 * width :]
    per_head = packed.reshape(cfg.n_heads, 3, cfg.d_k, *packed.shape[1:])  # (H, 3, Dk, ...) view
    return tuple(per_head[:, i].reshape(width, *packed.shape[1:]) for i in range(3))


def packing_applies(cfg: MHAConfig) -> bool:
    """One (3E, E) matrix holds q, k and v only when all three have the same shape."""
    return cfg.n_kv_heads == cfg.n_heads and cfg.d_v == cfg.d_k and cfg.kdim == cfg.vdim == cfg.d_model


def params_as_used(cfg: MHAConfig, params: MHAParams, bug: Bug) -> MHAParams:
    """The parameters a candidate with ``bug`` effectively multiplies with (spec orientation)."""
    p = params.as_dict()
    if bug.packing:
        written, read = bug.packing.split("->")
        for kind in ("w", "b"):
            if p[f"{kind}_q"] is not None:
                packed = pack_qkv(cfg, p[f"{kind}_q"], p[f"{kind}_k"], p[f"{kind}_v"], written)
                p[f"{kind}_q"], p[f"{kind}_k"], p[f"{kind}_v"] = unpack_qkv(cfg, packed, read)
    if bug.swapped:
        a, b = bug.swapped
        for kind in ("w", "b"):
            p[f"{kind}_{a}"], p[f"{kind}_{b}"] = p[f"{kind}_{b}"], p[f"{kind}_{a}"]
    for name in bug.transposed:
        p[name] = p[name].T
    for name in bug.bias_dropped:
        p[name] = None
    for step, mistake in _variant_steps(cfg, "params", bug):  # the gate read from the wrong rows
        p = step(cfg, p, mistake)
    return MHAParams(**p)


def simulate(cfg: MHAConfig, params: MHAParams, query, key, value, mask, bug: Bug = Bug()) -> np.ndarray:
    """Output (B, Nq, D) of the spec pipeline with ``bug``'s knobs turned (float64, batched inputs)."""
    p = params_as_used(cfg, params, bug)
    B, Nq, Nk = query.shape[0], query.shape[1], key.shape[1]
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    seq_len = max(Nq, Nk)  # one length for queries and keys (dynamic rope scaling reads it)
    if mla_on(cfg):  # MLA: the rotated heads and the values expanded from the latent of the key tokens
        q_h, k_h, v_h = latent_heads(cfg, p, query, key, bug, seq_len)
        return attend(cfg, p, query, q_h, k_h, v_h, k_h, mask, bug)

    q = linear(query, p.w_q, p.b_q)  # (B, Nq, H*Dk)
    k = linear(key, p.w_k, p.b_k)  # (B, Nk, Hkv*Dk)
    v = linear(value, p.w_v, p.b_v)  # (B, Nk, Hkv*Dv)
    q, k = normed(cfg, p, q, k, "projection", bug)  # a projection QK-norm: before the split
    if bug.head_split:
        q_h = q.reshape(B, H, Nq, Dk)  # the mistake: a reshape without the transpose mixes tokens and heads
        k_h = k.reshape(B, Hkv, Nk, Dk)
        v_h = v.reshape(B, Hkv, Nk, Dv)
    else:
        q_h = q.reshape(B, Nq, H, Dk).transpose(0, 2, 1, 3)  # (B, H, Nq, Dk) view
        k_h = k.reshape(B, Nk, Hkv, Dk).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dk) view
        v_h = v.reshape(B, Nk, Hkv, Dv).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dv) view
    k_raw = k_h  # the split keys before the head norm and rotary (k_eq_v's values)
    q_h, k_h = normed(cfg, p, q_h, k_h, "heads", bug)  # a head QK-norm: after the split
    q_h, k_h = rotate(cfg, q_h, bug, seq_len), rotate(cfg, k_h, bug, seq_len)
    return attend(cfg, p, query, q_h, k_h, v_h, k_raw, mask, bug)


def latent_heads(cfg: MHAConfig, p: MHAParams, query, key, bug: Bug, seq_len: int):
    """MLA's rotated q (B, H, Nq, Dk), k (B, H, Nk, Dk) and values (B, H, Nk, Dv), as the spec expands them from the
    latent of ``key`` (`core.variants.mla_heads`; its one input), turned by `rotate` in ``bug``'s pairing."""

    def turn(x, side):  # (B, [H,] N, d_rope) at positions 0..N-1
        return rotate(cfg, x, bug, seq_len) if x.ndim == 4 else rotate(cfg, x[:, None], bug, seq_len)[:, 0]

    stages = head_stages(cfg, p.as_dict(), query, key, key, turn)
    return stages["q_rotated"], stages["k_rotated"], stages["v_heads"]


def attend(cfg: MHAConfig, p: MHAParams, query, q_h, k_h, v_h, k_raw, mask, bug: Bug) -> np.ndarray:
    """The rest of `simulate` from the rotated heads: the variants' values and steps after rotary, the scores, masks,
    softmax, context, merge and output projection (``k_raw``: the keys before any norm or rotation)."""
    B, H, Nq, _ = q_h.shape
    Hkv, Nk, Dv = k_h.shape[1], k_h.shape[2], v_h.shape[-1]
    for step, mistake in _variant_steps(cfg, "values", bug):  # k_eq_v, the value norm (Gemma 4)
        v_h = step(cfg, p, v_h, k_raw, k_h, mistake)
    q_h, k_h = after_rotary(cfg, p, q_h, k_h, _positions(Nq, Nk)[0], bug)  # Llama 4's QK-norm, its temperature
    group = H // Hkv
    kv_of = [h % Hkv if bug.gqa_tiled else h // group for h in range(H)]
    scale = cfg.scale
    for step, mistake in _variant_steps(cfg, "scale", bug):  # MLA's YaRN mscale
        scale = step(cfg, mistake)
    scale = scale if bug.scale is None else bug.scale
    scores = scale * (q_h @ k_h[:, kv_of].swapaxes(-1, -2))  # (B, H, Nq, Nk)
    scores = transformed(cfg, scores, bug)  # the logit cap
    for step, mistake in _variant_steps(cfg, "bias", bug):  # ALiBi, T5's bias
        scores = scores + step(cfg, p, *_positions(Nq, Nk), mistake)  # (B, H, Nq, Nk)
    allowed = allowed_under(cfg, Nq, Nk, mask, bug)
    masked = scores if allowed is None else np.where(allowed, scores, -np.inf)
    for step, mistake in _variant_steps(cfg, "masked", bug):  # a logit cap moved after the mask
        masked = step(cfg, masked, mistake)
    if bug.softmax_axis == -1:
        weights = weights_of(cfg, p, masked, bug)  # (B, H, Nq, Nk)
    else:  # normalised over queries: a sink column is normalised on its own and dropped
        weights = np.swapaxes(softmax_with_empty_rows(np.swapaxes(masked, -1, -2)), -1, -2)
    context = weights @ v_h[:, kv_of]  # (B, H, Nq, Dv)
    for step, mistake in _variant_steps(cfg, "context", bug):  # a sink with a value
        context = context + step(cfg, weights, v_h[:, kv_of], mistake)
    if bug.head_split == "direct_undone":
        merged = context.reshape(B, Nq, H * Dv)  # the inverse of the direct reshape
    elif bug.merge_order:
        merged = context.transpose(0, 2, 3, 1).reshape(B, Nq, Dv * H)  # (B, Nq, Dv, H) -> (B, Nq, Dv*H) copy
    else:
        merged = context.transpose(0, 2, 1, 3).reshape(B, Nq, H * Dv)  # (B, Nq, H, Dv) -> (B, Nq, H*Dv) copy
    for step, mistake in _variant_steps(cfg, "output", bug):  # the output gate
        merged = step(cfg, p, query, merged, mistake)
    if bug.bias_misplaced == "b_o before w_o":  # offered only with an output bias (cfg.output_bias)
        return (merged + p.b_o) @ p.w_o.T
    return linear(merged, p.w_o, p.b_o)


def other_rope_style(style: str) -> str:
    return next(s for s in ROPE_STYLES if s != style)


def rotate(cfg: MHAConfig, heads: np.ndarray, bug: Bug = Bug(), seq_len: int | None = None) -> np.ndarray:
    """Rotary embedding of (B, heads, N, Dk) at positions 0..N-1, in the style ``bug`` uses (as given without rope).

    ``seq_len`` (1 + the largest position of the call, N by default) is read by dynamic rope scaling only.
    """
    if cfg.rope is None or bug.rope == "none":
        return heads
    style = other_rope_style(cfg.rope) if bug.rope == "other" else cfg.rope
    inv_freq, factor = inverse_frequencies(cfg.rope_dims, cfg.rope_base), 1.0  # (r/2,); the factor: YaRN's
    for step, mistake in _variant_steps(cfg, "frequencies", bug):  # rope scaling
        inv_freq, factor = step(cfg, heads.shape[-2] if seq_len is None else seq_len, mistake)
    angle = np.arange(heads.shape[-2])[:, None] * inv_freq  # (N, r/2)
    return apply_rotary(heads, factor * np.cos(angle), factor * np.sin(angle), style)


def allowed_under(cfg: MHAConfig, q_tokens: int, kv_tokens: int, mask, bug: Bug = Bug()):
    """The combined mask (B or 1, H or 1, Nq, Nk) a candidate with ``bug`` uses, or None."""
    allowed = None
    if mask is not None:
        allowed = ~mask if bug.mask_inverted else mask
    if cfg.causal:
        i = np.arange(q_tokens)[:, None]
        j = np.arange(kv_tokens)[None, :]
        causal = {
            None: causal_mask(q_tokens, kv_tokens),
            "strict": j < i,
            "ahead": j <= i + 1,
            "bottom_right": j <= i + (kv_tokens - q_tokens),
        }[bug.causal][None, None]  # (1, 1, Nq, Nk)
        allowed = causal if allowed is None else allowed & causal
    for step, mistake in _variant_steps(cfg, "allowed", bug):  # the window
        window = step(cfg, *_positions(q_tokens, kv_tokens), mistake)  # (1, 1, Nq, Nk)
        allowed = window if allowed is None else allowed & window
    return allowed


def _positions(q_tokens: int, kv_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(q_tokens)[None], np.arange(kv_tokens)[None]  # (1, Nq), (1, Nk)


def unsimulated_reason(cfg: MHAConfig) -> str | None:
    """Why diagnose cannot judge ``cfg`` (None: it can): a variant on in it that adds stages of its own and has no
    `DiagnoseSpec` (one registered from outside without one) has no step in `simulate`, diagnose's oracle and
    hypotheses, so a correct candidate would look wrong."""
    lacking = [entry.name for entry in variants_on(cfg) if entry.diagnose is None and entry.stages]
    if not lacking:
        return None
    return (
        f"diagnose's simulator does not reproduce the spec for {cfg.describe()} (variants: {', '.join(lacking)} "
        "have no step in it yet, no DiagnoseSpec in their registry entries), so no candidate can be judged against it"
    )
