"""KV-cache decoding in column samples: keys stay columns, and a step appends columns.

The cache of one layer holds the keys ``(B, Hkv, Dk, T)`` and the values ``(B, Hkv, Dv, T)``,
features as rows and one column per cached token, exactly as `layer` holds ``k_rotated`` and
``v_heads``: a decode step's new keys are ``(B, Hkv, Dk, s)`` columns written after the cached
ones, and its scores are ``K^T @ Q``, ``(T, s)`` per head, one column per new query, as in the
full forward. The rules are those of `core.decode`:

* keys are cached after QK-norm and rotary and before the GQA repeat (Hkv heads, never H);
* causality and the window are read on positions (`core.decode.decode_allowed`), so a step is
  bottom-right; each slot keeps its token's position and whether it holds a real token;
* with a window the cache is a ring buffer of ``ring_capacity(cfg, step)`` columns (token t in
  column ``t % slots``): memory O(W). A prefill longer than the ring attends within itself and
  then keeps its last columns. The ring's columns are out of token order once it wraps; the
  softmax does not care about key order, the positions carry the rule.

Two cache kinds (`ColumnCache`):

* ``"columns"`` (the default) grows: preallocated, and its capacity doubled when a write does
  not fit, so appending a column costs O(1) amortised. ``np.concatenate`` per step would copy
  the whole cache on every token, O(T) per step and O(T^2) per sequence; the doubling copies
  each column O(1) times on average and holds at most twice the tokens.
* ``"static"`` is allocated once (``cache_capacity`` slots for a run) with a write index;
  writing past its capacity is `core.decode.CacheFull`, never a silent wrap.

A step reuses the layer (`layer.ColumnSampleMHA`, built once for the run's tokens and
positions): its projections, QK-norm, rotary (the run's tables, sliced to the chunk's
columns), its batched attention (`_attend_batched` with the chunk's own mask and score bias
over the cache's columns), the variants (`variants.ColumnVariants.tile_bias` for ALiBi and T5
from the slots' positions) and its precision policy (`common.NumpyPrecision`: half types
stored, products and the softmax computed in float32; the cache is stored in the half type, so a
half-precision step converts the cache's columns to float32 for its two products, a copy that is
part of the step's time: NumPy has no half-precision BLAS).

The rotary tables are the run's, computed once for every position of the sequence, as the
full forward computes them; with dynamic (NTK) rope scaling this means 1 + the run's largest
position, which a decoder that does not know the sequence's length ahead cannot reproduce
(it would rescale, and its cached keys would be stale: transformers PR #33129).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, prepare_inputs
from mha_rosetta.core.decode import (
    DecodeInputs,
    cache_capacity,
    check_capacity,
    decode_allowed,
    ring_capacity,
)
from mha_rosetta.core.page_pool import pool_pages

from .._paged import PAGED
from .._recording import StageRecorder, relation_to
from ..base import DecodeStep, Prepared, PreparedDecode
from .common import MaskArrays, NumpyPrecision
from .heads import _split_reshape, columns_to_rows
from .layer import ColumnSampleMHA
from .paged import PAGED_LAYOUT, PagedColumnCache

GROWING, STATIC = "columns", "static"
CACHE_KINDS = (GROWING, STATIC, PAGED)
CACHE_LAYOUTS = {
    GROWING: "keys (B, Hkv, Dk, T) and values (B, Hkv, Dv, T): T on the last axis, a step appends columns; "
    "preallocated and doubled when full (amortised O(1) per column); a ring of W - 1 + step columns with a window",
    STATIC: "keys (B, Hkv, Dk, T) and values (B, Hkv, Dv, T) allocated once with a write index; writing past the "
    "capacity is CacheFull; a ring of W - 1 + step columns with a window",
    PAGED: PAGED_LAYOUT,
}


class ColumnCache:
    """One layer's keys and values as columns, with each slot's position and validity.

    keys ``(B, Hkv, Dk, slots)``, values ``(B, Hkv, Dv, slots)`` in the storage dtype;
    positions ``(B, slots)`` int64; valid ``(B, slots)`` bool (False: never written, or padding).
    ``ring``: a sliding window's ring buffer of that many slots (token t in slot ``t % ring``).
    """

    def __init__(self, kind: str, batch: int, heads: int, d_k: int, d_v: int, dtype, capacity: int, ring=None):
        if kind not in (GROWING, STATIC):  # the paged kind is `paged.PagedColumnCache`
            raise ValueError(f"kind must be one of {GROWING}, {STATIC}, got {kind!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (slots per sequence), got {capacity!r}")
        self.kind, self.ring = kind, ring
        self.written = 0  # tokens written so far (a ring keeps the last `ring` of them)
        self.reallocations = 0
        self._allocate(batch, heads, d_k, d_v, np.dtype(dtype), int(ring if ring is not None else capacity))

    def _allocate(self, batch, heads, d_k, d_v, dtype, slots) -> None:
        self.keys = np.zeros((batch, heads, d_k, slots), dtype=dtype)  # (B, Hkv, Dk, slots)
        self.values = np.zeros((batch, heads, d_v, slots), dtype=dtype)  # (B, Hkv, Dv, slots)
        self.positions = np.zeros((batch, slots), dtype=np.int64)  # (B, slots)
        self.valid = np.zeros((batch, slots), dtype=bool)  # (B, slots): nothing written yet

    @property
    def slots(self) -> int:
        """The columns allocated per sequence (the memory held, not the tokens written)."""
        return self.keys.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together (the positions and validity flags are bookkeeping, not counted)."""
        return self.keys.nbytes + self.values.nbytes

    def rewind(self, written: int) -> None:
        """Forget the tokens written after the first ``written`` (a benchmark repeats one step at one context)."""
        self.written = written

    def _grow(self, needed: int) -> None:
        """Double the capacity (at least to ``needed``), copying the written columns once."""
        old = (self.keys, self.values, self.positions, self.valid)
        B, Hkv, Dk, slots = self.keys.shape
        self._allocate(B, Hkv, Dk, self.values.shape[2], self.keys.dtype, max(2 * slots, needed))
        for new, array in zip((self.keys, self.values, self.positions, self.valid), old, strict=True):
            new[..., :slots] = array  # the old columns, in place at the front
        self.reallocations += 1

    def write(self, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, valid: np.ndarray) -> None:
        """Append ``s`` columns: keys (B, Hkv, Dk, s), values (B, Hkv, Dv, s), positions and valid (B, s)."""
        s = keys.shape[-1]
        if self.ring is not None:
            keep = min(s, self.ring)  # a prefill longer than the ring keeps its last columns
            slots = np.arange(self.written + s - keep, self.written + s) % self.ring  # (keep,)
            cut = slice(s - keep, s)
        else:
            if self.kind == STATIC:
                check_capacity(self.slots, self.written, s)
            elif self.written + s > self.slots:
                self._grow(self.written + s)
            slots, cut = slice(self.written, self.written + s), slice(None)
        self.keys[..., slots] = keys[..., cut]
        self.values[..., slots] = values[..., cut]
        self.positions[:, slots] = positions[:, cut]
        self.valid[:, slots] = valid[:, cut]
        self.written += s

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, values, positions, valid) of the slots in use: every slot of a ring, else the written ones.

        Views: ``keys[..., :T]`` keeps unit stride along the tokens, so BLAS reads it in place.
        """
        used = self.slots if self.ring is not None else self.written
        return self.keys[..., :used], self.values[..., :used], self.positions[:, :used], self.valid[:, :used]

    def info(self) -> dict:
        layout = "(B, Hkv, Dk, T)" + (f" ring of {self.ring} columns" if self.ring is not None else "")
        return {"kind": self.kind, "layout": layout, "slots": self.slots, "bytes": self.nbytes}


def grown_capacity(initial: int, chunk_ends) -> tuple[int, int]:
    """(slots, reallocations) of a growing cache of ``initial`` slots after writes ending at ``chunk_ends``.

    The same rule as `ColumnCache.write`: a write that does not fit doubles the slots, or grows them
    to the write's end when that is further (a step longer than the cache)."""
    slots, grown = initial, 0
    for end in chunk_ends:
        if end > slots:
            slots, grown = max(2 * slots, end), grown + 1
    return slots, grown


class ColumnSampleDecoder(ColumnSampleMHA):
    """The column-sample layer for a decode run: converted once for every token, then fed chunk by chunk.

    ``x`` (B, N, D) and ``positions`` (B, N) are the whole run's: the weights, the token columns
    and the rotary tables are the layer's, built once; a chunk reads its columns of them.
    No full mask or score bias is built (they are quadratic in N): each chunk makes its own over
    the cache's slots.
    """

    materialise_mask = False

    def __init__(self, cfg: MHAConfig, params: MHAParams, x, positions, precision: NumpyPrecision) -> None:
        super().__init__(cfg, params, prepare_inputs(cfg, x, positions=positions), precision, batched=False)
        self.run_factors = self.factors  # the temperature's factors of every position of the run (1|B, N), or None

    def new_cache(self, kind: str, capacity: int, step: int, paging=None) -> ColumnCache | PagedColumnCache:
        cfg, batch = self.cfg, self.sizes[0]
        if kind == PAGED:  # paging: (page_size, pool pages, seed)
            page_size, n_pages, seed = paging
            dims = (batch, cfg.n_kv_heads, cfg.d_k, cfg.d_v, self.precision.storage)
            return PagedColumnCache(*dims, page_size, n_pages, seed, cfg.window)
        ring = ring_capacity(cfg, step)
        return ColumnCache(kind, batch, cfg.n_kv_heads, cfg.d_k, cfg.d_v, self.precision.storage, capacity, ring)

    def chunk(
        self, cache: ColumnCache | PagedColumnCache, tokens: slice, positions, valid, rec: StageRecorder | None = None
    ):
        """Feed the run's tokens ``tokens`` (positions and valid (B, s)) through ``cache``: their output (B, D, s).

        The chunk's keys and values join the cache first and the queries attend over its columns;
        only a chunk longer than a ring (a prefill) attends over its own keys, then leaves its last ones.
        """
        cfg, H, Hkv = self.cfg, self.cfg.n_heads, self.cfg.n_kv_heads
        x = self.x_q[..., tokens]  # (B, D, s): the chunk's columns, a view
        q = self._project(self.w_q, self.b_q, x)  # (B, H*Dk, s)
        k = self._project(self.w_k, self.b_k, x)  # (B, Hkv*Dk, s)
        v = self._project(self.w_v, self.b_v, x)  # (B, Hkv*Dv, s)
        heads = (_split_reshape(q, H), _split_reshape(k, Hkv), _split_reshape(v, Hkv))  # views: row blocks
        how = "reshape of the row axis, no transpose; the new keys are written to the cache as these columns"
        q_rotated, k_rotated = self._rotate_split(rec, (q, k, v), heads, how, _split_reshape, tokens)
        if self.run_factors is not None:  # the temperature at the chunk's positions: the cache offset included
            self.factors = self.run_factors[:, tokens]  # (1|B, s), a view
        # What the scores and the weighted sum read (Llama 4's steps after rotary, Gemma 4's value norm): cached so
        q_rotated, k_rotated, v_heads = self._scored_heads(rec, q_rotated, k_rotated, heads[2])  # (B, Hkv, Dv, s)
        cache.write(k_rotated, v_heads, positions, valid)  # a copy into the cache's columns
        if cache.ring is not None and k.shape[-1] > cache.ring:
            keys = (k_rotated, v_heads, positions, valid)  # a prefill longer than the ring attends within itself
        else:
            keys = cache.columns()  # (B, Hkv, Dk, T), (B, Hkv, Dv, T), (B, T), (B, T): views
        k_cols, v_cols, k_positions, k_valid = keys
        allowed = decode_allowed(cfg, positions, k_positions, k_valid)  # (B, 1, s, T)
        mask = MaskArrays.from_allowed(allowed, keys_axis=-2)  # blocked (B, 1, T, s): keys on the rows
        bias = None
        if cfg.has_score_bias:  # ALiBi and T5 from the slots' positions: key minus query, one column per query
            bias = self.variants.tile_bias(k_positions[:, :, None] - positions[:, None, :])  # (B, H, T, s)
        context = self._attend_batched(q_rotated, k_cols, v_cols, rec, keys=(mask, bias))  # (B, H, Dv, s)
        B, _, Dv, s = context.shape
        merged = context.reshape(B, H * Dv, s)  # (B, H*Dv, s), view: heads stacked as row blocks
        if rec is not None:
            relation = relation_to(merged, context)
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), "reshape, no transpose", relation, "context")
        return self._finish(merged, rec, tokens)  # (B, D, s): gated by the chunk's own tokens (nothing cached)


def _cache_capacity(cfg: MHAConfig, kind: str, inputs: DecodeInputs) -> int:
    """A run's first allocation: the prefill's columns (growing) or the whole run's (static); a ring's slots."""
    if kind == GROWING:
        return inputs.prefill
    return cache_capacity(cfg, inputs.tokens, inputs.step)


def prepare_numpy_decode_run(
    cfg, params, inputs: DecodeInputs, dtype: str, cache: str, page_size=None, page_seed=0
) -> PreparedDecode:
    """A whole decode run through a `ColumnCache` of kind ``cache``, or a `PagedColumnCache` of ``page_size``
    tokens a page (`Backend._prepare_decode_run`)."""
    decoder = ColumnSampleDecoder(cfg, params, inputs.x, inputs.positions, NumpyPrecision.for_dtype(dtype))
    positions, valid, chunks = inputs.positions, inputs.valid, inputs.chunks()
    capacity = _cache_capacity(cfg, cache, inputs) if cache != PAGED else 0
    paging = None
    if cache == PAGED:
        paging = (page_size, pool_pages(inputs.batch, page_size, chunks, cfg.window), page_seed)

    def run_chunks(record: bool):
        state = decoder.new_cache(cache, capacity, inputs.step, paging)
        outputs, stages = [], []
        for start, stop in chunks:
            rec = StageRecorder() if record else None
            window = slice(start, stop)
            outputs.append(decoder.chunk(state, window, positions[:, window], valid[:, window], rec))
            if rec is not None:
                stages.append(rec.stages())
        return outputs, stages

    def run():
        return run_chunks(record=False)[0]  # each chunk's output (B, D, s)

    def to_numpy(outputs):
        return columns_to_rows(np.concatenate(outputs, axis=-1))  # (B, D, N) -> (B, N, D), a copy

    info = {
        "layout": "column samples (B, features, tokens); a step's scores (B, H, T, s), one column per new query",
        **decoder.precision.info(),
    }
    probe = decoder.new_cache(cache, capacity, inputs.step, paging)
    slots = probe.slots
    if cache == GROWING and probe.ring is None:  # the slots it holds once the run is done
        slots, info["reallocations"] = grown_capacity(capacity, [stop for _, stop in chunks])
    itemsize = decoder.precision.storage.itemsize
    B, Hkv, Dk, Dv = inputs.batch, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    info["cache"] = {**probe.info(), "slots": slots, "bytes": B * Hkv * slots * (Dk + Dv) * itemsize}
    return PreparedDecode(run, to_numpy, step_stages=lambda: run_chunks(record=True)[1], info=info)


def prepare_numpy_decode_step(cfg, params, job: DecodeStep) -> Prepared:
    """One step of ``step`` tokens on a cache holding ``context`` tokens of random numbers (`bench --mode decode`).

    The cache is allocated once with room for the step (``context + step`` columns, or the ring's
    slots already full); every call of ``forward`` writes the same step at the same place
    (`ColumnCache.rewind`), so each timed call is the same step: the append into spare capacity a
    growing cache has between doublings (a doubling's copy is amortised over the columns it makes
    room for, and is not in the timed step).
    """
    batch, context, step, dtype = job.batch, job.context, job.step, job.dtype
    rng = np.random.default_rng(job.seed)
    D, Hkv, Dk, Dv = cfg.d_model, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    x = rng.standard_normal((batch, step, D))  # the step's new tokens, (B, s, D)
    positions = job.positions()  # (B, s)
    decoder = ColumnSampleDecoder(cfg, params, x, positions, NumpyPrecision.for_dtype(dtype))
    paging = None
    if job.cache == PAGED:  # pages of vLLM's default size; the pool holds the context, then the step (a window frees)
        paging = job.paging(cfg.window)
    state = decoder.new_cache(job.cache, context + step, step, paging)
    # The cached tokens' keys and values: arbitrary numbers, the last ones a ring keeps (all of them without a ring).
    first = 0 if state.ring is None else max(0, context - state.ring)
    state.rewind(first)
    n = context - first
    if n:
        fill = np.broadcast_to(np.arange(first, context, dtype=np.int64), (batch, n))  # (B, n)
        shape = (batch, Hkv, Dk, n), (batch, Hkv, Dv, n)
        keys, values = (rng.standard_normal(s).astype(decoder.precision.storage) for s in shape)
        state.write(keys, values, fill, np.ones((batch, n), dtype=bool))
    every = np.ones((batch, step), dtype=bool)
    tokens = slice(0, step)

    def forward(rec=None):
        state.rewind(context)
        return decoder.chunk(state, tokens, positions, every, rec)  # (B, D, s)

    def native_stages():
        rec = StageRecorder()
        forward(rec)
        return rec.stages()

    info = {
        "layout": "column samples (B, features, tokens); a step's scores (B, H, T, s), one column per new query",
        "context": context,
        "step": step,
        "cache": state.info(),
        **decoder.precision.info(),
    }
    return Prepared(forward=forward, to_numpy=columns_to_rows, native_stages=native_stages, info=info)
