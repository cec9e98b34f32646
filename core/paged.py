"""Paged KV caches: a pool of fixed-size pages, each row's keys reached through a block table.

The canonical description is `PagedLayout`: ``seq_lens (B,)`` tokens per row, ``page_size`` P,
a pool of ``n_pages`` physical pages and ``block_table (B, max_blocks)``: row ``b``'s logical
page ``j`` (its tokens ``j*P .. j*P+P-1``) lives in physical page ``block_table[b, j]``. Row ``b``
uses its first ``ceil(seq_lens[b] / P)`` entries; the rest hold ``PAD`` (-1). That is vLLM's
spelling; FlashInfer's is the same pages listed flat:

    kv_indptr (B+1,)         row b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices (nnz_pages,)  physical page numbers, in logical order
    kv_last_page_len (B,)    tokens in each row's last page, in 1..P (0 for a row with no page)

`PagedLayout.flashinfer` and `PagedLayout.from_flashinfer` convert exactly. The pool itself is
``(n_pages, P, ...)`` (NHD: vLLM's ``(pages, page, Hkv, D)``) or, for FlashInfer's HND layout,
``(n_pages, Hkv, P, D)``; `PagedLayout.scatter` writes packed tokens into it and
`PagedLayout.gather` reads them back in logical order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ragged import RaggedBatch

__all__ = ["PAD", "PagedLayout", "check_page_size", "pages_needed"]

PAD = -1  # a block-table entry no page sits behind


def check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int (tokens per page), got {page_size!r}")
    return int(page_size)


def pages_needed(lengths, page_size: int) -> np.ndarray:
    """``ceil(L / P)`` for each length: the pages a row of ``L`` tokens fills."""
    return -(-np.asarray(lengths, dtype=np.int64) // check_page_size(page_size))


@dataclass(frozen=True, eq=False)
class PagedLayout:
    """Rows of ``seq_lens`` tokens in a pool of ``n_pages`` pages of ``page_size`` tokens, through ``block_table``."""

    block_table: np.ndarray  # (B, max_blocks) int64, PAD beyond each row's pages
    seq_lens: np.ndarray  # (B,) int64
    page_size: int
    n_pages: int

    def __post_init__(self):
        page_size = check_page_size(self.page_size)
        seq_lens = RaggedBatch(self.seq_lens).lengths  # validated: int, 1-D, >= 0
        table = np.asarray(self.block_table)
        if table.dtype == np.bool_ or table.dtype.kind not in "iu" or table.ndim != 2 or len(table) != len(seq_lens):
            raise ValueError(
                f"block_table must be an integer array (B={len(seq_lens)}, max_blocks), "
                f"got dtype {table.dtype} shape {table.shape}"
            )
        if isinstance(self.n_pages, bool) or not isinstance(self.n_pages, (int, np.integer)) or self.n_pages < 0:
            raise ValueError(f"n_pages must be a non-negative int (the pool's pages), got {self.n_pages!r}")
        table = table.astype(np.int64)
        used = pages_needed(seq_lens, page_size)
        if (used > table.shape[1]).any():
            b = int(np.flatnonzero(used > table.shape[1])[0])
            raise ValueError(
                f"seq_lens[{b}]={seq_lens[b]} needs {used[b]} pages of {page_size}, "
                f"but block_table has {table.shape[1]} columns"
            )
        in_use = np.arange(table.shape[1])[None, :] < used[:, None]  # (B, max_blocks)
        outside = in_use & ((table < 0) | (table >= self.n_pages))
        if outside.any():
            b, j = np.argwhere(outside)[0]
            raise ValueError(
                f"block_table[{b}, {j}]={table[b, j]} points outside the pool of {self.n_pages} pages (0..{self.n_pages - 1})"
            )
        if (table[~in_use] != PAD).any():
            b, j = np.argwhere(~in_use & (table != PAD))[0]
            raise ValueError(
                f"block_table[{b}, {j}]={table[b, j]} lies past row {b}'s {used[b]} pages "
                f"(seq_lens[{b}]={seq_lens[b]}); unused entries must be {PAD}"
            )
        pages, counts = np.unique(table[in_use], return_counts=True)
        if (counts > 1).any():
            page = int(pages[counts > 1][0])
            where = [tuple(int(i) for i in ij) for ij in np.argwhere(in_use & (table == page))]
            raise ValueError(
                f"block_table points at page {page} more than once, at {where}; each page holds one row's tokens"
            )
        table.flags.writeable = False
        object.__setattr__(self, "block_table", table)
        object.__setattr__(self, "seq_lens", seq_lens)
        object.__setattr__(self, "page_size", page_size)
        object.__setattr__(self, "n_pages", int(self.n_pages))

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, PagedLayout)
            and (self.page_size, self.n_pages) == (other.page_size, other.n_pages)
            and np.array_equal(self.seq_lens, other.seq_lens)
            and np.array_equal(self.block_table, other.block_table)
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def ragged(self) -> RaggedBatch:
        return RaggedBatch(self.seq_lens)

    @property
    def pages_per_row(self) -> np.ndarray:
        return pages_needed(self.seq_lens, self.page_size)

    @classmethod
    def assign(
        cls,
        batch: RaggedBatch,
        page_size: int,
        *,
        n_pages: int | None = None,
        seed: int = 0,
        max_blocks: int | None = None,
    ) -> PagedLayout:
        """Pages for ``batch`` in a seeded shuffled physical order (a pool of ``n_pages``, default just enough)."""
        used = pages_needed(batch.lengths, page_size)
        need = int(used.sum())
        n_pages = need if n_pages is None else n_pages
        if n_pages < need:
            raise ValueError(f"n_pages={n_pages} is too small: lengths {batch.lengths.tolist()} need {need} pages")
        width = int(used.max(initial=0)) if max_blocks is None else max_blocks
        physical = np.random.default_rng(seed).permutation(n_pages)[:need]  # shuffled: logical order != physical
        table = np.full((batch.batch, width), PAD, dtype=np.int64)
        table[np.arange(width)[None, :] < used[:, None]] = physical  # row-major: row 0's pages, then row 1's ...
        return cls(table, batch.lengths, page_size, n_pages)

    # FlashInfer -----------------------------------------------------------------------------------
    def flashinfer(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(kv_indptr, kv_indices, kv_last_page_len)``, FlashInfer's spelling of these pages."""
        used = self.pages_per_row
        indptr = np.concatenate([[0], np.cumsum(used)]).astype(np.int64)
        indices = self.block_table[np.arange(self.block_table.shape[1])[None, :] < used[:, None]]  # (nnz,) copy
        last = np.where(used > 0, self.seq_lens - (used - 1) * self.page_size, 0)
        return indptr, indices, last

    @classmethod
    def from_flashinfer(
        cls, kv_indptr, kv_indices, kv_last_page_len, page_size: int, n_pages: int, max_blocks: int | None = None
    ) -> PagedLayout:
        """From FlashInfer's three arrays; ``kv_last_page_len`` must be in 1..P for a row with pages, 0 without."""
        page_size = check_page_size(page_size)
        used = RaggedBatch.from_cu_seqlens(kv_indptr).lengths  # validated offsets -> pages per row
        indices = np.asarray(kv_indices)
        if indices.shape != (int(used.sum()),):
            raise ValueError(
                f"kv_indices must have shape (kv_indptr[-1]={int(used.sum())},), got shape {indices.shape}"
            )
        last = np.asarray(kv_last_page_len).astype(np.int64)
        if last.shape != used.shape:
            raise ValueError(f"kv_last_page_len must have shape (B={len(used)},), got shape {last.shape}")
        bad = np.where(used > 0, (last < 1) | (last > page_size), last != 0)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            rule = f"in 1..{page_size} (page_size)" if used[b] else "0 (the row has no page)"
            raise ValueError(f"kv_last_page_len[{b}] must be {rule}, got {last[b]}")
        seq_lens = np.where(used > 0, (used - 1) * page_size + last, 0)
        width = int(used.max(initial=0)) if max_blocks is None else max_blocks
        table = np.full((len(used), width), PAD, dtype=np.int64)
        table[np.arange(width)[None, :] < used[:, None]] = indices
        return cls(table, seq_lens, page_size, n_pages)

    # token addresses and the pool -----------------------------------------------------------------
    def slot_mapping(self) -> np.ndarray:
        """``(T,)`` int64: each packed token's physical slot ``page * P + offset`` (vLLM's ``slot_mapping``)."""
        batch = self.ragged
        local = batch.position_ids(drop_empty=True)  # token index within its row, (T,)
        page = self.block_table[batch.document_ids(), local // self.page_size]
        return page * self.page_size + local % self.page_size

    def scatter(self, packed, layout: str = "NHD") -> np.ndarray:
        """``(T, ...)`` packed tokens -> a zeroed pool ``(n_pages, P, ...)`` (NHD) or ``(n_pages, H, P, D)`` (HND)."""
        packed = np.asarray(packed)
        if packed.ndim < 1 or packed.shape[0] != self.ragged.total:
            raise ValueError(f"packed must have shape (T={self.ragged.total}, ...), got shape {packed.shape}")
        flat = np.zeros((self.n_pages * self.page_size, *packed.shape[1:]), dtype=packed.dtype)  # (slots, ...)
        flat[self.slot_mapping()] = packed
        pool = flat.reshape(self.n_pages, self.page_size, *packed.shape[1:])  # (pages, P, ...) view
        return np.ascontiguousarray(np.swapaxes(pool, 1, 2)) if _hnd(layout, pool.ndim) else pool  # HND: a copy

    def gather(self, pool, layout: str = "NHD") -> np.ndarray:
        """The pool -> ``(T, ...)`` packed tokens in logical order (what the block table says sits where)."""
        pool = np.asarray(pool)
        if _hnd(layout, pool.ndim):
            pool = np.swapaxes(pool, 1, 2)  # (pages, H, P, D) -> (pages, P, H, D) view
        if pool.ndim < 2 or pool.shape[:2] != (self.n_pages, self.page_size):
            raise ValueError(
                f"pool must have shape (n_pages={self.n_pages}, P={self.page_size}, ...), got {pool.shape}"
            )
        flat = pool.reshape(self.n_pages * self.page_size, *pool.shape[2:])  # (slots, ...) view of a contiguous pool
        return flat[self.slot_mapping()]  # (T, ...) copy


def _hnd(layout: str, ndim: int) -> bool:
    if layout not in ("NHD", "HND"):
        raise ValueError(
            f"layout must be 'NHD' (pages, page, heads, dim) or 'HND' (pages, heads, page, dim), got {layout!r}"
        )
    if layout == "HND" and ndim != 4:
        raise ValueError(f"layout 'HND' needs a pool of 4 dims (pages, heads, page, dim), got {ndim} dims")
    return layout == "HND"
