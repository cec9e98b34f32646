"""What every library's paged KV cache shares: the kind's name, no ring, its size and its ``info``.

Each library keeps the pool in its own layout (NumPy's key columns, torch's vLLM pages); the
bookkeeping of which page holds what is `core.page_pool.PagePool`, here as ``self.pool``.
"""

from __future__ import annotations

PAGED = "paged"  # the cache kind


class PagedCacheBase:
    """A paged cache's size and ``info``; subclasses set ``pool`` (a `PagePool`), ``k``, ``v`` and ``axes``."""

    kind, ring = PAGED, None  # no ring: a window frees whole pages instead
    axes = ""  # the pool's axes in words, e.g. "(pages, P, Hkv, Dk)"

    def rewind(self, written: int) -> None:
        """The next write goes to token ``written``'s slot, its page still held (`PagePool.rewind`): a timed decode
        step (`bench --mode decode`) writes the same step into the same slots on every call."""
        self.pool.rewind(written)

    # torch's `decode.TorchKVCache` interface for the same: the state a step changes, and putting it back.
    def state(self) -> int:
        return self.pool.written

    def restore(self, written: int) -> None:
        self.rewind(written)

    @property
    def slots(self) -> int:
        """Token slots per row the pool could hold (its pages over the rows)."""
        return self.pool.n_pages * self.pool.page_size // len(self.pool.table)

    @property
    def nbytes(self) -> int:
        """K and V together (positions and validity are bookkeeping, not counted)."""
        return self.k.nbytes + self.v.nbytes

    def info(self) -> dict:
        pool = self.pool
        return {
            "kind": PAGED,
            "layout": f"{self.axes} through a block table, pages={pool.n_pages}, P={pool.page_size}",
            "slots": self.slots,
            "bytes": self.nbytes,
            "page_size": pool.page_size,
            "pages": pool.n_pages,  # the pool: the most pages the run's rows hold at once (`pool_pages`)
            # Held now: the rows' own pages and the null page their pad-only pages share (pads take no page).
            "pages_held": pool.in_use,
            "pad_only_pages": int((pool.table == pool.null).sum()) if pool.null is not None else 0,
        }
