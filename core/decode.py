"""KV-cache decoding, written down once: the inputs, the chunks, the caches' sizes and the oracle.

A decode run feeds one sequence ``x`` (B, N, d_model) through an implementation in chunks:
the first ``prefill`` tokens as one forward that fills the cache, then the rest ``step``
tokens at a time through the implementation's own cache. Every token's output together,
(B, N, d_model), must equal the full causal forward of ``x`` (`reference_decode`): caching
changes how the work is split, never the numbers.

Rules every implementation follows (the decode check holds them to these):

* Causality and the window are read on positions (`core.inputs.causal_allowed`): a step's
  queries sit at the last positions of the cache, so the rule is bottom-right on indices.
* Keys are cached after QK-norm and rotary and before the GQA repetition (Hugging Face's
  place): the cache holds ``Hkv`` heads, never ``H``.
* The positions: given per token, ``(N,)`` or ``(B, N)``, never decreasing along a sequence,
  and strictly increasing over the real tokens (pads may share a position: they are masked).
  Their default is ``0 .. N-1`` and, with a padding mask, ``cumsum(mask) - 1`` per item, as
  Hugging Face's ``generate`` computes them (left padding puts its pads at position -1, where
  they see only pads and give the spec's empty-row answer).
* A sliding window keeps a ring buffer of ``W - 1 + step`` slots (`ring_capacity`; W slots
  when one token is fed at a time): memory O(W), not O(N). A ring buffer holds the last
  slots by index, so with a window the real tokens' positions must advance by one per token
  (left padding is fine; right padding followed by more tokens is not, and is refused).
* A static cache has a fixed capacity: writing past it is an error (`check_capacity`), never
  a silent wrap.

The decode step's stages (`decode_stage_names`) are the token-wise ones: everything before
the scores (the step's new tokens' q, k, v, heads, normed and rotated) and after the weights
(context, merged, output), with the step's tokens on the token axis. They are compared with
the full forward's stages sliced to the step's tokens (`reference_decode_stages`), which is
how a disagreement is named: "step 3 (position 7) diverges at q_rotated".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import MHAConfig
from .inputs import BatchedTokens, normalise_positions
from .params import MHAParams
from .reference import reference_stages
from .stages import STAGE_BY_NAME, stage_names
from .variants import allowed_by_masks

__all__ = [
    "CacheFull",
    "DecodeInputs",
    "cache_capacity",
    "check_capacity",
    "decode_allowed",
    "decode_stage_names",
    "padding_positions",
    "prepare_decode_inputs",
    "reference_decode",
    "reference_decode_stages",
    "ring_capacity",
    "token_axis",
]


class CacheFull(ValueError):
    """A static cache asked to hold more tokens than it was allocated for."""


@dataclass(frozen=True)
class DecodeInputs(BatchedTokens):
    """One decode run's inputs, checked and batched.

    x:         (B, N, d_model) float64, the whole sequence (prefill and the tokens fed after it).
    mask:      (B, N) bool padding mask, True for a real token, or None (every token real).
    positions: (B, N) int64, every token's position.
    prefill:   how many leading tokens the first forward takes.
    step:      how many tokens each later call takes (the last call may take fewer).
    batched:   whether the caller's x had a batch axis.
    """

    x: np.ndarray
    mask: np.ndarray | None
    positions: np.ndarray
    prefill: int
    step: int
    batched: bool

    @property
    def valid(self) -> np.ndarray:
        """(B, N) bool: True for a real token (all True without a padding mask)."""
        return np.ones(self.x.shape[:2], dtype=bool) if self.mask is None else self.mask

    def chunks(self) -> list[tuple[int, int]]:
        """The ``(start, stop)`` token ranges of the prefill and each later call, in order."""
        starts = [0, *range(self.prefill, self.tokens, self.step)]
        return [(start, min(start + (self.prefill if start == 0 else self.step), self.tokens)) for start in starts]

    def forward_mask(self) -> np.ndarray | None:
        """The padding mask as the full forward's key mask, (B, 1, 1, N) bool, or None."""
        return None if self.mask is None else self.mask[:, None, None, :]

    def unbatch(self, array: np.ndarray) -> np.ndarray:
        return array if self.batched else array[0]


def padding_positions(mask: np.ndarray) -> np.ndarray:
    """``cumsum(mask) - 1`` along the tokens: each real token's position, as ``generate`` computes it.

    (B, N) bool -> (B, N) int64. Left pads get -1; a pad after real tokens repeats the last
    real token's position.
    """
    return np.cumsum(mask, axis=-1, dtype=np.int64) - 1


def _check_count(name: str, value, low: int, high: int | None, rule: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int ({rule}), got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return int(value)


def prepare_decode_inputs(cfg: MHAConfig, x, *, prefill, step=1, mask=None, positions=None) -> DecodeInputs:
    """Check a decode run's arguments against ``cfg`` and return them batched (errors name the argument and the rule)."""
    if not isinstance(cfg, MHAConfig):
        raise TypeError(f"cfg must be an MHAConfig, got {type(cfg).__name__}")
    if not cfg.causal:
        raise ValueError(
            "decoding needs MHAConfig.causal=True: a token cannot attend to keys that are not cached yet, got causal=False"
        )
    if cfg.kdim != cfg.d_model or cfg.vdim != cfg.d_model:
        raise ValueError(
            f"decoding is self-attention: kdim and vdim must equal d_model={cfg.d_model}, got kdim={cfg.kdim}, "
            f"vdim={cfg.vdim}"
        )
    array = np.asarray(x)
    if array.dtype.kind not in "fiu" or array.dtype == np.bool_:
        raise TypeError(f"x must hold real numbers, got dtype {array.dtype}")
    if array.ndim not in (2, 3) or array.shape[-1] != cfg.d_model:
        raise ValueError(
            f"x must have shape (batch, tokens, d_model={cfg.d_model}) or (tokens, d_model={cfg.d_model}), "
            f"got shape {array.shape}"
        )
    batched = array.ndim == 3
    array = (array if batched else array[None]).astype(np.float64)  # (B, N, D), a copy
    B, N = array.shape[:2]
    prefill = _check_count("prefill", prefill, 1, N, f"between 1 and the sequence's {N} tokens")
    step = _check_count("step", step, 1, None, "at least 1 (tokens fed per call after the prefill)")
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean padding mask (True = a real token), got dtype {m.dtype}")
        shapes = f"({N},) or (batch={B}, {N})" if batched else f"({N},)"
        if m.shape not in ((N,), (B, N) if batched else (N,)):
            raise ValueError(f"mask must be a padding mask of shape {shapes}, got shape {m.shape}")
        mask = np.broadcast_to(m.reshape(-1, N), (B, N)).copy()  # (B, N)
    if positions is None:
        p = np.broadcast_to(np.arange(N, dtype=np.int64), (B, N)) if mask is None else padding_positions(mask)
    else:  # the forward's rule and messages (`core.inputs.normalise_positions`): integers, (N,) or (B, N)
        p = np.broadcast_to(normalise_positions("positions", positions, B, N, batched), (B, N))  # (B, N) view
    p = np.ascontiguousarray(p)  # (B, N) int64
    back = np.argwhere(np.diff(p, axis=-1) < 0)
    if back.size:
        b, t = (int(i) for i in back[0])
        raise ValueError(
            f"positions must not go backwards along a sequence: item {b} goes from {p[b, t]} at token {t} "
            f"to {p[b, t + 1]} at token {t + 1}"
        )
    valid = np.ones((B, N), dtype=bool) if mask is None else mask
    for b in range(B):  # a later real token at an earlier token's position would be visible before it is cached
        real = p[b, valid[b]]
        tie = np.flatnonzero(np.diff(real) == 0)
        if tie.size:
            t = int(np.flatnonzero(valid[b])[tie[0] + 1])
            raise ValueError(
                f"the real tokens' positions must strictly increase along a sequence (a cache cannot show a token "
                f"the key of a later one at the same position): item {b} repeats position {p[b, t]} at token {t}"
            )
    if cfg.window is not None:
        for b in range(B):
            real = np.flatnonzero(valid[b])
            offsets = p[b, real] - real
            if real.size and np.any(offsets != offsets[0]):
                raise ValueError(
                    f"with a window, a ring buffer keeps the last {ring_capacity(cfg, step)} slots by index, so "
                    f"the real tokens' positions must advance by one per token; item {b}'s do not (right padding "
                    "followed by more tokens): pad on the left instead"
                )
    return DecodeInputs(array, mask, p, prefill, step, batched)


def ring_capacity(cfg: MHAConfig, step: int) -> int | None:
    """The slots of a sliding-window ring buffer: ``W - 1 + step`` (W when one token is fed at a time), or None.

    The first of ``step`` new queries needs the ``W - 1`` keys before it; the last needs
    itself and the ``step - 1`` new ones before it, so the ring holds ``W - 1 + step``.
    """
    return None if cfg.window is None else cfg.window - 1 + step


def cache_capacity(cfg: MHAConfig, tokens: int, step: int) -> int:
    """How many slots a cache needs for a ``tokens``-long decode: the ring's with a window, else ``tokens``."""
    ring = ring_capacity(cfg, step)
    return tokens if ring is None else min(ring, tokens)


def check_capacity(capacity: int, used: int, adding: int) -> None:
    """A static cache of ``capacity`` slots holding ``used`` takes ``adding`` more, or `CacheFull` says why."""
    if used + adding > capacity:
        raise CacheFull(
            f"static cache capacity exceeded: it holds {used} of {capacity} slots and cannot take {adding} more "
            f"(allocate at least {used + adding})"
        )


def decode_allowed(cfg: MHAConfig, q_positions, k_positions, k_valid) -> np.ndarray:
    """Which cache slots a chunk's queries see, bool (B, 1, s, T): the causal rule and the mask entries on positions.

    ``q_positions`` (B, s): the chunk's query positions; ``k_positions`` (B, T): the position
    held in each cache slot; ``k_valid`` (B, T): the slot holds a real token (written, not
    padding). A slot that was never written must be invalid, whatever position it holds.
    """
    q = np.asarray(q_positions)[:, None, :, None]  # (B, 1, s, 1)
    k = np.asarray(k_positions)[:, None, None, :]  # (B, 1, 1, T)
    allowed = (k <= q) & np.asarray(k_valid)[:, None, None, :]
    # The positional mask entries (the window, Llama 4's chunks) on the same positions, (B, 1, s, T).
    return allowed_by_masks(cfg, np.asarray(q_positions), np.asarray(k_positions), allowed)


def _forward_args(inputs: DecodeInputs) -> dict:
    return {"mask": inputs.forward_mask(), "positions": inputs.positions}


def reference_decode(cfg: MHAConfig, params: MHAParams, x, *, prefill, step=1, mask=None, positions=None) -> np.ndarray:
    """The decode oracle: the full causal float64 forward of ``x``, (B, N, d_model) (or (N, d_model) unbatched).

    ``prefill`` and ``step`` are checked (they must describe a valid run) but do not change
    the answer: that is the property every cache must keep.
    """
    inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step, mask=mask, positions=positions)
    stages = reference_stages(cfg, params, inputs.x, **_forward_args(inputs))
    return inputs.unbatch(stages["output"])


def decode_stage_names(cfg: MHAConfig) -> tuple[str, ...]:
    """The token-wise stages of a decode step, in pipeline order: those without both a query and a key axis."""
    return tuple(
        name
        for name in stage_names(cfg)
        if not ("Nq" in STAGE_BY_NAME[name].shape and "Nk" in STAGE_BY_NAME[name].shape)
    )


def token_axis(name: str) -> int:
    """The token axis of the token-wise stage ``name`` (`decode_stage_names`) in its canonical shape: its query axis,
    else its key axis."""
    shape = STAGE_BY_NAME[name].shape
    return shape.index("Nq") if "Nq" in shape else shape.index("Nk")


def reference_decode_stages(cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs) -> list[dict[str, np.ndarray]]:
    """For each chunk of ``inputs.chunks()``, the full forward's token-wise stages sliced to its tokens (canonical)."""
    full = reference_stages(cfg, params, inputs.x, **_forward_args(inputs))
    out = []
    for start, stop in inputs.chunks():
        chunk = {}
        for name in decode_stage_names(cfg):
            chunk[name] = np.take(full[name], np.arange(start, stop), axis=token_axis(name))
        out.append(chunk)
    return out
