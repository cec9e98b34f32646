"""A paged KV cache with named axes: the pool is ``"p t g k"``, a row's keys are ``rearrange(pool[table], "b m t g k -> b (m t) g k")``.

The einops pipeline's cache is its own keys operand ``"b s g k"`` (`decode.cache_pattern`); paged,
the slots ``s`` are cut into pages: keys ``(pages, P, Hkv, Dk)`` named ``"p t g k"`` and values
``"p t g v"``, in the array library's own arrays (NumPy, torch, JAX). Which page holds which row's
tokens is `core.page_pool.PagePool`'s (a seeded shuffled free list; with a window, whole pages
freed once no later query can see them). A chunk's device half (`decode.device_step`) writes its
tokens into their slots, ``pool[page, offset] = new`` (``.at[page, offset].set`` on JAX's
immutable arrays; ``page`` (B, n), ``offset`` (n,)), then reads the held pages back in logical
order with one gather and one rearrange, no transpose::

    keys = rearrange(pool[table], "b m t g k -> b (m t) g k")   # (B, m*P, Hkv, Dk): the scores einsum's operand

so the scores and context einsums are the contiguous cache's, unchanged. The gather copies the
held keys once per chunk: it is what paging costs. Each slot's position and validity stay on the
host in NumPy ``(pages, P)`` (they make the chunk's mask, gathered by the same table); a page
given again is marked unwritten first, and the last page's unwritten slots stay invalid, so the
position rules block them. On JAX the chunk is jitted as the contiguous one is: one compilation
per chunk length and number of held pages (the table's width grows until a window starts freeing).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core.page_pool import PagePool

from .._paged import PagedCacheBase

PAGED_LAYOUT = (
    "keys 'p t g k' (pages, P, Hkv, Dk) and values 'p t g v' in the array library, through a block table in a seeded "
    "shuffled physical order; a chunk reads rearrange(pool[table], 'b m t g k -> b (m t) g k'); a window frees whole pages"
)


class PagedNamedCache(PagedCacheBase):
    """`decode.NamedCache`'s ``claim`` and ``key_slots`` over a pool of pages (``ops``: the array library's)."""

    axes = "'p t g k' (pages, P, Hkv, Dk)"

    def __init__(self, ops, batch: int, cfg, page_size: int, n_pages: int, seed: int) -> None:
        self.ops = ops
        self.pool = PagePool(batch, page_size, n_pages, seed, cfg.window)
        self.k = ops.asarray(np.zeros((n_pages, page_size, cfg.n_kv_heads, cfg.d_k)))  # "p t g k"
        self.v = ops.asarray(np.zeros((n_pages, page_size, cfg.n_kv_heads, cfg.d_v)))  # "p t g v"
        self.positions = np.zeros((n_pages, page_size), dtype=np.int64)  # (pages, P)
        self.valid = np.zeros((n_pages, page_size), dtype=bool)  # (pages, P): nothing written yet

    # `decode.EinopsDecoder.chunk` reads and writes the pool as ``keys`` and ``values``.
    keys = property(lambda self: self.k, lambda self, pool: setattr(self, "k", pool))
    values = property(lambda self: self.v, lambda self, pool: setattr(self, "v", pool))

    def claim(self, positions: np.ndarray, valid: np.ndarray) -> tuple[tuple, int]:
        """Book a chunk's n tokens (positions, valid (B, n)): ((page (B, n), offset (n,), table (B, m)), n)."""
        n = positions.shape[1]
        page, offset, given = self.pool.write_slots(n, valid)  # pad-only pages: the null page
        self.valid[given] = False  # a page given again holds a freed row's tokens: none of them are this row's
        self.positions[page, offset] = positions  # offset (n,) broadcasts along the rows
        self.valid[page, offset] = valid
        # A copy of the table: `PagePool` frees pages by writing PAD into its own, and JAX on CPU may alias a NumPy
        # buffer it is given while its dispatch is still running (a view here gave a wrong token in float64, seen).
        return (page, offset, self.pool.live()[0].copy()), n

    def key_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Each held slot's position and validity in logical order, (B, m*P) each: the table's gather on the host."""
        table = self.pool.live()[0]  # (B, m)
        B = len(table)
        return self.positions[table].reshape(B, -1), self.valid[table].reshape(B, -1)  # (B, m, P) -> (B, m*P) copies


def store_pages(ops, pool, where, new):
    """``pool`` ("p t g k") with the chunk's ``new`` ("b n g k") at ``(page (B, n), offset (n,))``: in place on NumPy
    and torch arrays, ``.at[].set`` on JAX's (inside the jitted chunk)."""
    page, offset, _ = where
    if ops.library == "jax":
        return pool.at[page, offset[None, :]].set(new)
    pool[page, offset[None, :]] = new  # advanced indices (B, n) around the pool's first two axes
    return pool


def read_pages(pool, table, pattern: str):
    """The held pages of every row in logical order: ``pool[table]`` (B, m, P, ...) -> ``"b (m t) ..."``, one copy.

    ``pattern``: the cache's named axes, ``"b s g k"`` (`decode.cache_pattern`); its ``s`` is ``(m t)``."""
    import einops

    rest = pattern.split(maxsplit=2)[2]  # "g k": the heads and features after "b s"
    return einops.rearrange(pool[table], f"b m t {rest} -> b (m t) {rest}")
