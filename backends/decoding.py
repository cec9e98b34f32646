"""Rule 8 of `backends.base`: decoding through an adapter's own KV cache, the part of `Backend` that
validates a decode request and hands it to the adapter's ``_prepare_decode_run`` or, for one timed step,
``_prepare_decode_step`` (with a `DecodeStep`, the one bundle of what that step is asked to be)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, check_dtype_name, validate_params
from mha_rosetta.core.decode import DecodeInputs, decode_stage_names, prepare_decode_inputs
from mha_rosetta.core.page_pool import PagePool, pool_pages
from mha_rosetta.core.paged import check_page_size
from mha_rosetta.core.ragged import RaggedBatch

from ._paged import PAGED
from .prepared import Prepared, PreparedDecode, canonical_stage
from .vocabulary import STANDARD, UnsupportedCase, check_device_name


@dataclass(frozen=True)
class DecodeStep:
    """One timed decode step as `Backend.prepare_decode` validated it (`bench --mode decode`): ``step`` new
    tokens at positions ``context ..`` onto a cache holding ``context`` tokens, ``batch`` sequences, the
    cache's numbers drawn from ``seed``. ``cache`` is the cache kind (the adapter's default filled in).

    ``lengths`` (a ragged batch, continuous batching): row ``b`` holds ``lengths[b]`` real tokens, the last ones
    of its ``context`` slots (left padding, ``context = max(lengths)``), and its step sits at its own positions
    ``lengths[b] ..``; its pads are invalid slots at position -1 (`core.decode.padding_positions`). None: every
    row holds ``context`` tokens (a rectangular batch)."""

    batch: int
    context: int
    step: int
    dtype: str
    device: str
    strategy: str
    cache: str
    seed: int
    lengths: tuple[int, ...] | None = None

    def row_lengths(self) -> np.ndarray:
        """(B,) int64: the real tokens each row's cache holds before the step."""
        if self.lengths is None:
            return np.full(self.batch, self.context, dtype=np.int64)
        return np.asarray(self.lengths, dtype=np.int64)

    def cached(self, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(positions, valid) (B, context - first) of the cache's slots ``first .. context - 1`` before the step:
        every row's tokens ``0 ..`` right-aligned in its slots, the pads before them invalid at position -1."""
        pads = self.context - self.row_lengths()  # (B,)
        slots = np.arange(first, self.context, dtype=np.int64)[None, :]  # (1, n)
        valid = slots >= pads[:, None]  # (B, n)
        return np.where(valid, slots - pads[:, None], -1), valid

    def paging(self, window: int | None) -> tuple[int, int, int]:
        """The paged cache of this step (``cache="paged"``): (page size, pool pages, seed). Pages of
        `DEFAULT_PAGE_SIZE` (vLLM's), a pool that holds the context, then the step (a window frees whole pages
        before the step takes its own), in the physical order drawn from ``seed``. Every adapter's timed paged
        step takes its pool from here, so that each convention pages the same way. A ragged batch's pool
        holds only the pages its rows hold (pads take none: their pages share the null page), counted by
        booking the context and the step in a `PagePool` as the step's cache will."""
        chunks = [(0, self.context), (self.context, self.context + self.step)]
        pages = pool_pages(self.batch, DEFAULT_PAGE_SIZE, chunks, window)
        if self.lengths is not None:
            booked = PagePool(self.batch, DEFAULT_PAGE_SIZE, pages, self.seed, window)
            booked.write_slots(self.context, self.cached()[1])
            booked.write_slots(self.step)
            pages = booked.peak
        return DEFAULT_PAGE_SIZE, pages, self.seed

    def positions(self) -> np.ndarray:
        """The step's tokens' positions (B, s): ``L .. L + step - 1`` in the row holding L tokens (`row_lengths`;
        ``context ..`` in every row of a rectangular batch)."""
        return self.row_lengths()[:, None] + np.arange(self.step, dtype=np.int64)[None, :]  # (B, s)


DEFAULT_PAGE_SIZE = 16  # vLLM's default block size


def paging_options(cache: str, page_size, page_seed) -> dict:
    """The paged cache's keywords for ``_prepare_decode_run`` (none for another kind, where ``page_size`` is refused)."""
    if cache != PAGED:
        if page_size is not None:
            raise ValueError(f"page_size is for cache='paged', got cache={cache!r}")
        return {}
    page_size = check_page_size(DEFAULT_PAGE_SIZE if page_size is None else page_size)
    if isinstance(page_seed, bool) or not isinstance(page_seed, (int, np.integer)):
        raise TypeError(f"page_seed must be an int (the seed of the pages' physical order), got {page_seed!r}")
    return {"page_size": page_size, "page_seed": int(page_seed)}


class DecodeMixin:
    """The decode half of `Backend` (rule 8); `Backend` supplies ``decode_reason`` and the capability sets."""

    name: str
    decode_caches: tuple[str, ...]
    # The paged cache in `prepare_decode` (bench --mode decode's timed step): an adapter that builds it says so.
    paged_decode_step = False
    # A ragged batch in `prepare_decode` (``lengths=``: rows at different lengths, left padded): likewise.
    ragged_decode_step = False

    def _decode_validate(self, cfg, params, dtype, device, strategy, cache):
        dtype = check_dtype_name(dtype)
        device = check_device_name(device)
        validate_params(cfg, params)
        reason = self.decode_reason(cfg, dtype, device, strategy, cache)
        if reason:
            raise UnsupportedCase(reason)
        return dtype, device, cache or self.decode_caches[0]

    def _prepare_decode_run(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        inputs: DecodeInputs,
        dtype: str,
        device: str,
        strategy: str,
        cache: str,
    ) -> PreparedDecode:
        """Subclasses with a cache override this (rule 8); ``inputs`` is checked and batched."""
        raise UnsupportedCase(f"{self.name} has no KV-cache decoding")

    def _prepare_decode_step(self, cfg: MHAConfig, params: MHAParams, job: DecodeStep) -> Prepared:
        """Subclasses override this for `bench --mode decode`: ``forward`` is one step of ``job.step`` tokens at
        ``job.context`` cached tokens (the cache filled with arbitrary numbers; a window's ring already full)."""
        raise UnsupportedCase(f"{self.name} has no decode step to time")

    def prepare_decode_run(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        x,
        *,
        prefill,
        step=1,
        mask=None,
        positions=None,
        dtype: str = "float64",
        device: str = "cpu",
        strategy: str = STANDARD,
        cache: str | None = None,
        page_size: int | None = None,
        page_seed: int = 0,
    ) -> tuple[PreparedDecode, DecodeInputs]:
        """Validate everything, then convert once for a whole decode run (`run_decode`'s arguments)."""
        inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step, mask=mask, positions=positions)
        dtype, device, cache = self._decode_validate(cfg, params, dtype, device, strategy, cache)
        paging = paging_options(cache, page_size, page_seed)
        return self._prepare_decode_run(cfg, params, inputs, dtype, device, strategy, cache, **paging), inputs

    def run_decode(
        self, cfg: MHAConfig, params: MHAParams, x, *, prefill, step=1, mask=None, positions=None, **options
    ):
        """Prefill ``prefill`` tokens, then feed the rest ``step`` at a time through this backend's own cache.

        ``x``: (B, N, d_model) or (N, d_model); ``mask``: a (B, N) or (N,) padding mask (True: a
        real token); ``positions``: (B, N) or (N,), default ``0 .. N-1`` or ``cumsum(mask) - 1``.
        ``options``: dtype, device, strategy, cache; with ``cache="paged"`` also ``page_size`` (default
        16, vLLM's) and ``page_seed`` (the shuffled physical order of the pages). Returns every token's output, (B, N, d_model)
        (or (N, d_model)), which equals `core.decode.reference_decode` (the full causal forward).
        """
        prepared, inputs = self.prepare_decode_run(
            cfg, params, x, prefill=prefill, step=step, mask=mask, positions=positions, **options
        )
        return inputs.unbatch(prepared.output())

    def decode_stages(self, prepared: PreparedDecode, cfg: MHAConfig) -> list[dict[str, np.ndarray]] | None:
        """Each chunk's token-wise stages in the canonical layout (batched), or None when none are exposed."""
        if prepared.step_stages is None:
            return None
        names = set(decode_stage_names(cfg))
        return [
            {name: canonical_stage(name, stage) for name, stage in chunk.items() if name in names}
            for chunk in prepared.step_stages()
        ]

    def timed_step_reason(self, cache: str | None, ragged: bool = False) -> str | None:
        """Why `prepare_decode` (the timed step) refuses the cache kind ``cache`` that `run_decode` runs, or a
        ragged batch (``ragged``: rows at different lengths), or None."""
        if cache == PAGED and not self.paged_decode_step:
            return f"{self.name}: the paged cache has no timed step yet (run_decode runs it)"
        if ragged and not self.ragged_decode_step:
            return f"{self.name}: no timed step of a ragged batch (rows at different lengths, left padded) yet"
        return None

    def prepare_decode(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        *,
        context: int,
        batch: int = 1,
        step: int = 1,
        dtype: str = "float32",
        device: str = "cpu",
        strategy: str = STANDARD,
        cache: str | None = None,
        seed: int = 0,
        lengths=None,
    ) -> Prepared:
        """One decode step to time (`bench --mode decode`): ``forward`` feeds ``step`` new tokens to a cache
        holding ``context`` tokens. ``info["cache"]`` says the cache's kind, layout, slots and bytes.

        ``lengths`` (B,): a ragged batch, row ``b`` holding ``lengths[b]`` tokens left padded to ``context``,
        which must be ``max(lengths)`` (`DecodeStep.lengths`); None: every row holds ``context``."""
        for name, value, low in (("context", context, 0), ("batch", batch, 1), ("step", step, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not cfg.causal:
            raise ValueError("decoding needs MHAConfig.causal=True, got causal=False")
        rows = None if lengths is None else check_step_lengths(lengths, batch, context)
        dtype, device, cache = self._decode_validate(cfg, params, dtype, device, strategy, cache)
        reason = self.timed_step_reason(cache, ragged=rows is not None)
        if reason:
            raise UnsupportedCase(reason)
        job = DecodeStep(int(batch), int(context), int(step), dtype, device, strategy, cache, seed, rows)
        return self._prepare_decode_step(cfg, params, job)


def kv_cache_bytes(cfg: MHAConfig, batch: int, slots: int, itemsize: int, kv_heads: int | None = None) -> int:
    """Bytes of K and V together in a cache of ``slots`` slots per sequence: ``B x Hkv x slots x (Dk + Dv) x
    itemsize``; ``kv_heads``: the heads one rank holds (sharded), default ``cfg.n_kv_heads``."""
    heads = cfg.n_kv_heads if kv_heads is None else kv_heads
    return batch * heads * slots * (cfg.d_k + cfg.d_v) * itemsize


def kv_cache_info(kind: str, layout: str, cfg: MHAConfig, batch: int, slots: int, itemsize: int) -> dict:
    """``PreparedDecode.info["cache"]`` of a K and V cache: the kind, the layout in axis symbols, the slots per
    sequence and the bytes of K and V (`kv_cache_bytes`)."""
    return {"kind": kind, "layout": layout, "slots": slots, "bytes": kv_cache_bytes(cfg, batch, slots, itemsize)}


def check_step_lengths(lengths, batch: int, context: int) -> tuple[int, ...]:
    """A timed step's ``lengths``: ``batch`` ints in 0..context, the longest ``context`` (the cache's width)."""
    rows = RaggedBatch(lengths).lengths  # validated: 1-D ints >= 0
    if len(rows) != batch:
        raise ValueError(f"lengths must hold one length per row (batch={batch}), got {len(rows)}: {rows.tolist()}")
    if int(rows.max(initial=0)) != context:
        raise ValueError(
            f"context must be max(lengths) (the cache's width, left padded), got context={context} and lengths "
            f"{rows.tolist()}"
        )
    return tuple(int(length) for length in rows)
