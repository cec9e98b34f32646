"""A paged KV cache in MLX: mlx-lm has none, so it is paged here in mlx-lm's own interface, ``update_and_fetch``.

mlx-lm's caches (``KVCache``, ``RotatingKVCache``) are contiguous ``(B, Hkv, T, D)``; a serving engine
on MLX pages the same keys. Here the pool is vLLM's ``(pages, P, Hkv, D)``: MLX's scatter takes the
two advanced indices ``pool[page, offset] = new`` (``page`` (B, s), ``offset`` (s,)) when they lead,
and with a slice between them (the head-first ``(pages, Hkv, P, D)``, FlashInfer's HND) raised a
reshape ValueError in mlx 0.32 (tried). ``update_and_fetch`` writes the step's tokens into their slots
and returns the held pages gathered in logical order, ``pool[table]`` ``(B, m, P, Hkv, D)``, as the
``(B, Hkv, m*P, D)`` the layer attends over (a copy: the cost of paging). Which page holds which
row's tokens is `core.page_pool.PagePool`'s (a seeded shuffled free list; with a window, whole pages
freed once no later query can see them); each slot's position and validity stay in NumPy, and a
page given again is marked unwritten first, so the last page's unwritten slots stay invalid.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core.page_pool import PagePool

from .._paged import PagedCacheBase

PAGED_LAYOUT = (
    "mlx-lm has no paged cache: a pool of K (pages, P, Hkv, Dk) and V (pages, P, Hkv, Dv) behind mlx-lm's "
    "update_and_fetch, through a block table in a seeded shuffled physical order; a step gathers its rows' pages "
    "into (B, Hkv, m*P, Dk); a window frees whole pages"
)


class MlxPagedCache(PagedCacheBase):
    """`decode.MlxKVCache`'s ``update_and_fetch`` over a pool of ``n_pages`` pages of ``page_size`` tokens."""

    axes = "(pages, P, Hkv, Dk)"
    reallocations = 0  # the pool is allocated once

    def __init__(self, batch: int, cfg, dtype: str, page_size: int, n_pages: int, seed: int) -> None:
        from ..frameworks.mlx import to_mlx

        self.pool = PagePool(batch, page_size, n_pages, seed, cfg.window)
        self.k = to_mlx(np.zeros((n_pages, page_size, cfg.n_kv_heads, cfg.d_k)), dtype)  # (pages, P, Hkv, Dk)
        self.v = to_mlx(np.zeros((n_pages, page_size, cfg.n_kv_heads, cfg.d_v)), dtype)  # (pages, P, Hkv, Dv)
        self.positions = np.zeros((n_pages, page_size), dtype=np.int64)  # (pages, P)
        self.valid = np.zeros((n_pages, page_size), dtype=bool)  # (pages, P): nothing written yet

    @property
    def keys(self):  # the pool, as `decode.prepare_mlx_decode_run` evaluates it after each step
        return self.k

    @property
    def values(self):
        return self.v

    def update_and_fetch(self, keys, values, positions: np.ndarray, valid: np.ndarray):
        """Write ``s`` tokens (keys (B, Hkv, s, Dk), values, positions and valid (B, s)); return the held pages in
        logical order: keys (B, Hkv, m*P, Dk), values (B, Hkv, m*P, Dv), positions and valid (B, m*P)."""
        import mlx.core as mx

        page, offset, given = self.pool.write_slots(keys.shape[2], valid)  # (B, s), (s,), (new pages,)
        self.valid[given] = False  # a page given again holds a freed row's tokens: none of them are this row's
        self.positions[page, offset], self.valid[page, offset] = positions, valid  # offset broadcasts along rows
        where = (mx.array(page), mx.array(offset)[None, :])  # (B, s), (1, s)
        self.k[where] = keys.transpose(0, 2, 1, 3)  # (B, s, Hkv, Dk) into their slots
        self.v[where] = values.transpose(0, 2, 1, 3)  # (B, s, Hkv, Dv)
        table = self.pool.live()[0]  # (B, m)
        B, m = table.shape
        P = self.pool.page_size

        def rows(pool):  # (pages, P, Hkv, d) -> (B, m, P, Hkv, d) gather -> (B, m*P, Hkv, d) -> (B, Hkv, m*P, d)
            return pool[mx.array(table)].reshape(B, m * P, *pool.shape[2:]).transpose(0, 2, 1, 3)

        return rows(self.k), rows(self.v), self.positions[table].reshape(B, m * P), self.valid[table].reshape(B, m * P)
