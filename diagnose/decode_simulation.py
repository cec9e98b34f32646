"""The decode mistakes diagnose knows (`DecodeBug`, one switch each; `diagnose.decode`'s docstring says what
each does) and the float64 decode loop that makes them on purpose (`simulate_decode`), the simulation each
hypothesis is fitted with (`diagnose.decode` re-exports both)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, apply_rotary, linear
from mha_rosetta.core.decode import decode_allowed, prepare_decode_inputs, ring_capacity
from mha_rosetta.core.params import validate_params
from mha_rosetta.core.rotary import frequencies
from mha_rosetta.core.variants import score_bias
from mha_rosetta.core.variants.mla import mla_on
from mha_rosetta.core.variants.mla_heads import expand, latent_entries, latents, query_stages

from .simulate import Bug, _variant_steps, after_rotary, normed, transformed, weights_of


@dataclass(frozen=True)
class DecodeBug:
    """One switch per decode mistake (the module docstring says what each does); all off: the spec."""

    positions_not_offset: bool = False
    top_left_causal: str | None = None  # "multi" (steps of more than one query) or "every" (every step)
    empty_slots_attended: bool = False
    ring_off_by: int = 0  # +1: the ring keeps one slot more (a step sees W + 1 keys); -1: one less
    rotated_twice: bool = False
    # The variants' decode mistakes: (variant, a `DiagnoseCause.mistake` of its entry with ``decode``), e.g.
    # (("temperature", "not_offset"),).
    mistakes: tuple[tuple[str, str], ...] = ()

    @property
    def rotary(self) -> bool:
        """A mistake of the rotary positions: no output without rotary shows it."""
        return self.positions_not_offset or self.rotated_twice

    def combine(self, other: DecodeBug) -> DecodeBug:
        """Both mistakes at once (switches of ``other`` that differ from the default win)."""
        changes = {k: v for k, v in other.__dict__.items() if v != getattr(DecodeBug(), k)}
        if other.mistakes:
            changes["mistakes"] = tuple({**dict(self.mistakes), **dict(other.mistakes)}.items())
        return replace(self, **changes)


# -- the simulated decode loop ------------------------------------------------------------------
def _rotate(cfg: MHAConfig, heads: np.ndarray, positions: np.ndarray, inv_freq, factor) -> np.ndarray:
    """(B, n, T, Dk) heads turned by their (B, T) positions (unchanged without rope)."""
    if cfg.rope is None:
        return heads
    angle = positions[..., None].astype(np.float64) * inv_freq  # (B, T, r/2)
    cos, sin = factor * np.cos(angle)[:, None], factor * np.sin(angle)[:, None]  # (B, 1, T, r/2)
    return apply_rotary(heads, cos, sin, cfg.rope)


def simulate_decode(
    cfg: MHAConfig, params: MHAParams, x, *, prefill, step=1, mask=None, positions=None, bug: DecodeBug = DecodeBug()
) -> np.ndarray:
    """Every token's output of a NumPy decode loop with ``bug``'s mistakes, (B, N, d_model) (or (N, d_model)).

    The loop: each chunk (`core.decode.DecodeInputs.chunks`) is projected, split into heads, QK-normed and
    rotated at its positions; its keys and values are appended to the cache ((B, Hkv, T, D), chronological
    order, Hkv heads: before the GQA repeat); with a window the cache keeps its last ``ring_capacity`` slots
    (after the prefill has attended within itself); the chunk's queries attend to the cache under
    `core.decode.decode_allowed`. With no mistake it equals `core.decode.reference_decode`.
    """
    inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step, mask=mask, positions=positions)
    validate_params(cfg, params)
    if not isinstance(bug, DecodeBug):
        raise TypeError(f"bug must be a DecodeBug, got {type(bug).__name__}")
    if bug.ring_off_by and cfg.window is None:
        raise ValueError("bug.ring_off_by needs a window (cfg.window): without one there is no ring buffer")
    if cfg.window is not None and cfg.window + bug.ring_off_by < 1:
        raise ValueError(f"bug.ring_off_by={bug.ring_off_by} leaves a window of {cfg.window + bug.ring_off_by} keys")
    p = MHAParams(
        **{name: None if a is None else np.asarray(a, dtype=np.float64) for name, a in params.as_dict().items()}
    )
    B, N = inputs.batch, inputs.tokens
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    valid = inputs.valid  # (B, N)
    # The frequencies of the whole sequence, as the full forward computes them (dynamic scaling reads seq_len).
    inv_freq, factor = frequencies(cfg, int(inputs.positions.max()) + 1) if cfg.rope else (None, 1.0)
    step_cfg = cfg if not bug.ring_off_by else replace(cfg, window=cfg.window + bug.ring_off_by)
    ring = ring_capacity(step_cfg, inputs.step)  # the candidate's ring (None without a window)
    capacity = N if ring is None else ring  # a static cache's slots
    kv_of = [cfg.kv_head_of(h) for h in range(H)]
    variant_bug = Bug(mistakes=bug.mistakes)  # the variants' steps, with their decode mistakes

    latent = mla_on(cfg)  # MLA: the cache holds each token's latent and rotated shared key, expanded on read
    # The cache, chronological: (B, Hkv, T, Dk) keys and (B, Hkv, T, Dv) values, or MLA's (B, 1, T, R) latents and
    # (B, 1, T, dr) shared keys.
    K = np.zeros((B, 1, 0, cfg.kv_lora_rank) if latent else (B, Hkv, 0, Dk))
    V = np.zeros((B, 1, 0, cfg.qk_rope_head_dim) if latent else (B, Hkv, 0, Dv))
    K_pos = np.zeros((B, 0), dtype=np.int64)  # (B, T): each slot's position
    K_valid = np.zeros((B, 0), dtype=bool)  # (B, T): the slot holds a real token
    outputs = []
    for start, stop in inputs.chunks():
        s, is_step = stop - start, start > 0
        xs = inputs.x[:, start:stop]  # (B, s, D) view
        pos = inputs.positions[:, start:stop]  # (B, s)
        rot_pos = np.broadcast_to(np.arange(s), (B, s)) if bug.positions_not_offset else pos  # (B, s)

        def turn(heads, at=rot_pos):  # (B, n, s or T, d) turned by the (B, s or T) positions ``at``
            return _rotate(cfg, heads, at, inv_freq, factor)

        if latent:
            q_h, k_h, v_h = _latent_chunk(cfg, p, xs, turn, variant_bug)
        else:
            q_h, k_h, v_h = _heads_chunk(cfg, p, xs, turn, variant_bug)
        # Llama 4's QK-norm after rotary and its temperature at the chunk's positions (the cache holds normed keys).
        q_h, k_h = after_rotary(cfg, p, q_h, k_h, pos, variant_bug)
        # Write: append the chunk (copies), then a step's ring keeps its last slots.
        K, V = np.concatenate([K, k_h], axis=2), np.concatenate([V, v_h], axis=2)
        K_pos = np.concatenate([K_pos, pos], axis=1)
        K_valid = np.concatenate([K_valid, valid[:, start:stop]], axis=1)
        if ring is not None and is_step:
            K, V, K_pos, K_valid = K[:, :, -ring:], V[:, :, -ring:], K_pos[:, -ring:], K_valid[:, -ring:]
        # Read.
        if latent:  # the keys [W_UK c | k_rope] and values W_UV c of every head from the cache: (B, H, T, d)
            keys, values_read = _expand(cfg, p, K, turn(V, K_pos) if bug.rotated_twice else V)
        else:
            keys = turn(K, K_pos) if bug.rotated_twice else K  # (B, Hkv, T, Dk)
            values_read = V
        T = keys.shape[2]
        top_left = bug.top_left_causal == "every" or (bug.top_left_causal == "multi" and s > 1)
        if is_step and top_left:  # query i sees slots 0..i, whatever their positions; padding and window kept
            allowed = (np.arange(T)[None, :] <= np.arange(s)[:, None])[None, None] & K_valid[:, None, None, :]
            if cfg.window is not None:
                allowed &= K_pos[:, None, None, :] > pos[:, None, :, None] - cfg.window
        else:
            allowed = decode_allowed(step_cfg if is_step else cfg, pos, K_pos, K_valid)  # (B, 1, s, T)
        scores = cfg.scale * (q_h @ keys[:, kv_of].swapaxes(-1, -2))  # (B, H, s, T)
        scores = transformed(cfg, scores, variant_bug)  # the logit cap
        bias = score_bias(cfg, p.rel_bias, pos, K_pos)  # (B, H, s, T) or None: as the spec adds the biases
        if bias is not None:
            scores = scores + bias
        masked = np.where(allowed, scores, -np.inf)  # (B, H, s, T)
        values = values_read[:, kv_of]  # (B, H, T, Dv) copy
        empty = max(0, capacity - T)  # a static cache's unwritten slots
        if bug.empty_slots_attended and empty > 0:  # zero keys (score 0) and zero values, attended
            masked = np.concatenate([masked, np.zeros((B, H, s, empty))], axis=-1)  # (B, H, s, T + E)
            values = np.concatenate([values, np.zeros((B, H, empty, Dv))], axis=2)  # (B, H, T + E, Dv)
        weights = weights_of(cfg, p, masked, variant_bug)  # (with a sink logit)
        context = weights @ values  # (B, H, s, Dv)
        merged = context.transpose(0, 2, 1, 3).reshape(B, s, H * Dv)  # (B, s, H, Dv) -> (B, s, H*Dv) copy
        for step, mistake in _variant_steps(cfg, "output", variant_bug):  # the output gate, on this chunk's tokens
            merged = step(cfg, p, xs, merged, mistake)
        outputs.append(linear(merged, p.w_o, p.b_o))  # (B, s, D)
        if ring is not None and not is_step:  # the prefill attended within itself: now keep the ring's slots
            K, V, K_pos, K_valid = K[:, :, -ring:], V[:, :, -ring:], K_pos[:, -ring:], K_valid[:, -ring:]
    return inputs.unbatch(np.concatenate(outputs, axis=1))  # (B, N, D)


def _heads_chunk(cfg: MHAConfig, p: MHAParams, xs, turn, variant_bug: Bug):
    """A chunk's rotated queries (B, H, s, Dk), and the keys (B, Hkv, s, Dk) and values (B, Hkv, s, Dv) it caches."""
    B, s = xs.shape[:2]
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    q, k, v = linear(xs, p.w_q, p.b_q), linear(xs, p.w_k, p.b_k), linear(xs, p.w_v, p.b_v)
    q, k = normed(cfg, p, q, k, "projection", variant_bug)  # the variants' steps (a projection QK-norm)
    q_h = q.reshape(B, s, H, Dk).transpose(0, 2, 1, 3)  # (B, H, s, Dk) view
    k_h = k.reshape(B, s, Hkv, Dk).transpose(0, 2, 1, 3)  # (B, Hkv, s, Dk) view
    v_h = v.reshape(B, s, Hkv, Dv).transpose(0, 2, 1, 3)  # (B, Hkv, s, Dv) view
    k_raw = k_h  # before the head norm and rotary (k_eq_v's values)
    q_h, k_h = normed(cfg, p, q_h, k_h, "heads", variant_bug)  # (a head QK-norm)
    q_h, k_h = turn(q_h), turn(k_h)
    for step, mistake in _variant_steps(cfg, "values", variant_bug):  # the cache holds the normed values (Gemma 4)
        v_h = step(cfg, p, v_h, k_raw, k_h, mistake)
    return q_h, k_h, v_h


def _latent_chunk(cfg: MHAConfig, p: MHAParams, xs, turn, variant_bug: Bug):
    """MLA: a chunk's rotated queries (B, H, s, Dk), and what it caches (`core.variants.mla_heads`): the latents
    (B, 1, s, R) and the rotated shared keys (B, 1, s, dr), or what a decode mistake caches in their place."""
    weights = p.as_dict()

    def rotate(x, side):  # (B, [H,] s, dr): queries and keys of a chunk share its positions
        return turn(x) if x.ndim == 4 else turn(x[:, None])[:, 0]

    raw = latents(cfg, weights, xs, xs)  # c (B, s, R) and k_pe (B, s, dr), before the norm and rotary
    entries = latent_entries(cfg, weights, xs, rotate)  # kv_latent (B, s, R), k_rope (B, s, dr): the spec's cache
    for step, mistake in _variant_steps(cfg, "cached", variant_bug):  # the un-normalised latent, an unrotated k_rope
        entries = step(cfg, p, entries, (raw["c"], raw["k_pe"]), mistake)
    q_h = query_stages(cfg, weights, xs, rotate)["q_rotated"]  # (B, H, s, Dk)
    return q_h, entries[0][:, None], entries[1][:, None]  # (B, 1, s, R), (B, 1, s, dr) views


def _expand(cfg: MHAConfig, p: MHAParams, latent_cache, k_rope_cache):
    """The naive form's keys (B, H, T, Dk) and values (B, H, T, Dv) from MLA's cache, (B, 1, T, R) and (B, 1, T, dr)."""
    B, _, T, _ = latent_cache.shape
    H, dn, dr = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    k_nope, v = expand(cfg, p.as_dict(), latent_cache[:, 0])  # (B, T, H*dn), (B, T, H*dv)
    k_nope = k_nope.reshape(B, T, H, dn).transpose(0, 2, 1, 3)  # (B, H, T, dn) view
    shared = np.broadcast_to(k_rope_cache, (B, H, T, dr))  # the one rotary key, every head (a view)
    values = v.reshape(B, T, H, cfg.d_v).transpose(0, 2, 1, 3)  # (B, H, T, dv) view
    return np.concatenate([k_nope, shared], axis=-1), values  # (B, H, T, Dk) copy
