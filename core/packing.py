"""Packed sequences: documents laid one after another in one row, each attending only within itself.

A packed call passes ``(T, d_model)`` or ``(1, T, d_model)`` tokens and the packing as
``cu_seqlens`` (FlashAttention's offsets) or as Hugging Face's packed ``position_ids`` (a step
other than +1 starts a document). The spec turns it into an ordinary call on one row of T
tokens (`PackedCall`):

* positions restart per document (``0 .. L_b-1``; with ``position_ids``, the given ones), so
  rotary, ALiBi, T5's bias, windows and chunks all read positions within the document;
* the document mask, True where query and key lie in one document (`RaggedBatch.document_mask`),
  is ANDed into the mask, so no score crosses a document.

The result equals the per-document forward, concatenated (tests/test_packing.py proves it for
each positional variant). Self-attention only: packed cross-attention needs the keys' own
``cu_seqlens_k``, which is refused with that reason.

A padded call passes ``(B, N, d_model)`` rows with per-row lengths ``seq_lens`` (right padding,
``jax.nn.dot_product_attention``'s ``query_seq_lengths``; ``kv_seq_lens`` for the keys, by default
``seq_lens`` for self-attention). Padding keys are never attended. A padding query row has no key
at all, so by the spec's empty-row rule its weights and context are zero and its output is
``b_o`` (zero without bias): defined, never NaN, and the same in every implementation that runs it.
Left padding is spelled through ``positions`` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ragged import RaggedBatch

__all__ = ["RAGGED_OPTIONS", "RaggedCall", "ragged_arguments", "ragged_call"]

RAGGED_OPTIONS = ("cu_seqlens", "position_ids", "seq_lens", "kv_seq_lens")  # the keywords `ragged_call` reads


@dataclass(frozen=True)
class RaggedCall:
    """A packed or padded call as an ordinary one, in the caller's form: ``query``, the ``mask`` with the
    documents' or the lengths' rule ANDed in, ``positions`` (restarting per document for a packed call)."""

    batch: RaggedBatch  # the documents (packed) or the query rows' lengths (padded)
    query: np.ndarray
    mask: np.ndarray
    positions: np.ndarray | None


def _and_user_mask(allowed: np.ndarray, mask) -> np.ndarray:
    """``allowed`` (4 dims) AND the caller's boolean mask (leading unit axes added; its broadcast is checked later)."""
    if mask is None:
        return allowed
    user = np.asarray(mask)
    if user.dtype != np.bool_:
        raise TypeError(f"mask must be boolean with True = may attend, got dtype {user.dtype}")
    return allowed & user.reshape((1,) * (4 - user.ndim) + user.shape)


def ragged_call(cfg, query, key, value, mask, positions, kv_positions, **ragged) -> RaggedCall | None:
    """None for a rectangular call; otherwise the `RaggedCall` that runs it, every rule checked with a clear error.

    ``ragged``: the keywords of `RAGGED_OPTIONS` (``cu_seqlens``, ``position_ids``, ``seq_lens``, ``kv_seq_lens``).
    """
    unknown = sorted(set(ragged) - set(RAGGED_OPTIONS))
    if unknown:
        raise TypeError(f"unknown ragged-batch keywords {unknown}; they are {', '.join(RAGGED_OPTIONS)}")
    cu_seqlens, position_ids, seq_lens, kv_seq_lens = (ragged.get(name) for name in RAGGED_OPTIONS)
    packing = cu_seqlens is not None or position_ids is not None
    if packing and (seq_lens is not None or kv_seq_lens is not None):
        raise ValueError("a call is packed (cu_seqlens / position_ids) or padded (seq_lens), not both")
    if packing:
        return _packed(cfg, query, key, value, mask, positions, kv_positions, cu_seqlens, position_ids)
    if seq_lens is None and kv_seq_lens is None:
        return None
    return _padded(query, key, mask, positions, seq_lens, kv_seq_lens)


def ragged_arguments(cfg, query, key, value, mask, positions, kv_positions, **ragged) -> tuple:
    """``(query, mask, positions)`` that run the call as an ordinary one: a packed or padded call's (`ragged_call`,
    the rules in the module docstring), else the ones given. `reference_mha` and `Backend.run` read them so."""
    call = ragged_call(cfg, query, key, value, mask, positions, kv_positions, **ragged)
    return (query, mask, positions) if call is None else (call.query, call.mask, call.positions)


def _packed(cfg, query, key, value, mask, positions, kv_positions, cu_seqlens, position_ids) -> RaggedCall:
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("pass the packing once: cu_seqlens or position_ids, not both")
    if key is not None or value is not None:
        raise ValueError(
            "a packed call is self-attention: key and value must be None (packed cross-attention needs "
            "the keys' own cu_seqlens_k, which the spec does not take)"
        )
    if positions is not None or kv_positions is not None:
        raise ValueError(
            "positions come from the packing (restarting per document); pass position_ids, not positions or kv_positions"
        )
    array = np.asarray(query)
    if (array.ndim == 3 and array.shape[0] != 1) or array.ndim not in (2, 3):
        raise ValueError(
            f"a packed query must have shape (T, d_model={cfg.d_model}) or (1, T, d_model={cfg.d_model}), "
            f"got shape {array.shape}"
        )
    tokens = array.shape[-2]
    if cu_seqlens is not None:
        batch = RaggedBatch.from_cu_seqlens(cu_seqlens, total=tokens)
        pos = batch.position_ids(drop_empty=True)
    else:
        pos = np.asarray(position_ids)
        pos = pos[0] if pos.ndim == 2 and pos.shape[0] == 1 else pos  # HF's (1, T) -> (T,) view
        batch = RaggedBatch.from_position_ids(pos)
        if batch.total != tokens:
            raise ValueError(f"position_ids must have T={tokens} entries (the packed tokens), got {batch.total}")
    allowed = _and_user_mask(batch.document_mask(drop_empty=True)[None, None], mask)  # (1, 1|H, T, T)
    pos = pos.astype(np.int64)[None]  # (1, T)
    if array.ndim == 2:  # the caller's unbatched form: (1|H, T, T) and (T,)
        allowed, pos = allowed[0], pos[0]
    return RaggedCall(batch, array, allowed, pos)


def _padded(query, key, mask, positions, seq_lens, kv_seq_lens) -> RaggedCall:
    array = np.asarray(query)
    if array.ndim != 3:
        raise ValueError(f"seq_lens needs a padded batch (B, N, d_model), got query of shape {array.shape}")
    rows = RaggedBatch.from_seq_lens(seq_lens, array.shape[1]) if seq_lens is not None else None
    kv_tokens = array.shape[1] if key is None else np.shape(key)[1]
    if kv_seq_lens is None and key is None:
        kv_seq_lens = seq_lens  # self-attention: the keys are the query tokens
    keys = None if kv_seq_lens is None else RaggedBatch.from_seq_lens(kv_seq_lens, kv_tokens)
    allowed = np.ones((len(array), 1, array.shape[1], kv_tokens), dtype=bool)  # (B, 1, Nq, Nk)
    for name, lengths in (("seq_lens", rows), ("kv_seq_lens", keys)):
        if lengths is not None and lengths.batch != len(array):
            raise ValueError(f"{name} must have one length per row, B={len(array)}, got {lengths.batch}")
    if rows is not None:
        allowed &= rows.padding_mask(array.shape[1])[:, None, :, None]  # a padding query sees no key
    if keys is not None:
        allowed &= keys.padding_mask(kv_tokens)[:, None, None, :]  # padding keys are never attended
    batch = rows if rows is not None else RaggedBatch(np.full(len(array), array.shape[1]))
    return RaggedCall(batch, array, _and_user_mask(allowed, mask), positions)
