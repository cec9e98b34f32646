"""KV-cache decoding in MLX, through mlx-lm's cache idiom (``mlx_lm/models/cache.py``).

* ``KVCache``: keys ``(B, Hkv, T, Dk)`` and values ``(B, Hkv, T, Dv)`` preallocated in steps of
  ``step`` slots (mlx-lm's 256): when ``s`` new tokens do not fit, ``ceil(s / step) * step`` more zero
  slots are concatenated on the token axis (after cutting the cache to its offset when that is not a
  multiple of ``step``; a test holds the allocation equal to ``mlx_lm.models.cache.KVCache``'s), and ``update_and_fetch`` writes the new keys at the offset
  (``keys[..., prev:offset, :] = new``) and returns the written slots. Growth by a fixed step (not
  doubling) is mlx-lm's choice: O(T / step) reallocations, each a copy of the whole cache.
* With a sliding window the cache is mlx-lm's ``RotatingKVCache``: a ring of ``W - 1 + step``
  slots (`core.decode.ring_capacity`), token t in slot ``t % ring``; a prefill longer than the ring
  attends within itself and leaves its last tokens (mlx-lm trims the same way).

Each slot's position and validity are kept beside it in NumPy (the mask of a chunk is bookkeeping,
`core.decode.decode_allowed`, made before the chunk's graph is evaluated). Keys are cached after
QK-norm and rotary, with ``Hkv`` heads (never repeated for GQA). The chunk's attention is
`layer.MlxAttention.attend` over the slots in use: the same score steps as the forward. MLA's forms
feed their latent through the same cache (`mla.MlxMLADecoder`: keys the latent, values ``k_pe``), as mlx-lm's
``DeepseekV3Attention`` does; `decode_run` and `timed_step` serve both decoders.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, prepare_inputs
from mha_rosetta.core.decode import DecodeInputs, decode_allowed, ring_capacity
from mha_rosetta.core.page_pool import pool_pages

from .._paged import PAGED
from .._recording import StageRecorder
from ..base import DecodeStep, Prepared, PreparedDecode, tensor_to_numpy
from ..frameworks.mlx import mlx_stream, precision_info, to_mlx
from .layer import MlxAttention, mlx_tables
from .paged import PAGED_LAYOUT, MlxPagedCache

STEPPED = "stepped"
DECODE_CACHES = (STEPPED, PAGED)
DECODE_LAYOUTS = {
    PAGED: PAGED_LAYOUT,
    STEPPED: "mlx-lm's KVCache: keys (B, Hkv, T, Dk), values (B, Hkv, T, Dv), preallocated in steps of 256 slots "
    "(concatenated when full); with a window, RotatingKVCache: a ring of W - 1 + step slots",
}
MLX_LM_STEP = 256  # mlx_lm.models.cache.KVCache.step


class MlxKVCache:
    """One layer's keys and values in mlx-lm's layout, grown in steps (or a ring), with each slot's position.

    ``step``: the slots added when a write does not fit (mlx-lm's 256; a test passes a small one to see the
    growth); ``ring``: a sliding window's ring of that many slots.
    """

    def __init__(self, step: int = MLX_LM_STEP, ring: int | None = None) -> None:
        self.step, self.ring = step, ring
        self.keys = self.values = None  # (B, Hkv, slots, Dk), (B, Hkv, slots, Dv)
        self.positions = self.valid = None  # (B, slots) int64, bool: NumPy bookkeeping
        self.offset = 0  # tokens written (a ring keeps the last `ring` of them)
        self.reallocations = 0

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, keys, values) -> None:
        """mlx-lm's growth (``KVCache.update_and_fetch``): ``ceil(s / step) * step`` zero slots for ``s`` new tokens,
        concatenated after the written ones (a cache whose offset is not a multiple of ``step`` is first cut
        to it); a ring: its slots, once."""
        import mlx.core as mx

        B, Hkv, s, Dk = keys.shape
        add = self.ring if self.ring is not None else (self.step + s - 1) // self.step * self.step
        new_k = mx.zeros((B, Hkv, add, Dk), dtype=keys.dtype)
        new_v = mx.zeros((B, Hkv, add, values.shape[-1]), dtype=values.dtype)
        new_p, new_valid = np.zeros((B, add), dtype=np.int64), np.zeros((B, add), dtype=bool)
        if self.keys is None:
            self.keys, self.values, self.positions, self.valid = new_k, new_v, new_p, new_valid
            return
        prev = self.offset
        if prev % self.step != 0:  # mlx-lm: self.keys = self.keys[..., :prev, :]
            self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
            self.positions, self.valid = self.positions[:, :prev], self.valid[:, :prev]
        self.keys = mx.concatenate([self.keys, new_k], axis=2)  # (B, Hkv, slots + add, Dk): a copy of the cache
        self.values = mx.concatenate([self.values, new_v], axis=2)
        self.positions = np.concatenate([self.positions, new_p], axis=1)
        self.valid = np.concatenate([self.valid, new_valid], axis=1)
        self.reallocations += 1

    def update_and_fetch(self, keys, values, positions: np.ndarray, valid: np.ndarray):
        """Write ``s`` new tokens (keys (B, Hkv, s, Dk), values, positions and valid (B, s)); return the slots in
        use: (keys, values, positions, valid)."""
        import mlx.core as mx

        s = keys.shape[2]
        if self.keys is None or (self.ring is None and self.offset + s > self.slots):
            self._grow(keys, values)
        if self.ring is not None:
            keep = min(s, self.ring)  # a prefill longer than the ring keeps its last tokens
            slots = np.arange(self.offset + s - keep, self.offset + s) % self.ring  # (keep,)
            index = mx.array(slots)
            self.keys[:, :, index, :] = keys[:, :, s - keep :]
            self.values[:, :, index, :] = values[:, :, s - keep :]
            self.positions[:, slots], self.valid[:, slots] = positions[:, s - keep :], valid[:, s - keep :]
        else:
            prev = self.offset
            self.keys[..., prev : prev + s, :] = keys  # mlx-lm: self.keys[..., prev:self.offset, :] = keys
            self.values[..., prev : prev + s, :] = values
            self.positions[:, prev : prev + s], self.valid[:, prev : prev + s] = positions, valid
        self.offset += s
        used = self.slots if self.ring is not None else self.offset
        return self.keys[..., :used, :], self.values[..., :used, :], self.positions[:, :used], self.valid[:, :used]

    def rewind(self, offset: int) -> None:
        """Forget the tokens written after the first ``offset`` (a benchmark repeats one step at one context)."""
        self.offset = offset

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def info(self) -> dict:
        kind = "RotatingKVCache" if self.ring is not None else f"KVCache (step {self.step})"
        layout = "(B, Hkv, T, Dk)" + (f" ring of {self.ring} slots" if self.ring is not None else "")
        return {"kind": kind, "layout": layout, "slots": self.slots, "bytes": self.nbytes()}


class MlxDecoder:
    """mlx-lm's attention fed chunk by chunk through a cache: parameters, tokens and rotary tables converted once.

    ``layer_type``: the layer a chunk runs (`mla.MlxMLADecoder` runs MLA's over a latent cache);
    ``records_stages``: whether a chunk records its stages (`PreparedDecode.step_stages`).
    """

    layer_type = MlxAttention
    records_stages = True

    def __init__(self, cfg: MHAConfig, params: MHAParams, x: np.ndarray, positions: np.ndarray, dtype: str) -> None:
        self.cfg, self.layer = cfg, self.layer_type(cfg, params, dtype)
        self.x = to_mlx(x, dtype)  # (B, N, D)
        self.tables = mlx_tables(cfg, prepare_inputs(cfg, x, positions=positions), dtype)  # the run's positions

    def new_cache(self, step: int, cache_step: int = MLX_LM_STEP, paging=None) -> MlxKVCache | MlxPagedCache:
        """mlx-lm's cache, or with ``paging`` (batch, dtype, page size, pool pages, seed) a `paged.MlxPagedCache`."""
        if paging is not None:
            batch, dtype, *pages = paging
            return MlxPagedCache(batch, self.cfg, dtype, *pages)
        return MlxKVCache(cache_step, ring_capacity(self.cfg, step))

    def chunk_tables(self, start: int, stop: int) -> dict | None:
        """The run's tables for tokens ``start:stop``: each (1|B, 1, s, r/2), or None."""
        if self.tables is None:
            return None
        return {w: tuple(t[:, :, start:stop] for t in pair) for w, pair in self.tables.items()}

    @staticmethod
    def fetch(cache, keys, values, positions, valid) -> tuple:
        """``cache.update_and_fetch``: (keys, values, positions, valid) of the slots a chunk attends over; a prefill
        longer than a ring attends within itself."""
        fetched = cache.update_and_fetch(keys, values, positions, valid)
        if cache.ring is not None and keys.shape[2] > cache.ring:
            return keys, values, positions, valid
        return fetched

    def cached_entries(self, rng: np.random.Generator, batch: int, context: int, first: int) -> tuple:
        """A timed step's cached tokens ``first .. context - 1`` of arbitrary numbers: keys (B, Hkv, n, Dk) and values
        (B, Hkv, n, Dv)."""
        shape, dims = (batch, self.cfg.n_kv_heads, context - first), (self.cfg.d_k, self.cfg.d_v)
        return tuple(to_mlx(rng.standard_normal((*shape, d)), self.layer.dtype) for d in dims)

    def describe(self, cache) -> dict:
        """What `PreparedDecode.info` and a timed step's info say of the decoder and its ``cache``."""
        return {"cache": cache.info()}

    def chunk(self, cache: MlxKVCache, start: int, stop: int, positions, valid, rec: StageRecorder | None = None):
        """Tokens ``start:stop`` (positions and valid (B, s)) through ``cache``: their output (B, s, D)."""
        layer, p = self.layer, self.layer.params
        x = self.x[:, start:stop]  # (B, s, D)
        # (B, H, s, Dk), (B, Hkv, s, Dk), (B, Hkv, s, Dv)
        q, k, v = layer.heads(p, x, x, x, self.chunk_tables(start, stop), rec)
        keys, values, k_positions, k_valid = self.fetch(cache, k, v, positions, valid)
        blocked = to_mlx(~decode_allowed(self.cfg, positions, k_positions, k_valid), None)  # (B, 1, s, T)
        distance = k_positions[:, None, :] - positions[:, :, None]  # (B, s, T): key minus query
        context = layer.attend(p, q, keys, values, blocked, distance, rec)  # (B, H, s, Dv)
        return layer.finish(p, context, rec, x)  # (B, s, D): gated by the chunk's own tokens


def _info(cfg: MHAConfig, dtype: str, device: str) -> dict:
    return {
        "layout": "row samples (B, L, features); a step's scores (B, H, s, T) over the cache's slots",
        "device": device,
        **precision_info(dtype),
    }


def decode_chunks(decoder: MlxDecoder, inputs: DecodeInputs, stream, paging=None, record: bool = False) -> tuple:
    """The prefill and every step of ``inputs`` through a new cache of ``decoder``'s, each evaluated before the next
    (as a generation loop evaluates): (outputs, each chunk's stages when ``record``, the cache)."""
    import mlx.core as mx

    state = decoder.new_cache(inputs.step, paging=paging)
    outputs, stages = [], []
    with mx.stream(stream):
        for start, stop in inputs.chunks():
            rec = StageRecorder() if record else None
            window = slice(start, stop)
            outputs.append(decoder.chunk(state, start, stop, inputs.positions[:, window], inputs.valid[:, window], rec))
            mx.eval(outputs[-1], state.keys, state.values)  # one step at a time, as a generation loop evaluates
            if rec is not None:
                stages.append(rec.stages())
    return outputs, stages, state


def decode_run(decoder: MlxDecoder, inputs: DecodeInputs, dtype: str, device: str, paging=None) -> PreparedDecode:
    """A whole decode run of ``decoder`` (`Backend._prepare_decode_run`), its cache described by ``decoder``."""
    import mlx.core as mx

    stream = mlx_stream(device)

    def to_numpy(outputs):
        return np.concatenate([tensor_to_numpy(out) for out in outputs], axis=1)  # (B, N, D)

    _, _, probe = decode_chunks(decoder, inputs, stream, paging)  # once, untimed: the cache it ends with
    info = {**_info(decoder.cfg, dtype, device), **decoder.describe(probe), "reallocations": probe.reallocations}

    def step_stages():
        return decode_chunks(decoder, inputs, stream, paging, record=True)[1]

    return PreparedDecode(
        lambda: decode_chunks(decoder, inputs, stream, paging)[0],
        to_numpy,
        step_stages=step_stages if decoder.records_stages else None,
        synchronize=mx.eval,
        info=info,
    )


def prepare_mlx_decode_run(
    cfg, params, inputs: DecodeInputs, dtype: str, device: str, cache: str, page_size=None, page_seed=0
) -> PreparedDecode:
    """A whole decode run through an `MlxKVCache`, or an `MlxPagedCache` of ``page_size`` tokens a page
    (`Backend._prepare_decode_run`)."""
    decoder = MlxDecoder(cfg, params, inputs.x, inputs.positions, dtype)
    paging = None
    if page_size is not None:
        pages = pool_pages(inputs.batch, page_size, inputs.chunks(), cfg.window)
        paging = (inputs.batch, dtype, page_size, pages, page_seed)
    return decode_run(decoder, inputs, dtype, device, paging)


def timed_step(decoder: MlxDecoder, job: DecodeStep, rng: np.random.Generator, positions: np.ndarray) -> Prepared:
    """One step of ``job.step`` tokens (``decoder``'s, at ``positions`` (B, s)) on a cache holding ``job.context``
    tokens of ``decoder.cached_entries``' numbers drawn from ``rng``; every call writes the same step at the same
    place (`MlxKVCache.rewind`). ``cache="paged"``: an `MlxPagedCache` holding the whole context in pages
    (`DecodeStep.paging`), rewound the same way. A ragged batch (``job.lengths``): each row's tokens the last of
    its slots, its pads invalid (`DecodeStep.cached`)."""
    import mlx.core as mx

    batch, context, step = job.batch, job.context, job.step
    paging = (batch, job.dtype, *job.paging(decoder.cfg.window)) if job.cache == PAGED else None
    state = decoder.new_cache(step, paging=paging)
    first = 0 if state.ring is None else max(0, context - state.ring)
    state.rewind(first)
    if context > first:
        fill, held = job.cached(first)  # (B, n) each: a ragged batch's pads invalid
        state.update_and_fetch(*decoder.cached_entries(rng, batch, context, first), fill, held)
    every = np.ones((batch, step), dtype=bool)
    stream = mlx_stream(job.device)

    def forward(rec=None):
        state.rewind(context)
        with mx.stream(stream):
            return decoder.chunk(state, 0, step, positions, every, rec)  # (B, s, D)

    def native_stages():
        rec = StageRecorder()
        forward(rec)
        return rec.stages()

    mx.eval(forward())  # once, untimed: the cache has its room for the step
    info = {**_info(decoder.cfg, job.dtype, job.device), "context": context, "step": step, **decoder.describe(state)}
    return Prepared(
        forward=forward, to_numpy=tensor_to_numpy, native_stages=native_stages, synchronize=mx.eval, info=info
    )


def prepare_mlx_decode_step(cfg, params, job: DecodeStep) -> Prepared:
    """One step of mlx-lm's attention on its cache (`bench --mode decode`, `timed_step`): the step's tokens drawn
    first, then the cached keys and values."""
    rng = np.random.default_rng(job.seed)
    x = rng.standard_normal((job.batch, job.step, cfg.d_model))  # the step's new tokens, (B, s, D)
    positions = job.positions()  # (B, s)
    return timed_step(MlxDecoder(cfg, params, x, positions, job.dtype), job, rng, positions)
