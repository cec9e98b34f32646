"""The bookkeeping of a paged KV cache during decoding, the same for every library: which page holds what.

A decode run's rows advance together (token ``t`` of every row is written by the same call), so
each row's logical page ``j`` holds its tokens ``j*P .. j*P+P-1``. `PagePool` hands physical pages
out of a free list in a seeded shuffled order (so logical order never equals physical order, the
mistake of attention-gym #189 shows), keeps the block table ``(B, logical pages)`` (`core.paged.PAD`
where a page was freed or not yet given), and with a sliding window gives back every page whose
tokens no later query can see: windows free whole pages.

Pads take no pages. A row's page that holds only pads (a left-padded row of a ragged batch, decoding
in lockstep with longer ones) points at one shared null page (vLLM's null block): the pads are written
there, always invalid, and a step that gathers the row reads them masked. The null page is taken from
the free list when a pad-only page first needs it and given back once no row points at it; a page that
was pads only and then receives a real token gets a page of its own (returned among the new pages, so
that the caller marks its earlier slots unwritten). The K/V pool itself is the library's
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
        self.null: int | None = None  # the null page the pad-only pages point at, while one does

    @property
    def in_use(self) -> int:
        """The pages held: every row's own pages, and the null page once however many pad-only pages point at it."""
        own = (self.table != PAD) & (self.table != (PAD if self.null is None else self.null))
        return int(own.sum()) + (self.null is not None)

    def _release_null(self) -> None:
        if self.null is not None and not (self.table == self.null).any():
            self.free.append(self.null)
            self.null = None

    def write_slots(self, count: int, valid=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Make room for ``count`` more tokens per row: (page (B, count), offset (count,), newly given pages).

        ``valid`` (B, count) bool, default all True: which of them are real tokens. Pages no later
        query can see are freed first (with a window), then every page the tokens fall in gets a
        page from the free list, or the null page where it holds only pads (the module's rule); an
        empty free list is `CacheFull`. The newly given pages include the null page when it is taken.
        """
        B, P = self.table.shape[0], self.page_size
        valid = np.ones((B, count), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        if valid.shape != (B, count):
            raise ValueError(f"valid must have shape (B={B}, count={count}), got {valid.shape}")
        keep_from = _first_needed(self.window, self.written) // P
        for j in range(self.first, min(keep_from, self.table.shape[1])):
            self.free.extend(int(p) for p in self.table[:, j] if p not in (PAD, self.null))  # whole pages back
            self.table[:, j] = PAD
        self.first = max(self.first, keep_from)
        self._release_null()
        end = self.written + count
        grow = int(pages_needed(end, P)) - self.table.shape[1]
        if grow > 0:
            self.table = np.concatenate([self.table, np.full((B, grow), PAD, dtype=np.int64)], axis=1)
        tokens = np.arange(self.written, end)
        touched = range(self.written // P, int(pages_needed(end, P)))  # the logical pages the tokens fall in
        # (B, pages touched): whether the row writes a real token into the page now (its pads only, else)
        real = np.stack([valid[:, (tokens // P) == j].any(axis=1) for j in touched], axis=1) if count else None
        wants = [] if real is None else [
            (b, j, bool(real[b, i])) for b in range(B) for i, j in enumerate(touched)
            if self.table[b, j] == PAD or (real[b, i] and self.table[b, j] == self.null)
        ]  # fmt: skip  # row-major: row 0's pages, then row 1's, as `PagedLayout.assign` orders them
        # Pad-only pages that now receive a real token leave the null page; when they were all that pointed at it,
        # it is back in the pool before pages are given (a pool sized by `pool_pages` holds no spare for it: a
        # left-padded row of 3 in a pool of 3 ran out without this).
        converting = [(b, j) for b, j, own in wants if own and self.null is not None and self.table[b, j] == self.null]
        frees_null = self.null is not None and int((self.table == self.null).sum()) == len(converting)
        pads_wanted = any(not own for _, _, own in wants)
        need = sum(own for _, _, own in wants) + (pads_wanted and (self.null is None or frees_null))
        if need > len(self.free) + frees_null:
            raise CacheFull(
                f"page pool exhausted: {B} rows need {need} more pages of {P} tokens, "
                f"{len(self.free) + frees_null} of {self.n_pages} are free"
            )
        for b, j in converting:
            self.table[b, j] = PAD
        self._release_null()
        given = []
        for b, j, own in wants:
            if own:
                page = int(self.free.pop(0))
                given.append(page)
            else:  # a pad-only page: the shared null page, taken from the pool when the first one needs it
                if self.null is None:
                    self.null = self.free.pop(0)
                    given.append(self.null)
                page = self.null
            self.table[b, j] = page
        self._release_null()  # every pad-only page may have received a real token
        self.written = end
        self.peak = max(self.peak, self.in_use)
        return self.table[:, tokens // P], tokens % P, np.array(given, dtype=np.int64)

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
        """The held pages as the canonical `PagedLayout` (rows of the tokens from the first held page on).

        Pad-only pages point at the shared null page, which a `PagedLayout` (one row per page) cannot say."""
        if self.null is not None:
            raise ValueError(
                f"the pool's pad-only pages point at the shared null page {self.null}: not a PagedLayout, where each "
                "page holds one row's tokens"
            )
        pages, start = self.live()
        return PagedLayout(pages, np.full(len(pages), self.written - start), self.page_size, self.n_pages)
