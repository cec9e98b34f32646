"""Validation and normalisation of the tensors a caller passes to an MHA forward pass.

The exchange layout at the API boundary is row samples, ``(batch, tokens, features)``,
as NumPy arrays; an unbatched call passes ``(tokens, features)`` and gets the same back.
Every implementation calls `prepare_inputs` first, so every one rejects the same bad
input with the same message.

Zero-length axes (no batch, no tokens) are rejected: frameworks disagree on them
(some raise, some return empty or NaN), and an attention over nothing has no value
to check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import MHAConfig, require_config
from .variants import allowed_by_masks


class BatchedTokens:
    """``batch`` and ``tokens`` of a record whose ``x`` is a batch of row samples, (B, N, features)."""

    x: np.ndarray

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @property
    def tokens(self) -> int:
        return self.x.shape[1]


@dataclass(frozen=True)
class MHAInputs:
    """Inputs in batched form: ``query (B, Nq, D)``, ``key (B, Nk, kdim)``, ``value (B, Nk, vdim)``.

    ``mask`` is None or a boolean array of 4 dims broadcastable to ``(B, H, Nq, Nk)``
    (True = may attend), exactly as the caller gave it apart from leading unit axes.
    ``batched`` says whether the caller's arrays had a batch axis, so results can be
    returned in the caller's form. ``positions`` ``(1|B, Nq)`` and ``kv_positions``
    ``(1|B, Nk)`` are the int64 token positions the rotary embedding turns queries and
    keys by (see `prepare_inputs` for the defaults); they change nothing without rope.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    mask: np.ndarray | None
    batched: bool
    # Always set by prepare_inputs (the ignore tells a type checker so, once); None only here.
    positions: np.ndarray = None  # type: ignore[assignment]
    kv_positions: np.ndarray = None  # type: ignore[assignment]

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_tokens(self) -> int:
        return self.query.shape[1]

    @property
    def kv_tokens(self) -> int:
        return self.key.shape[1]

    def unbatch(self, array):
        """Drop the batch axis again for callers that passed unbatched inputs."""
        return array if self.batched else array[0]


def _as_float_array(name: str, value) -> np.ndarray:
    if value is None:
        raise TypeError(f"{name} must be an array of shape (batch, tokens, features), got None")
    array = np.asarray(value)
    if array.dtype == np.bool_ or array.dtype.kind in "iub":
        raise TypeError(
            f"{name} must hold floating-point numbers, got dtype {array.dtype}; "
            f"convert it first, e.g. {name}.astype(np.float32)"
        )
    if array.dtype.kind == "c":
        raise TypeError(f"{name} must be real, got complex dtype {array.dtype}")
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be a floating-point array, got dtype {array.dtype}")
    return array


def _check_rank_and_width(name: str, array: np.ndarray, width: int, width_name: str, batched: bool) -> None:
    expected = f"(batch, tokens, {width_name}={width})" if batched else f"(tokens, {width_name}={width})"
    if array.ndim != (3 if batched else 2):
        raise ValueError(f"{name} must have shape {expected}, got shape {array.shape}")
    if array.shape[-1] != width:
        raise ValueError(f"{name} must have shape {expected}, got last axis {array.shape[-1]} (shape {array.shape})")
    if 0 in array.shape:
        raise ValueError(
            f"{name} has a zero-length axis (shape {array.shape}); at least one batch item and token are required"
        )


def prepare_inputs(
    cfg: MHAConfig, query, key=None, value=None, mask=None, positions=None, kv_positions=None
) -> MHAInputs:
    """Check the inputs against ``cfg`` and return them in batched form.

    ``key`` defaults to ``query`` and ``value`` to ``key`` (self-attention).

    ``positions`` are the query tokens' positions for the rotary embedding, integers of
    shape ``(Nq,)`` or, for a batched call, ``(B, Nq)``; the default is ``0 .. Nq-1``.
    ``kv_positions`` are the keys' positions, ``(Nk,)`` or ``(B, Nk)``; the default is
    ``positions`` for self-attention (the keys are the query tokens) and ``0 .. Nk-1``
    otherwise. A decoding step with a cache of Nk keys passes
    ``positions=np.arange(Nk - Nq, Nk)`` and the cached keys keep ``0 .. Nk-1``. Both are
    validated always and used only when ``cfg.rope`` is set.
    """
    require_config(cfg)
    self_attention = key is None
    query = _as_float_array("query", query)
    key = query if key is None else _as_float_array("key", key)
    value = key if value is None else _as_float_array("value", value)
    if query.ndim not in (2, 3):
        raise ValueError(
            f"query must have shape (batch, tokens, d_model={cfg.d_model}) or (tokens, d_model={cfg.d_model}), "
            f"got shape {query.shape}"
        )
    batched = query.ndim == 3
    _check_rank_and_width("query", query, cfg.d_model, "d_model", batched)
    _check_rank_and_width("key", key, cfg.kdim, "kdim", batched)
    _check_rank_and_width("value", value, cfg.vdim, "vdim", batched)
    if not batched:
        # (N, F) -> (1, N, F): one code path for batched and unbatched calls.
        query, key, value = query[None], key[None], value[None]
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must have the same batch and token counts, got key {key.shape} and value {value.shape}"
        )
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"query and key must have the same batch size, got {query.shape[0]} and {key.shape[0]}")
    full_shape = (query.shape[0], cfg.n_heads, query.shape[1], key.shape[1])
    positions = normalise_positions("positions", positions, query.shape[0], query.shape[1], batched)
    if kv_positions is None and self_attention:
        kv_positions = positions
    else:
        kv_positions = normalise_positions("kv_positions", kv_positions, key.shape[0], key.shape[1], batched)
    return MHAInputs(query, key, value, _normalise_mask(mask, full_shape, batched), batched, positions, kv_positions)


def normalise_positions(name: str, positions, batch: int, tokens: int, batched: bool) -> np.ndarray:
    """Integer positions -> int64 ``(1|B, tokens)``; None -> ``0 .. tokens-1``."""
    if positions is None:
        return np.arange(tokens, dtype=np.int64)[None]  # (1, N)
    array = np.asarray(positions)
    if array.dtype == np.bool_ or array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (token positions), got dtype {array.dtype}")
    shapes = f"({tokens},) or (batch={batch}, {tokens})" if batched else f"({tokens},)"
    if array.shape not in ((tokens,), (batch, tokens) if batched else (tokens,)):
        raise ValueError(f"{name} must have shape {shapes}, got shape {array.shape}")
    return array.astype(np.int64).reshape(-1, tokens)  # (1|B, N)


def _normalise_mask(mask, full_shape: tuple[int, int, int, int], batched: bool) -> np.ndarray | None:
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(
            f"mask must be boolean with True = may attend, got dtype {mask.dtype}. "
            "(torch.nn.MultiheadAttention's masks use True = blocked; pass ~mask for those.)"
        )
    caller_shape = full_shape if batched else full_shape[1:]
    names = "(batch, heads, q_tokens, kv_tokens)" if batched else "(heads, q_tokens, kv_tokens)"
    if mask.ndim > len(caller_shape):
        raise ValueError(f"mask must broadcast to {names} = {caller_shape}, got {mask.ndim} dims (shape {mask.shape})")
    try:
        np.broadcast_shapes(mask.shape, caller_shape)
        fits = np.broadcast_shapes(mask.shape, caller_shape) == caller_shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to {names} = {caller_shape}")
    # Leading unit axes up to 4 dims, e.g. (Nq, Nk) -> (1, 1, Nq, Nk).
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def causal_mask(q_tokens: int, kv_tokens: int) -> np.ndarray:
    """(Nq, Nk) boolean, True where query i may attend key j: j <= i (top-left aligned).

    Top-left is what torch's ``is_causal=True`` and ``jax.nn.dot_product_attention``'s
    ``is_causal=True`` do. With more keys than queries (a KV cache) users often want
    bottom-right alignment instead; pass that as an explicit mask.
    """
    return np.tril(np.ones((q_tokens, kv_tokens), dtype=bool))


def causal_allowed(positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """Causality on positions, bool (1|B, 1, Nq, Nk): key j is visible to query i iff ``p_j <= p_i``.

    With the default positions and Nq = Nk this is the top-left rule ``j <= i``. For a decode
    step (queries at ``Nk-Nq .. Nk-1`` over ``Nk`` cached keys at ``0 .. Nk-1``) it is the
    bottom-right rule of Hugging Face and FlashAttention.
    """
    return (kv_positions[:, None, :] <= positions[:, :, None])[:, None]


def causal_on_indices(inputs: MHAInputs) -> bool:
    """True when causality on these positions is the top-left rule on indices (``j <= i``).

    That is the rule of torch's ``is_causal=True``, ``jax.nn.dot_product_attention(is_causal=True)``
    and the chunked strategies' tile skipping; an implementation that uses one of those is right
    exactly when this holds (`Backend.causal_on_positions` says which do not need it).
    """
    q_pos, k_pos = inputs.positions, inputs.kv_positions  # (1|B, Nq), (1|B, Nk)
    if np.array_equal(q_pos, np.arange(q_pos.shape[1])[None].repeat(len(q_pos), 0)) and np.array_equal(
        k_pos, np.arange(k_pos.shape[1])[None].repeat(len(k_pos), 0)
    ):
        return True  # the default positions: nothing to compare
    keys = np.arange(k_pos.shape[1])
    for start in range(0, q_pos.shape[1], 256):  # a block of query rows at a time: memory O(256 Nk), not O(Nq Nk)
        rows = np.arange(start, min(start + 256, q_pos.shape[1]))
        by_positions = k_pos[:, None, :] <= q_pos[:, rows, None]  # (1|B, rows, Nk)
        if not np.array_equal(
            by_positions, np.broadcast_to(keys[None, None, :] <= rows[None, :, None], by_positions.shape)
        ):
            return False
    return True


def allowed_positions(cfg: MHAConfig, inputs: MHAInputs) -> np.ndarray | None:
    """The combined mask (user mask AND causal AND the window), 4 dims broadcastable to (B, H, Nq, Nk), or None.

    Causality and the window are read on the token positions (`causal_allowed`,
    the mask entries of `core.variants`, the window): with the default positions that is the top-left rule on
    indices, and on a decode step's positions it is bottom-right.
    """
    allowed = inputs.mask
    if cfg.causal:
        causal = causal_allowed(inputs.positions, inputs.kv_positions)  # (1|B, 1, Nq, Nk)
        allowed = causal if allowed is None else allowed & causal
    return allowed_by_masks(cfg, inputs.positions, inputs.kv_positions, allowed)  # the window's, (1|B, 1, Nq, Nk)
