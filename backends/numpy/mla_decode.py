"""MLA's decode in column samples: a cache that holds the latent, ``kv_lora_rank + d_rope`` numbers a token.

The cache is one array ``(B, R + dr, T)``: rows ``:R`` the normed latent ``c``, rows ``R:`` the rotated shared
key ``k_rope``, one column per cached token, allocated once for the run's tokens and written in place at a
write index (a step's columns land after the last ones; nothing is copied as it fills). Both forms read it:

* ``naive``: every step expands the whole cache into each head's keys and values again (``W_UK @ C``,
  ``W_UV @ C``: ``T H (dn + dv) R`` multiply-adds a step), as transformers 5.17 and later do;
* ``absorbed``: the cache's ``R + dr`` rows are the one key head as they are (MQA over the latent).

Per token it holds ``(R + dr) * itemsize`` bytes against ``H (d_k + d_v) * itemsize`` for the per-head keys
and values a plain cache of these head sizes would hold (`core.mla_forms.cache_bytes_per_token`):
``info["cache"]`` reports both.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.decode import DecodeInputs, decode_allowed

from .._mla import latent_cache_info
from ..base import Prepared, PreparedDecode
from ..vocabulary import UnsupportedCase
from .common import MaskArrays, NumpyPrecision
from .heads import columns_to_rows
from .mla import ColumnSampleMLA, column_factors, column_tables

LATENT_LAYOUT = (
    "the latent and the rotated shared key as rows of one array (B, R + dr, T): rows :R the normed latent, rows "
    "R: k_rope, T on the last axis; allocated once for the run's tokens and written in place at a write index"
)


class LatentColumnCache:
    """The latent cache: ``entries`` (B, R + dr, capacity), each slot's position and validity, a write index."""

    def __init__(self, batch: int, rows: int, capacity: int, dtype) -> None:
        self.entries = np.zeros((batch, rows, capacity), dtype=dtype)  # (B, R + dr, capacity)
        self.positions = np.zeros((batch, capacity), dtype=np.int64)
        self.valid = np.zeros((batch, capacity), dtype=bool)  # a slot never written is invalid
        self.length = 0

    def write(self, kv_latent, k_rope, positions, valid) -> None:
        """The new tokens' columns (B, R, s) and (B, dr, s) written after the cached ones, in place."""
        R, s, i = kv_latent.shape[1], kv_latent.shape[-1], self.length
        if i + s > self.entries.shape[-1]:
            raise ValueError(
                f"the latent cache holds {self.entries.shape[-1]} tokens; {i} cached + {s} new overflow it"
            )
        self.entries[:, :R, i : i + s] = kv_latent  # rows :R, columns i:i+s: a view written in place
        self.entries[:, R:, i : i + s] = k_rope
        self.positions[:, i : i + s], self.valid[:, i : i + s] = positions, valid
        self.length = i + s

    def held(self):
        """(entries (B, R + dr, T), positions (B, T), valid (B, T)): views of the slots written so far."""
        T = self.length
        return self.entries[..., :T], self.positions[:, :T], self.valid[:, :T]


def decode_chunk(layer: ColumnSampleMLA, cache: LatentColumnCache, x, tokens: slice, positions, valid, form: str):
    """One chunk's token columns ``x`` (B, D, s) into the cache, then their attention over it: (B, D, s)."""
    P, R = layer.precision, layer.cfg.kv_lora_rank
    latent = layer.latent(x, tokens)
    cache.write(latent["kv_latent"], latent["k_rope"], positions, valid)
    entries, cached_positions, cached_valid = cache.held()
    entries = P.operand(entries)  # (B, R + dr, T) in the compute dtype (no copy at full precision)
    allowed = decode_allowed(layer.cfg, positions, cached_positions, cached_valid)  # (B, 1, s, T)
    mask = MaskArrays.from_allowed(allowed, keys_axis=-2)
    q = layer.queries(x, tokens)
    out, _, _ = layer.attend(form, q, entries[:, :R], entries[:, R:], mask, keys=entries)
    return out  # (B, D, s)


def prepare_numpy_mla_decode_run(
    cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, form: str
) -> PreparedDecode:
    """A whole decode run of MLA's ``form`` through a `LatentColumnCache` (`Backend._prepare_decode_run`)."""
    P = NumpyPrecision.for_dtype(dtype)
    tables = column_tables(cfg, SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions))
    # every position of the run, once: a chunk reads its columns (the temperature's with the cache offset)
    layer = ColumnSampleMLA(cfg, params, P, tables, column_factors(cfg, inputs.positions))
    xs = np.ascontiguousarray(P.operand(P.round_to_storage(inputs.x)).transpose(0, 2, 1))  # (B, D, N) columns
    B, N = inputs.batch, inputs.x.shape[1]
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim

    def run():
        cache = LatentColumnCache(B, rows, N, P.storage)
        outputs = []
        for start, stop in inputs.chunks():
            window = slice(start, stop)
            x = xs[..., window]  # (B, D, s): the chunk's token columns, a view
            outputs.append(
                decode_chunk(layer, cache, x, window, inputs.positions[:, window], inputs.valid[:, window], form)
            )
        return outputs

    def to_numpy(outputs):
        return columns_to_rows(np.concatenate(outputs, axis=-1))  # (B, D, N) -> (B, N, D)

    info = {
        "layout": "column samples (B, features, tokens); a step's scores (B, H, T, s), one column per new query",
        "form": form,
        "cache": latent_cache_info(cfg, B, N, P.storage.itemsize, LATENT_LAYOUT),
        **P.info(),
    }
    return PreparedDecode(run, to_numpy, info=info)


def prepare_numpy_mla_decode_step(cfg: MHAConfig, params: MHAParams, job) -> Prepared:
    """One timed step of MLA's ``job.strategy`` form (`bench --mode decode`): ``job.step`` new tokens onto a
    `LatentColumnCache` holding ``job.context`` tokens of arbitrary numbers (its normed latent and rotated shared key).

    The cache is allocated once with room for the step; every call rewinds its write index to ``context`` and
    writes the same step at the same place, so each timed call is the same step. Both forms read the same cache
    (the same seed draws the same numbers), so their outputs agree to rounding. A ragged batch is refused.
    """
    if job.lengths is not None:
        raise UnsupportedCase("numpy: MLA's timed step takes a rectangular batch (every row holds the context)")
    B, T, s, form = job.batch, job.context, job.step, job.strategy
    rng = np.random.default_rng(job.seed)
    P = NumpyPrecision.for_dtype(job.dtype)
    everywhere = np.broadcast_to(np.arange(T + s, dtype=np.int64), (B, T + s))  # (B, T + s): the run's positions
    tables = column_tables(cfg, SimpleNamespace(positions=everywhere, kv_positions=everywhere))
    layer = ColumnSampleMLA(cfg, params, P, tables, column_factors(cfg, everywhere))
    x = np.ascontiguousarray(P.operand(P.round_to_storage(rng.standard_normal((B, s, cfg.d_model)))).transpose(0, 2, 1))
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    cache = LatentColumnCache(B, rows, T + s, P.storage)
    cache.entries[..., :T] = rng.standard_normal((B, rows, T))  # (B, R + dr, T): the cached tokens' columns
    cache.positions[:, :T], cache.valid[:, :T] = everywhere[:, :T], True
    tokens, positions, valid = slice(T, T + s), everywhere[:, T:], np.ones((B, s), dtype=bool)

    def forward():
        cache.length = T  # the write index back before the step: every call is the same step
        return decode_chunk(layer, cache, x, tokens, positions, valid, form)  # (B, D, s)

    def native_stages():
        raise UnsupportedCase("numpy: MLA's timed decode step records no stages (run_decode's path is the checked one)")

    info = {
        "layout": "column samples (B, features, tokens); a step's scores (B, H, T, s), one column per new query",
        "form": form,
        "context": T,
        "step": s,
        "cache": latent_cache_info(cfg, B, T + s, P.storage.itemsize, LATENT_LAYOUT),
        **P.info(),
    }
    return Prepared(forward=forward, to_numpy=columns_to_rows, native_stages=native_stages, info=info)
