"""A paged KV cache in torch, vLLM's layout: K ``(pages, P, Hkv, Dk)`` and V ``(pages, P, Hkv, Dv)``.

Which page holds which row's tokens is `core.page_pool.PagePool`'s (a seeded shuffled free list,
the block table ``(B, logical pages)``; with a window, whole pages freed once no later query can
see them). A step writes its tokens into their slots by advanced indexing (vLLM's
``reshape_and_cache`` by ``slot_mapping``), then gathers the held pages in logical order,
``k[block_table]`` ``(B, n, P, Hkv, Dk)``, into the ``(B, Hkv, n*P, Dk)`` the row-sample layer
attends over: that gather (a copy of the held keys per step) is what paging costs over the
contiguous cache. The last page's unwritten slots stay invalid, so the position rules block them.
"""

from __future__ import annotations

from mha_rosetta.core.page_pool import PagePool

from .._paged import PagedCacheBase

PAGED_LAYOUT = (
    "K (pages, P, Hkv, Dk) and V (pages, P, Hkv, Dv), vLLM's layout, through a block table in a seeded shuffled "
    "physical order; a step gathers its rows' pages into (B, Hkv, n*P, Dk); a window frees whole pages"
)


class TorchPagedCache(PagedCacheBase):
    """`decode.TorchKVCache`'s ``write`` over a pool of pages; ``like``: a tensor of the cache's dtype and device."""

    axes = "(pages, P, Hkv, Dk)"

    def __init__(self, batch: int, cfg, *, page_size: int, n_pages: int, seed: int, like) -> None:
        import torch

        self.torch = torch
        self.pool = PagePool(batch, page_size, n_pages, seed, cfg.window)
        self.k = like.new_zeros((n_pages, page_size, cfg.n_kv_heads, cfg.d_k))  # (pages, P, Hkv, Dk)
        self.v = like.new_zeros((n_pages, page_size, cfg.n_kv_heads, cfg.d_v))  # (pages, P, Hkv, Dv)
        self.positions = like.new_zeros((n_pages, page_size), dtype=torch.int64)  # (pages, P)
        self.valid = like.new_zeros((n_pages, page_size), dtype=torch.bool)  # (pages, P): nothing written yet

    def _index(self, array):
        return self.torch.from_numpy(array).to(self.k.device)

    def write(self, k_new, v_new, positions, valid, token: int) -> tuple:
        """Store the chunk (k_new (B, Hkv, s, Dk), v_new (B, Hkv, s, Dv), positions and valid (B, s); tokens
        ``token ..``, which must follow the ones written) and return the held pages gathered, (k, v, positions, valid)."""
        if token != self.pool.written:
            raise ValueError(f"a paged cache is written in token order: token {token} after {self.pool.written}")
        # Which tokens are pads, on the host where the pages are booked (pad-only pages take the null page): on a
        # GPU this reads the chunk's validity back, a sync per chunk.
        host_valid = valid.cpu().numpy()  # (B, s)
        page, offset, given = self.pool.write_slots(k_new.shape[2], host_valid)  # (B, s), (s,), (new pages,)
        self.valid[self._index(given)] = False  # a page given again holds none of this row's tokens yet
        page = self._index(page)
        offset = self._index(offset).expand_as(page)  # (B, s)
        self.k[page, offset] = k_new.transpose(1, 2)  # (B, s, Hkv, Dk) view of the new keys, into their slots
        self.v[page, offset] = v_new.transpose(1, 2)  # (B, s, Hkv, Dv) view
        self.positions[page, offset] = positions
        self.valid[page, offset] = valid
        return self.gather()

    def gather(self) -> tuple:
        """The held pages in logical order: k (B, Hkv, n*P, Dk), v (B, Hkv, n*P, Dv), positions and valid (B, n*P)."""
        pages = self._index(self.pool.live()[0])  # (B, n)
        B, n = pages.shape
        P = self.pool.page_size

        def rows(
            pool,
        ):  # (pages, P, Hkv, d) -> (B, n, P, Hkv, d) copy -> (B, n*P, Hkv, d) view -> (B, Hkv, n*P, d) view
            return pool[pages].reshape(B, n * P, *pool.shape[2:]).transpose(1, 2)

        return rows(self.k), rows(self.v), self.positions[pages].reshape(B, n * P), self.valid[pages].reshape(B, n * P)
