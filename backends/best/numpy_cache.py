"""numpy-best's decode cache: static, in contiguous pages of `KV_BLOCK` slots (`best.numpy`'s decode step reads it)."""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig

from .common import cache_info

CACHE_LAYOUT = "(B, Hkv, P, Dk, L), (B, Hkv, P, L, Dv)"
# The cache's page (the Intel Xeon of 2026-12-06, one pinned core, 4 kv heads of 128, 4 query heads each, float32,
# the attention part): pages of 256 against one (Dk, C) key matrix read in blocks of 1024 columns, 13.3 against 14.6
# ms at B=1, 32k; 60.1 against 85.1 at B=4, 32k (past the cache); alike at 8k. Pages of 512 lost at B=4, 8k.
KV_BLOCK = 256


class NumpyStaticCache:
    """Pages of `KV_BLOCK` slots, allocated once: keys as columns (B, Hkv, P, Dk, L) and values as rows
    (B, Hkv, P, L, Dv), each page contiguous; `write` puts tokens in their slots in place."""

    def __init__(self, cfg: MHAConfig, batch: int, slots: int, dtype: np.dtype) -> None:
        pages = -(-slots // KV_BLOCK)
        self.k = np.zeros((batch, cfg.n_kv_heads, pages, cfg.d_k, KV_BLOCK), dtype=dtype)  # (B, Hkv, P, Dk, L)
        self.v = np.zeros((batch, cfg.n_kv_heads, pages, KV_BLOCK, cfg.d_v), dtype=dtype)  # (B, Hkv, P, L, Dv)

    def write(self, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Keys (B, Hkv, s, Dk) and values (B, Hkv, s, Dv) into slots ``start .. start+s-1``, page by page."""
        stop = start + keys.shape[2]
        for page in range(start // KV_BLOCK, -(-stop // KV_BLOCK)):
            low, high = max(start, page * KV_BLOCK), min(stop, (page + 1) * KV_BLOCK)
            inside = slice(low - page * KV_BLOCK, high - page * KV_BLOCK)  # the slots within the page
            tokens = slice(low - start, high - start)
            self.k[:, :, page, :, inside] = keys[:, :, tokens].swapaxes(-1, -2)  # (B, Hkv, Dk, n): keys as columns
            self.v[:, :, page, inside] = values[:, :, tokens]  # (B, Hkv, n, Dv): values as rows

    def info(self, cfg: MHAConfig) -> dict:
        slots = self.k.shape[2] * KV_BLOCK  # the allocated slots: whole pages
        return cache_info(cfg, self.k.shape[0], slots, self.k.itemsize, CACHE_LAYOUT)
