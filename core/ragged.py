"""One canonical description of a ragged batch, and its spellings in each ecosystem.

A ragged batch is a list of documents (rows) of lengths ``lengths = (L_0, ..., L_{B-1})``,
each ``>= 0``. That list is the canonical description (`RaggedBatch`); every other spelling is
converted from it and back, exactly:

| spelling | who | here |
|---|---|---|
| ``cu_seqlens`` ``(B+1,)`` int, ``[0, L_0, L_0+L_1, ..., T]`` | FlashAttention varlen, torch ``varlen_attn`` | `RaggedBatch.cu_seqlens`, `RaggedBatch.from_cu_seqlens` |
| packed ``position_ids`` ``(T,)``: a step other than +1 starts a document | Hugging Face | `RaggedBatch.position_ids`, `RaggedBatch.from_position_ids` |
| block-diagonal mask ``(T, T)``, True inside one document | FlexAttention's document mask | `RaggedBatch.document_mask`, `RaggedBatch.from_document_mask` |
| per-row lengths on a padded ``(B, N)`` batch (right padding) | ``jax.nn.dot_product_attention``'s ``*_seq_lengths`` | `RaggedBatch.padding_mask`, `RaggedBatch.from_padding_mask` |
| block table + ``seq_lens``, FlashInfer ``kv_indptr``/``kv_indices``/``kv_last_page_len`` | vLLM, FlashInfer | `core.paged` |

Zero-length documents: ``cu_seqlens``, per-row lengths and block tables hold them; packed
``position_ids`` and the block-diagonal mask cannot (a document with no token leaves no trace),
so converting a batch with one to those spellings is refused unless ``drop_empty=True`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RaggedBatch", "pack_rows", "unpack_rows"]


def _int_vector(name: str, value, what: str) -> np.ndarray:
    array = np.asarray(value)
    if array.size == 0 and array.ndim == 1:  # [] is float64 to NumPy; an empty list of counts is still counts
        array = array.astype(np.int64)
    if array.dtype == np.bool_ or array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers ({what}), got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional ({what}), got shape {array.shape}")
    return array.astype(np.int64)


@dataclass(frozen=True, eq=False)
class RaggedBatch:
    """Documents of ``lengths`` tokens each, packed one after the other into ``total`` tokens."""

    lengths: np.ndarray  # (B,) int64, each >= 0

    def __post_init__(self):
        lengths = _int_vector("lengths", self.lengths, "one token count per document")
        if (lengths < 0).any():
            bad = int(np.flatnonzero(lengths < 0)[0])
            raise ValueError(f"lengths must be >= 0 (token counts), got lengths[{bad}]={lengths[bad]}")
        lengths.flags.writeable = False
        object.__setattr__(self, "lengths", lengths)

    def __eq__(self, other) -> bool:
        return isinstance(other, RaggedBatch) and np.array_equal(self.lengths, other.lengths)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking arrays: compared, never hashed

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        """T, the packed tokens."""
        return int(self.lengths.sum())

    @property
    def max_len(self) -> int:
        """FlashAttention's ``max_seqlen`` (0 for a batch of empty documents)."""
        return int(self.lengths.max(initial=0))

    # cu_seqlens -------------------------------------------------------------------------------
    def cu_seqlens(self) -> np.ndarray:
        """``(B+1,)`` int64: document ``b`` is packed tokens ``cu[b]:cu[b+1]``."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, total: int | None = None) -> RaggedBatch:
        """From FlashAttention's offsets; ``total`` (the packed tokens T), when given, must be the last entry."""
        cu = _int_vector("cu_seqlens", cu_seqlens, "offsets [0, L_0, L_0+L_1, ..., T]")
        if len(cu) == 0:
            raise ValueError("cu_seqlens must have at least one entry (0 for no documents), got an empty array")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens[0] must be 0 (the first document starts the packed row), got {cu[0]}")
        steps = np.diff(cu)
        if (steps < 0).any():
            i = int(np.flatnonzero(steps < 0)[0])
            raise ValueError(
                f"cu_seqlens must be non-decreasing (offsets of consecutive documents), "
                f"got cu_seqlens[{i + 1}]={cu[i + 1]} < cu_seqlens[{i}]={cu[i]}"
            )
        if total is not None and cu[-1] != total:
            raise ValueError(
                f"cu_seqlens[-1] must equal T={total} (the packed tokens), got {cu[-1]} (cu_seqlens={cu.tolist()})"
            )
        return cls(steps)

    # document ids, packed position_ids, the block-diagonal mask -------------------------------
    def document_ids(self) -> np.ndarray:
        """``(T,)`` int64: the document each packed token belongs to."""
        return np.repeat(np.arange(self.batch, dtype=np.int64), self.lengths)

    def _refuse_empty(self, spelling: str, drop_empty: bool) -> None:
        if not drop_empty and (self.lengths == 0).any():
            empty = np.flatnonzero(self.lengths == 0).tolist()
            raise ValueError(
                f"{spelling} cannot hold a zero-length document (documents {empty} of lengths "
                f"{self.lengths.tolist()} would vanish); pass drop_empty=True to drop them knowingly"
            )

    def position_ids(self, drop_empty: bool = False) -> np.ndarray:
        """``(T,)`` int64, Hugging Face's packed positions: ``0 .. L_b-1`` for each document in turn."""
        self._refuse_empty("packed position_ids", drop_empty)
        return np.arange(self.total, dtype=np.int64) - np.repeat(self.cu_seqlens()[:-1], self.lengths)

    @classmethod
    def from_position_ids(cls, position_ids) -> RaggedBatch:
        """Hugging Face's rule (``find_packed_sequence_indices``): a step other than +1 starts a new document.

        Accepts ``(T,)`` or ``(1, T)``; the first token starts the first document.
        """
        pos = np.asarray(position_ids)
        if pos.ndim == 2 and pos.shape[0] == 1:
            pos = pos[0]  # (1, T) -> (T,) view: HF's packed batch of one row
        pos = _int_vector("position_ids", pos, "packed positions, (T,) or (1, T)")
        if len(pos) == 0:
            return cls(np.zeros(0, dtype=np.int64))
        starts = np.concatenate([[0], np.flatnonzero(np.diff(pos) != 1) + 1])  # token indices that open a document
        return cls(np.diff(np.append(starts, len(pos))))

    def document_mask(self, drop_empty: bool = False) -> np.ndarray:
        """``(T, T)`` bool, True where query and key tokens lie in one document (FlexAttention's document mask)."""
        self._refuse_empty("a block-diagonal mask", drop_empty)
        ids = self.document_ids()
        return ids[:, None] == ids[None, :]

    @classmethod
    def from_document_mask(cls, mask) -> RaggedBatch:
        """From a ``(T, T)`` block-diagonal mask of contiguous documents; anything else is refused."""
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
            raise ValueError(f"mask must be a square (T, T) boolean array, got dtype {mask.dtype} shape {mask.shape}")
        n = mask.shape[0]
        # A token opens a document where it may not see the token before it.
        opens = np.ones(n, dtype=bool)
        opens[1:] = ~mask[np.arange(1, n), np.arange(n - 1)]
        starts = np.flatnonzero(opens)
        batch = cls(np.diff(np.append(starts, n)))
        if not np.array_equal(batch.document_mask(), mask):
            wrong = np.argwhere(batch.document_mask() != mask)[0]
            raise ValueError(
                "mask must be block-diagonal (True exactly within contiguous documents); entry "
                f"[{wrong[0]}, {wrong[1]}]={bool(mask[tuple(wrong)])} breaks the blocks of lengths {batch.lengths.tolist()}"
            )
        return batch

    # per-row lengths on a padded batch (right padding) -----------------------------------------
    def _check_fits(self, tokens: int) -> None:
        if (self.lengths > tokens).any():
            b = int(np.flatnonzero(self.lengths > tokens)[0])
            raise ValueError(
                f"seq_lens must be <= N={tokens} (the padded row length), got seq_lens[{b}]={self.lengths[b]}"
            )

    def padding_mask(self, tokens: int) -> np.ndarray:
        """``(B, N)`` bool, True on each row's first ``L_b`` tokens (the real ones, right padding)."""
        self._check_fits(tokens)
        return np.arange(tokens)[None, :] < self.lengths[:, None]

    @classmethod
    def from_seq_lens(cls, seq_lens, tokens: int) -> RaggedBatch:
        """Per-row lengths of a padded ``(B, N)`` batch; each must be ``<= N``."""
        batch = cls(_int_vector("seq_lens", seq_lens, "one length per row"))
        batch._check_fits(tokens)
        return batch

    @classmethod
    def from_padding_mask(cls, mask) -> RaggedBatch:
        """From a ``(B, N)`` right-padding mask (each row: True then False); anything else is refused."""
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.ndim != 2:
            raise ValueError(f"padding mask must be (B, N) boolean, got dtype {mask.dtype} shape {mask.shape}")
        batch = cls(mask.sum(axis=1))
        if not np.array_equal(batch.padding_mask(mask.shape[1]), mask):
            row = int(np.flatnonzero((batch.padding_mask(mask.shape[1]) != mask).any(axis=1))[0])
            raise ValueError(
                f"padding mask row {row} is not right padding (real tokens first, then padding): {mask[row].astype(int)}"
            )
        return batch


def pack_rows(batch: RaggedBatch, padded) -> np.ndarray:
    """``(B, N, ...)`` right-padded rows -> ``(T, ...)`` packed tokens (the padding dropped; a copy)."""
    padded = np.asarray(padded)
    if padded.ndim < 2 or padded.shape[0] != batch.batch:
        raise ValueError(f"padded must have shape (B={batch.batch}, N, ...), got shape {padded.shape}")
    return padded[batch.padding_mask(padded.shape[1])]  # (T, ...) copy, row-major: document order


def unpack_rows(batch: RaggedBatch, packed, tokens: int | None = None, fill=0) -> np.ndarray:
    """``(T, ...)`` packed tokens -> ``(B, N, ...)`` right-padded rows, padding set to ``fill``; N defaults to max_len."""
    packed = np.asarray(packed)
    if packed.ndim < 1 or packed.shape[0] != batch.total:
        raise ValueError(f"packed must have shape (T={batch.total}, ...), got shape {packed.shape}")
    tokens = batch.max_len if tokens is None else tokens
    out = np.full((batch.batch, tokens, *packed.shape[1:]), fill, dtype=packed.dtype)  # (B, N, ...) new array
    out[batch.padding_mask(tokens)] = packed
    return out
