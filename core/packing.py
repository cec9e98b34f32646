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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ragged import RaggedBatch

__all__ = ["PackedCall", "packed_call"]


@dataclass(frozen=True)
class PackedCall:
    """A packed call as an ordinary one in the caller's form: ``query (1, T, d_model)``, ``mask (1, 1, T, T)``,
    ``positions (1, T)``, or without the leading axis each for a ``(T, d_model)`` call."""

    batch: RaggedBatch
    query: np.ndarray
    mask: np.ndarray
    positions: np.ndarray


def packed_call(
    cfg,
    query,
    key=None,
    value=None,
    mask=None,
    positions=None,
    kv_positions=None,
    *,
    cu_seqlens=None,
    position_ids=None,
):
    """None without packing; otherwise the `PackedCall` that runs it, every rule checked with a clear error."""
    if cu_seqlens is None and position_ids is None:
        return None
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
    allowed = batch.document_mask(drop_empty=True)[None, None]  # (1, 1, T, T), True within one document
    if mask is not None:
        user = np.asarray(mask)
        if user.dtype != np.bool_:
            raise TypeError(f"mask must be boolean with True = may attend, got dtype {user.dtype}")
        allowed = allowed & user.reshape((1,) * (4 - user.ndim) + user.shape)  # broadcast checked by prepare_inputs
    pos = pos.astype(np.int64)[None]  # (1, T)
    if array.ndim == 2:  # the caller's unbatched form: (H|1, T, T) and (T,)
        allowed, pos = allowed[0], pos[0]
    return PackedCall(batch, array, allowed, pos)
