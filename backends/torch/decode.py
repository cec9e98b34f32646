"""KV-cache decoding in torch: the row-sample layer fed chunk by chunk through Hugging Face's cache layout.

The cache is one layer's K and V as Hugging Face keeps them, ``(B, Hkv, T, Dk)`` and
``(B, Hkv, T, Dv)`` (heads first, the slot axis T third), with each slot's position
``(B, T)`` int64 and whether it holds a real token ``(B, T)`` bool beside them. Design rules
(`core.decode` states the contract; these say how torch keeps it):

* Keys go in after QK-norm and rotary and before the GQA repetition: the cache holds Hkv
  heads. The step's query heads are folded onto their kv head when attending
  (`RowSampleMHA._attend_batched`: (B, H, s, Dk) -> (B*Hkv, G*s, Dk), no ``repeat_kv``),
  so the cache is read, never copied G times.
* Two kinds. ``"dynamic"`` grows with ``torch.cat`` on the slot axis every call, like
  ``DynamicCache``. ``"static"`` is preallocated to its capacity (the run's tokens, or
  ``capacity=``), written by slice assignment at its write index and read whole, its empty
  slots masked as invalid, like ``StaticCache`` (transformers #30400: SDPA attended them);
  a write past its capacity is `core.decode.CacheFull`, never a wrap.
* With a window both are a ring of ``ring_capacity(cfg, step)`` = W - 1 + step slots, token
  t in slot ``t % ring`` (``index_copy_``; the dynamic one grows by ``cat`` until it is
  full). A chunk is written first and then attended, so the ring holds the W - 1 keys
  before the chunk's first query and the chunk itself. A prefill longer than the ring
  attends within itself and keeps its last ``ring`` tokens. Which slots a query sees is
  read on the slots' positions (`core.decode.decode_allowed`, written here in torch), so
  the ring's order never matters (transformers #37574: a full window going wrong).
* Tables that depend only on positions are made once at prepare time from the whole run's
  positions (rotary tables, sliced per chunk: a dynamic rope scaling reads the run's
  length, as the full forward does; ALiBi / T5 from `ScoreBias` on each step's distances).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.decode import DecodeInputs, cache_capacity, check_capacity, ring_capacity
from mha_rosetta.core.page_pool import pool_pages

from .._paged import PAGED
from .._recording import StageRecorder, record_stages
from ..base import DecodeStep, Prepared, PreparedDecode, tensor_to_numpy
from .common import (
    in_inference_mode,
    precision_info,
    synchronizer,
    to_tensor,
    torch_device,
    torch_dtype,
    torch_rotary_tables,
    with_matmul_precision,
)
from .layer import RowSampleMHA
from .paged import PAGED_LAYOUT, TorchPagedCache
from .variants import ScoreBias

DYNAMIC, STATIC = "dynamic", "static"
CACHE_AXES = (
    "(B, Hkv, T, Dk), (B, Hkv, T, Dv)"  # info["cache"]["layout"]: K and V, T the slots (DECODE_LAYOUTS in words)
)
DECODE_CACHES = (DYNAMIC, STATIC, PAGED)
DECODE_LAYOUTS = {
    DYNAMIC: "(B, Hkv, T, Dk) and (B, Hkv, T, Dv) grown with torch.cat on T every call, Hugging Face's DynamicCache "
    "layout; with a window a ring of W - 1 + step slots written with index_copy_ once full",
    STATIC: "(B, Hkv, C, Dk) and (B, Hkv, C, Dv) preallocated to the capacity C, written by slice assignment at a "
    "write index, empty slots masked, Hugging Face's StaticCache layout; with a window a ring of W - 1 + step slots "
    "written with index_copy_",
    PAGED: PAGED_LAYOUT,
}


class TorchKVCache:
    """One layer's cache: ``k`` (B, Hkv, T, Dk), ``v`` (B, Hkv, T, Dv), ``positions`` (B, T) int64, ``valid`` (B, T)."""

    def __init__(self, kind: str, batch: int, cfg: MHAConfig, *, ring: int | None, capacity: int, like) -> None:
        self.kind, self.ring, self.capacity = kind, ring, capacity
        Hkv, Dk, Dv = cfg.n_kv_heads, cfg.d_k, cfg.d_v
        slots = capacity if kind == STATIC else 0
        self.k = like.new_zeros((batch, Hkv, slots, Dk))  # (B, Hkv, T, Dk)
        self.v = like.new_zeros((batch, Hkv, slots, Dv))  # (B, Hkv, T, Dv)
        self.positions = like.new_zeros((batch, slots), dtype=self._torch.int64)  # (B, T)
        self.valid = like.new_zeros((batch, slots), dtype=self._torch.bool)  # (B, T): False = never written
        self.used = 0  # slots written (a static cache's write index without a window)

    @property
    def _torch(self):
        import torch

        return torch

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """K and V together."""
        return self.k.nbytes + self.v.nbytes

    def state(self) -> tuple:
        """What a write changes, by reference (``restore`` puts it back; the bench repeats one step)."""
        return self.k, self.v, self.positions, self.valid, self.used

    def restore(self, state: tuple) -> None:
        self.k, self.v, self.positions, self.valid, self.used = state

    def _cat(self, *new) -> None:
        cat = self._torch.cat
        self.k, self.v = cat((self.k, new[0]), dim=2), cat((self.v, new[1]), dim=2)  # (B, Hkv, T + s, d), new memory
        self.positions, self.valid = cat((self.positions, new[2]), dim=1), cat((self.valid, new[3]), dim=1)

    def write(self, k_new, v_new, positions, valid, token: int) -> tuple:
        """Store the chunk of tokens ``token ..`` (k_new (B, Hkv, s, Dk), v_new (B, Hkv, s, Dv), positions and
        valid (B, s)) and return what its queries attend over: ``(k, v, positions, valid)`` (the cache itself,
        or, for a prefill longer than the ring, the chunk)."""
        s, ring = k_new.shape[2], self.ring
        chunk = (k_new, v_new, positions, valid)
        if ring is None:
            if self.kind == STATIC:
                check_capacity(self.capacity, self.used, s)
                for store, new in zip((self.k, self.v), chunk[:2], strict=True):
                    store[:, :, self.used : self.used + s] = new  # slice assignment into (B, Hkv, C, d)
                self.positions[:, self.used : self.used + s] = positions
                self.valid[:, self.used : self.used + s] = valid
            else:
                self._cat(*chunk)
            self.used += s
            return self.k, self.v, self.positions, self.valid
        if s > ring:  # a prefill longer than the ring: attend within it, keep its last `ring` tokens
            kept = tuple(t[:, :, s - ring :] for t in chunk[:2]) + tuple(t[:, s - ring :] for t in chunk[2:])
            self._write_ring(kept, token + s - ring)
            return chunk
        self._write_ring(chunk, token)
        return self.k, self.v, self.positions, self.valid

    def _write_ring(self, chunk: tuple, token: int) -> None:
        torch, ring, s = self._torch, self.ring, chunk[0].shape[2]
        if self.kind == DYNAMIC and token == self.slots and self.slots + s <= ring:
            self._cat(*chunk)  # still growing: token t lands in slot t
        else:
            if self.kind == DYNAMIC and self.slots < ring:  # it reaches its full size; empty slots stay invalid
                # (a static ring is allocated whole: min(ring, the run's tokens) slots, every t % ring < that)
                grow = ring - self.slots
                self._cat(
                    *(t.new_zeros((*t.shape[:2], grow, *t.shape[3:])) for t in chunk[:2]),
                    *(t.new_zeros((t.shape[0], grow)) for t in chunk[2:]),
                )
            slots = torch.arange(token, token + s, device=self.k.device) % ring  # (s,): token t -> slot t % ring
            self.k.index_copy_(2, slots, chunk[0])
            self.v.index_copy_(2, slots, chunk[1])
            self.positions.index_copy_(1, slots, chunk[2])
            self.valid.index_copy_(1, slots, chunk[3])
        self.used = min(ring, self.used + s)


class DecodeRowSampleMHA(RowSampleMHA):
    """`RowSampleMHA` fed one chunk of tokens at a time through a `TorchKVCache`.

    The chunk's q, k, v, heads, QK-norm and rotary are the forward's own code
    (`_split_and_rotate`), the attention its `_attend_batched` and `_mask_and_softmax` over
    the cache's slots, the merge and output projection its `_merge` and `_finish`: only the
    mask (from the slots' positions) and the score bias's distances are the step's own.
    """

    def __init__(self, cfg: MHAConfig, params: MHAParams, x, positions, valid, dtype: str, device: str) -> None:
        """``x`` (B, N, D) float64, ``positions`` (B, N) int64, ``valid`` (B, N) bool: the tokens this layer feeds."""
        import torch

        self._convert_params(cfg, params, dtype, device, None, None)
        self.scores_buffer = self.weights_buffer = None  # each step's scores have their own shape
        place = torch_device(device)
        self.x_all = to_tensor(x, dtype, device)  # (B, N, D)
        self.positions_all = torch.from_numpy(np.array(positions, dtype=np.int64)).to(place)  # (B, N), a copy
        self.valid_all = torch.from_numpy(np.array(valid, dtype=bool)).to(place)  # (B, N), a copy
        self.score_bias = None
        self.bias_tables = None
        self.tables = None
        self.factors = self.factor_table = None  # Llama 4's temperature: the step's factors, the run's table

    def set_position_tables(self, positions: np.ndarray, kv_positions: np.ndarray, dtype: str, device: str) -> None:
        """Rotary tables of ``positions`` (1|B, N) and the score bias over every distance ``kv_positions - positions``
        can take (the cache's slots hold some of ``kv_positions``)."""
        cfg = self.cfg
        positions, kv_positions = np.array(positions, dtype=np.int64), np.array(kv_positions, dtype=np.int64)  # copies
        span = SimpleNamespace(positions=positions, kv_positions=kv_positions)
        self.tables = torch_rotary_tables(
            cfg, SimpleNamespace(positions=positions, kv_positions=positions), dtype, device
        )
        self.factor_table = self._factor_table(positions, dtype, device)  # (1|B, N): each position's own factor
        if cfg.has_score_bias:
            lowest, highest = int(kv_positions.min() - positions.max()), int(kv_positions.max() - positions.min())
            self.bias_tables = (ScoreBias(cfg, span, dtype, device), lowest, highest)

    def step(
        self, cache: TorchKVCache | TorchPagedCache, start: int, stop: int, rec: StageRecorder | None = None, token=None
    ):
        """Tokens ``start:stop`` of ``x``: written to ``cache`` (as tokens ``token ..``, default ``start``) and
        attended over it; returns their output (B, s, D)."""
        cfg = self.cfg
        B, H, Hkv, Dk, Dv = self.x_all.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
        G, s = H // Hkv, stop - start
        self.x_q = self.x_k = self.x_v = self.x_all[:, start:stop]  # (B, s, D), a view
        self.sizes = (B, s, s, H, Hkv, G, Dk, Dv)
        if self.tables is not None:
            self.rotary = {w: tuple(t[:, start:stop] for t in self.tables[w]) for w in "qk"}  # (1|B, s, r/2) views
        else:
            self.rotary = None
        if self.factor_table is not None:  # the temperature at the step's positions: the cache offset included
            self.factors = self.factor_table[:, start:stop]  # (1|B, s), a view
        q_rotated, k_rotated, v_heads = self._split_and_rotate(rec)  # (B, H, s, Dk), (B, Hkv, s, Dk), (B, Hkv, s, Dv)
        q_pos, q_valid = self.positions_all[:, start:stop], self.valid_all[:, start:stop]  # (B, s)
        k, v, k_pos, k_valid = cache.write(k_rotated, v_heads, q_pos, q_valid, start if token is None else token)
        # The causal rule, the window and the chunks on positions (core.decode.decode_allowed), in torch: (B, 1, s, T).
        kp, qp = k_pos[:, None, None, :], q_pos[:, None, :, None]
        allowed = (kp <= qp) & k_valid[:, None, None, :]
        if cfg.window is not None:
            allowed &= kp > qp - cfg.window
        if cfg.attention_chunk_size is not None:  # Llama 4's chunks on the positions, the cache offset included
            allowed &= kp // cfg.attention_chunk_size == qp // cfg.attention_chunk_size  # int64 floor division
        self.blocked = ~allowed
        self.empty_rows = ~allowed.any(dim=-1, keepdim=True)  # (B, 1, s, 1): a left pad's query sees no key
        if self.bias_tables is not None:
            bias, lowest, highest = self.bias_tables
            distance = (k_pos[:, None, :] - q_pos[:, :, None]).clamp(lowest, highest)  # (B, s, T); empty slots masked

            def score_bias(rel_table, head=None):
                return bias.of_distance(rel_table, distance, head)

            self.score_bias = score_bias
        self.sizes = (B, s, k.shape[2], H, Hkv, G, Dk, Dv)
        context = self._attend_batched(q_rotated, k, v, rec)  # (B, H, s, Dv)
        return self._finish(self._merge(context, rec), rec)  # (B, s, D)


def _cache_info(kind: str, cfg: MHAConfig, batch: int, slots: int, itemsize: int) -> dict:
    """``info["cache"]``: the kind, its layout's axes, the slots per sequence and the bytes of K and V."""
    return {
        "kind": kind,
        "layout": CACHE_AXES,
        "slots": slots,
        "bytes": batch * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * itemsize,
    }


def prepare_torch_decode_run(
    cfg: MHAConfig,
    params: MHAParams,
    inputs: DecodeInputs,
    dtype: str,
    device: str,
    cache: str,
    allow_tf32: bool = False,
    capacity: int | None = None,
    page_size: int | None = None,
    page_seed: int = 0,
) -> PreparedDecode:
    """A whole decode run through a fresh `TorchKVCache` per run (a `TorchPagedCache` of ``page_size`` tokens a
    page for ``cache="paged"``). ``capacity`` (a static cache without a window only): its slots, default the run's
    tokens; fewer than the run needs is `CacheFull` at the step that overflows."""
    ring = ring_capacity(cfg, inputs.step)
    if capacity is not None:
        if cache != STATIC or ring is not None:
            raise ValueError(
                "capacity applies to a static cache without a window (a window's ring has ring_capacity(cfg, step) "
                f"slots), got capacity={capacity!r} with cache={cache!r}, window={cfg.window!r}"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (a static cache's slots), got {capacity!r}")
    slots = cache_capacity(cfg, inputs.tokens, inputs.step) if capacity is None else int(capacity)
    layer = DecodeRowSampleMHA(cfg, params, inputs.x, inputs.positions, inputs.valid, dtype, device)
    layer.set_position_tables(inputs.positions, inputs.positions, dtype, device)
    chunks = inputs.chunks()
    info = {
        "cache": _cache_info(cache, cfg, inputs.batch, slots, layer.w_q.element_size()),
        "chunks": len(chunks),
        "gqa": "query heads of a group folded onto their kv head when attending (no repeat_kv): Hkv heads cached",
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }

    def new_cache() -> TorchKVCache | TorchPagedCache:
        if cache == PAGED:
            n_pages = pool_pages(inputs.batch, page_size, chunks, cfg.window)
            return TorchPagedCache(
                inputs.batch, cfg, page_size=page_size, n_pages=n_pages, seed=page_seed, like=layer.w_q
            )
        return TorchKVCache(cache, inputs.batch, cfg, ring=ring, capacity=slots, like=layer.w_q)

    if cache == PAGED:
        info["cache"] = new_cache().info()

    def measured(kv: TorchKVCache | TorchPagedCache) -> None:
        info["cache"].update(slots=kv.slots, bytes=kv.nbytes)  # the cache the last run left, as it is

    def run_all(recorders=None):
        kv, outputs = new_cache(), []
        for i, (start, stop) in enumerate(chunks):
            outputs.append(layer.step(kv, start, stop, None if recorders is None else recorders[i]))
        measured(kv)
        return outputs

    run_all = in_inference_mode(with_matmul_precision(run_all, device, allow_tf32))

    def to_numpy(outputs) -> np.ndarray:
        return tensor_to_numpy(layer.torch.cat(outputs, dim=1))  # (B, N, D) in token order

    def step_stages():
        recorders = [StageRecorder() for _ in chunks]
        run_all(recorders)
        return [recorder.stages() for recorder in recorders]

    return PreparedDecode(run_all, to_numpy, step_stages, synchronize=synchronizer(device), info=info)


def random_cache(rng: np.random.Generator, cfg: MHAConfig, batch: int, tokens: int, dtype: str, device: str):
    """The benchmark's cached K (B, Hkv, tokens, Dk) and V (B, Hkv, tokens, Dv): arbitrary numbers, drawn in that
    order (after the step's x), so that two implementations given one seed hold the same cache."""
    shape = (batch, cfg.n_kv_heads, tokens)
    scale = 1.0 / np.sqrt(cfg.d_k)  # keys of about the size that rotated, normed ones have
    k = to_tensor(rng.standard_normal((*shape, cfg.d_k)) * scale, dtype, device)  # (B, Hkv, tokens, Dk)
    v = to_tensor(rng.standard_normal((*shape, cfg.d_v)), dtype, device)  # (B, Hkv, tokens, Dv)
    return k, v


def prepare_torch_decode_step(cfg: MHAConfig, params: MHAParams, job: DecodeStep, allow_tf32: bool = False) -> Prepared:
    """One timed decode step (`bench --mode decode`): ``step`` new tokens at positions ``context ..`` onto a
    cache already holding ``context`` tokens of random K and V (a window's ring full with the last ones).

    ``forward`` writes the step into the cache, attends and projects, then puts the cache's state back
    (by reference: the dynamic cache's ``torch.cat`` result is dropped, the static and ring writes land in
    the same slots every call), so every call times the same step. A static cache without a window is
    preallocated to ``context + step`` slots. ``cache="paged"``: a `TorchPagedCache` holding the whole context
    in pages (`DecodeStep.paging`; a window frees whole pages as the step is written), rewound after each call.
    A ragged batch (``job.lengths``): each row's tokens the last of its slots, its pads invalid at position -1
    (`DecodeStep.cached`), its step at its own position (rotary tables per row).
    """
    import torch

    batch, context, step, dtype, device = job.batch, job.context, job.step, job.dtype, job.device
    rng = np.random.default_rng(job.seed)
    ring = ring_capacity(cfg, step)
    total = context + step
    x = rng.standard_normal((batch, step, cfg.d_model))  # (B, step, D)
    new_positions = job.positions()  # (B, step)
    layer = DecodeRowSampleMHA(cfg, params, x, new_positions, np.ones((batch, step), dtype=bool), dtype, device)
    paged = job.cache == PAGED
    # The tokens the cache keeps before the step (a paged cache is written from token 0: its pool frees the pages).
    held = context if ring is None or paged else min(context, ring)
    old_positions, old_valid = job.cached(context - held)  # (B, held) each: a ragged batch's pads invalid at -1
    kv_positions = np.unique(np.concatenate([old_positions.ravel(), new_positions.ravel()]))[None]  # (1, distinct)
    # The rows' step positions: one row of tables when they share them (a rectangular batch), else one per row.
    rows = new_positions[:1] if job.lengths is None else new_positions
    layer.set_position_tables(np.ascontiguousarray(rows), kv_positions, dtype, device)
    slots = cache_capacity(cfg, total, step)
    if paged:
        page_size, n_pages, seed = job.paging(cfg.window)
        kv = TorchPagedCache(batch, cfg, page_size=page_size, n_pages=n_pages, seed=seed, like=layer.w_q)
    else:
        kv = TorchKVCache(job.cache, batch, cfg, ring=ring, capacity=slots, like=layer.w_q)
    if held:
        k_old, v_old = random_cache(rng, cfg, batch, held, dtype, device)
        old, valid = (torch.from_numpy(array).to(k_old.device) for array in (old_positions, old_valid))
        kv.write(k_old, v_old, old, valid, context - held)
    saved = kv.state()

    def run(rec: StageRecorder | None):
        try:
            return layer.step(kv, 0, step, rec, token=context)
        finally:
            kv.restore(saved)

    run = in_inference_mode(with_matmul_precision(run, device, allow_tf32))
    info = {
        # After the step.
        "cache": kv.info() if paged else _cache_info(job.cache, cfg, batch, slots, layer.w_q.element_size()),
        "context": context,
        "step": step,
        "torch_dtype": str(torch_dtype(dtype)).removeprefix("torch."),
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return Prepared(
        lambda: run(None), tensor_to_numpy, lambda: record_stages(run), synchronize=synchronizer(device), info=info
    )
