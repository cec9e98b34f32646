"""The bookkeeping of a paged KV cache during decoding, the same for every library: which page holds what.

A decode run's rows advance together (token ``t`` of every row is written by the same call), so
each row's logical page ``j`` holds its tokens ``j*P .. j*P+P-1``. `PagePool` hands physical pages
out of a free list in a seeded shuffled order (so logical order never equals physical order, the
mistake of attention-gym #189 shows), keeps the block table ``(B, logical pages)`` (`core.paged.PAD`
where a page was freed or not yet given), and with a sliding window gives back every page whose
tokens no later query can see: windows free whole pages. The K/V pool itself is the library's
(NumPy's key columns ``(pages, Hkv, Dk, P)``, torch's vLLM-style ``(pages, P, Hkv, D)``); this
module says only where each token goes and which pages a step reads.
"""

from __future__ import annotations

import numpy as np

from .decode import CacheFull
from .paged import PAD, PagedLayout, check_page_size, pages_needed

__all__ = ["PagePool", "pool_pages"]


def _first_needed(window: int | None, first_query: int) -> int:
    """The first token index a query at ``first_query`` or later may see: ``first_query - W + 1`` with a window."""
    return 0 if window is None else max(0, first_query - window + 1)


def pool_pages(batch: int, page_size: int, chunks, window: int | None) -> int:
    """The pages a run's pool needs: ``batch`` times the most pages one row holds at once over ``chunks``.

    ``chunks``: the run's ``(start, stop)`` token ranges. Before a chunk is written the pages wholly
    before ``start - W + 1`` are freed (with a window), then its tokens get pages: the same rule as
    `PagePool.write_slots`, so a pool of this size never runs out.
    """
    most = 0
    for start, stop in chunks:
        first = _first_needed(window, start) // page_size
        most = max(most, int(pages_needed(stop, page_size)) - first)
    return batch * most


class PagePool:
    """The pages of ``batch`` rows in a pool of ``n_pages`` pages of ``page_size`` tokens (free list seeded)."""

    def __init__(self, batch: int, page_size: int, n_pages: int, seed: int = 0, window: int | None = None):
        self.page_size, self.n_pages, self.window = check_page_size(page_size), n_pages, window
        self.free = list(np.random.default_rng(seed).permutation(n_pages))  # popped from the front
        self.table = np.full((batch, 0), PAD, dtype=np.int64)  # (B, logical pages)
        self.first = 0  # the first logical page still held (earlier ones freed by the window)
        self.written = 0  # tokens written per row
        self.peak = 0  # the most pages held at once, all rows together

    @property
    def in_use(self) -> int:
        return int((self.table != PAD).sum())

    def write_slots(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Make room for ``count`` more tokens per row: (page (B, count), offset (count,), newly given pages).

        Pages no later query can see are freed first (with a window), then new pages are taken
        from the free list; an empty free list is `CacheFull`.
        """
        keep_from = _first_needed(self.window, self.written) // self.page_size
        for j in range(self.first, min(keep_from, self.table.shape[1])):
            self.free.extend(int(p) for p in self.table[:, j])  # whole pages back to the pool
            self.table[:, j] = PAD
        self.first = max(self.first, keep_from)
        end = self.written + count
        grow = int(pages_needed(end, self.page_size)) - self.table.shape[1]
        given = []
        if grow > 0:
            need = grow * len(self.table)
            if need > len(self.free):
                raise CacheFull(
                    f"page pool exhausted: {len(self.table)} rows need {need} more pages of {self.page_size} "
                    f"tokens, {len(self.free)} of {self.n_pages} are free"
                )
            given = [self.free.pop(0) for _ in range(need)]
            new = np.array(given, dtype=np.int64).reshape(len(self.table), grow)  # (B, grow): row-major
            self.table = np.concatenate([self.table, new], axis=1)
        tokens = np.arange(self.written, end)
        self.written = end
        self.peak = max(self.peak, self.in_use)
        return self.table[:, tokens // self.page_size], tokens % self.page_size, np.array(given, dtype=np.int64)

    def rewind(self, written: int) -> None:
        """Forget the tokens written after the first ``written`` (a benchmark repeats one step at one context):
        their pages stay held, so the next write of the same tokens takes the same slots and no page."""
        if isinstance(written, bool) or not isinstance(written, (int, np.integer)) or not 0 <= written <= self.written:
            raise ValueError(f"rewind takes a token count in 0..{self.written} (the tokens written), got {written!r}")
        self.written = int(written)

    def live(self) -> tuple[np.ndarray, int]:
        """(the held pages (B, n) in logical order, the token index of their first slot)."""
        return self.table[:, self.first :], self.first * self.page_size

    def layout(self) -> PagedLayout:
        """The held pages as the canonical `PagedLayout` (rows of the tokens from the first held page on)."""
        pages, start = self.live()
        return PagedLayout(pages, np.full(len(pages), self.written - start), self.page_size, self.n_pages)
