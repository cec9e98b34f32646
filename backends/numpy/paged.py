"""A paged KV cache in column samples: NumPy's key columns cut into pages, reached through a block table.

The pool holds keys ``(pages, Hkv, Dk, P)`` and values ``(pages, Hkv, Dv, P)``: each page is P
token columns of every kv head, the column layout of `decode.ColumnCache` cut along the tokens.
Which page holds which row's tokens is `core.page_pool.PagePool`'s (a seeded shuffled free list;
with a window, whole pages freed once no later query can see them). A step writes its columns
into their pages, then gathers the held pages in logical order into ``(B, Hkv, Dk, n*P)``: that
gather is the paged cache's cost over the contiguous one (a copy of the held keys per step). The
last page's unwritten slots stay invalid, so the causal and window rules on positions
(`core.decode.decode_allowed`) block them like any slot never written.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core.page_pool import PagePool

from .._paged import PagedCacheBase

PAGED_LAYOUT = (
    "keys (pages, Hkv, Dk, P) and values (pages, Hkv, Dv, P): pages of P token columns, a block table per row in a "
    "seeded shuffled physical order; a step gathers its row's pages into (B, Hkv, Dk, n*P); a window frees whole pages"
)


class PagedColumnCache(PagedCacheBase):
    """`decode.ColumnCache`'s interface (``write``, ``columns``, ``info``) over a pool of pages."""

    axes = "(pages, Hkv, Dk, P)"

    def __init__(self, batch, heads, d_k, d_v, dtype, page_size: int, n_pages: int, seed: int, window=None):
        self.pool = PagePool(batch, page_size, n_pages, seed, window)
        self.k = np.zeros((n_pages, heads, d_k, page_size), dtype=dtype)  # (pages, Hkv, Dk, P)
        self.v = np.zeros((n_pages, heads, d_v, page_size), dtype=dtype)  # (pages, Hkv, Dv, P)
        self.positions = np.zeros((n_pages, page_size), dtype=np.int64)  # (pages, P)
        self.valid = np.zeros((n_pages, page_size), dtype=bool)  # (pages, P): nothing written yet

    def write(self, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, valid: np.ndarray) -> None:
        """Write ``s`` columns: keys (B, Hkv, Dk, s), values (B, Hkv, Dv, s), positions and valid (B, s)."""
        page, offset, given = self.pool.write_slots(keys.shape[-1], valid)  # (B, s), (s,), (new pages,)
        self.valid[given] = False  # a page given again holds a freed row's tokens: none of them are this row's
        offsets = np.broadcast_to(offset, page.shape)  # (B, s)
        # Advanced indices (page, offset) around two slices: the result's axes are (B, s, Hkv, Dk).
        self.k[page, :, :, offsets] = keys.transpose(0, 3, 1, 2)  # (B, s, Hkv, Dk) view of the new columns
        self.v[page, :, :, offsets] = values.transpose(0, 3, 1, 2)  # (B, s, Hkv, Dv) view
        self.positions[page, offsets] = positions
        self.valid[page, offsets] = valid

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The held pages gathered in logical order: keys (B, Hkv, Dk, n*P), values (B, Hkv, Dv, n*P), positions
        and valid (B, n*P). Copies: a page's columns are contiguous, the pages are not."""
        pages, _ = self.pool.live()  # (B, n)
        B, n = pages.shape
        P = self.pool.page_size

        def gather(pool):  # (pages, H, F, P) -> (B, n, H, F, P) -> (B, H, F, n, P) -> (B, H, F, n*P), a copy
            return pool[pages].transpose(0, 2, 3, 1, 4).reshape(B, pool.shape[1], pool.shape[2], n * P)

        return (
            gather(self.k),
            gather(self.v),
            self.positions[pages].reshape(B, n * P),
            self.valid[pages].reshape(B, n * P),
        )
