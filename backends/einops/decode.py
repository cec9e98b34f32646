"""KV-cache decoding with named axes: the cache is the pipeline's own keys, ``"b s g k"``, one slot per token.

The einops pipeline keeps tokens before heads (``k`` is ``"b n g k"``, ``"b n h k"`` without GQA),
so its cache is that layout with the slots for ``n``: keys ``(B, T, Hkv, Dk)`` named ``"b s g k"``
and values ``"b s g v"``, exactly the second operand of the scores einsum
(``"b q g r k, b s g k -> b g q r s"``) and of the context einsum. A step is the pipeline cut in
two (`layer.project_heads`, then `layer.attend`) with the cache between them::

    q, k, v  = project_heads(x[:, step])      # "b n d, g k d -> b n g k": the step's tokens, QK-normed, rotated
    cache    = cache with k written at its slots   # along "s"; no axis moves
    scores   = einsum("b q g r k, b s g k -> b g q r s", q, cache)   # one row per new query, all slots
    ...      = attend's score steps (`frameworks.ops.score_steps`), context, merge, output

The rules are those of `core.decode`: keys cached after QK-norm and rotary and before the GQA
repeat (``g`` kv heads in the cache; the scores einsum shares them across ``r``); causality and
the window on positions (`core.decode.decode_allowed`, laid out like the scores by the plan's mask
pattern, `layer.grouped_allowed`); a window is a ring of ``ring_capacity(cfg, step)`` slots (token
t in slot ``t % slots``); ALiBi and T5's buckets from the slots' positions (`layer.score_tables`).

One cache kind, ``"static"``: allocated once (``cache_capacity`` slots for a run) with a write
index, writing past it is `core.decode.CacheFull`. A write is the library's own (`put`): an in-place
slice assignment on NumPy and torch arrays, ``.at[].set`` on JAX's immutable ones. On JAX arrays a
chunk's device half is jitted (the mask and the slots are made on the host, in NumPy, and passed in),
one compilation per chunk length and mask structure, counted in ``info["compilations"]``. The rotary
tables are the run's, once for every position (`numpy.decode` says why).
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, prepare_inputs
from mha_rosetta.core.decode import DecodeInputs, cache_capacity, check_capacity, decode_allowed, ring_capacity
from mha_rosetta.core.page_pool import pool_pages

from .._paged import PAGED
from ..base import DecodeStep, Prepared, PreparedDecode, tensor_to_numpy
from ..jax.common import shared_program
from .layer import (
    attend,
    canonical_weights,
    grouped_allowed,
    project_heads,
    score_tables,
    stage_tensors,
)
from .paged import PAGED_LAYOUT, PagedNamedCache, read_pages, store_pages
from .plans import EinsumPlan, plan_for, position_tables

STATIC = "static"
CACHE_KINDS = (STATIC, PAGED)
CACHE_LAYOUTS = {
    PAGED: PAGED_LAYOUT,
    STATIC: "keys 'b s g k' (B, T, Hkv, Dk) and values 'b s g v' (B, T, Hkv, Dv): the pipeline's own tokens-first "
    "layout with the cache's slots for the tokens, allocated once with a write index; writing past it is CacheFull; "
    "a ring of W - 1 + step slots with a window",
}


def cache_pattern(plan: EinsumPlan) -> str:
    """The cache's named axes: the keys operand of the plan's scores einsum ("b s g k", "b s h k" for MHA)."""
    return plan.scores.split("->")[0].split(",")[1].strip()


def put(ops, cache, slots, new, keep: int):
    """``cache`` ("b s g k") with the last ``keep`` tokens of ``new`` ("b n g k") at ``slots`` (keep,) along "s".

    The library's own write: in place on NumPy and torch arrays, ``.at[].set`` on JAX's immutable ones (inside
    the jitted step, where XLA updates the donated buffer in place or copies it)."""
    new = new[:, new.shape[1] - keep :]  # the tokens kept (all but a prefill longer than a ring)
    if ops.library == "jax":
        return cache.at[:, slots].set(new)
    cache[:, slots] = new
    return cache


class NamedCache:
    """Keys ``(B, T, Hkv, Dk)`` and values ``(B, T, Hkv, Dv)`` as the array library holds them; each slot's
    position and validity ``(B, T)`` in NumPy (they make the mask, which is NumPy until it is converted)."""

    def __init__(self, ops, batch: int, cfg: MHAConfig, capacity: int, ring: int | None) -> None:
        self.ops, self.ring = ops, ring
        slots = ring if ring is not None else capacity
        self.keys = ops.asarray(np.zeros((batch, slots, cfg.n_kv_heads, cfg.d_k)))  # "b s g k"
        self.values = ops.asarray(np.zeros((batch, slots, cfg.n_kv_heads, cfg.d_v)))  # "b s g v"
        self.positions = np.zeros((batch, slots), dtype=np.int64)  # (B, T)
        self.valid = np.zeros((batch, slots), dtype=bool)  # (B, T): nothing written yet
        self.slots, self.written = slots, 0

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together (the positions and validity flags are bookkeeping, not counted)."""
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.keys, self.values))

    def claim(self, positions: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, int]:
        """Book a chunk's n tokens (positions, valid (B, n)): (the slots its kept tokens go to (keep,), keep).

        A ring keeps the last ``min(n, slots)`` (token t in slot ``t % slots``); a static cache all n,
        or `CacheFull` when they do not fit."""
        n = positions.shape[1]
        if self.ring is not None:
            keep = min(n, self.ring)  # a prefill longer than the ring keeps its last slots
            slots = np.arange(self.written + n - keep, self.written + n) % self.ring
        else:
            check_capacity(self.slots, self.written, n)
            keep, slots = n, np.arange(self.written, self.written + n)
        self.positions[:, slots], self.valid[:, slots] = positions[:, n - keep :], valid[:, n - keep :]
        self.written += n
        return slots, keep

    def key_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's position and validity (B, T), in slot order: what the chunk's mask reads."""
        return self.positions, self.valid

    def write(self, keys, values, positions: np.ndarray, valid: np.ndarray) -> None:
        """The chunk's keys "b n g k", values "b n g v", positions and valid (B, n) at the next slots."""
        slots, keep = self.claim(positions, valid)
        self.keys = put(self.ops, self.keys, slots, keys, keep)
        self.values = put(self.ops, self.values, slots, values, keep)

    def info(self, pattern: str) -> dict:
        layout = f"(B, T, Hkv, Dk) '{pattern}'" + (f" ring of {self.ring} slots" if self.ring is not None else "")
        return {"kind": STATIC, "layout": layout, "slots": self.slots, "bytes": self.nbytes}


class EinopsDecoder:
    """The pipeline's weights, tokens and rotary tables for a run's tokens (B, N, D) at ``positions`` (B, N),
    converted once; `chunk` feeds some of them through a `NamedCache`.

    A chunk is a host half (NumPy: which slots, the mask and the score bias from the slots' positions) and
    a device half (`device_step`: project, write, attend), which JAX runs jitted: one compilation per
    chunk length and mask structure (the prefill, the step, a shorter last step), shared across prepares like
    the forward's programs (`jax.common.shared_program`), counted in ``compilations``.
    """

    def __init__(
        self,
        ops,
        cfg: MHAConfig,
        params: MHAParams,
        x: np.ndarray,
        positions: np.ndarray,
        dtype: str,
        matmul_precision: str = "highest",
    ):
        self.ops, self.cfg, self.dtype = ops, cfg, dtype
        self.plan = plan = plan_for(cfg)
        self.weights = {name: ops.asarray(value) for name, value in canonical_weights(cfg, params, plan).items()}
        self.x = ops.asarray(x)  # (B, N, D)
        # every position of the run, once: rotary (1|B, N, 1[, 1], r/2), the temperature (1|B, N, 1[, 1], 1)
        self.tables = position_tables(ops, cfg, prepare_inputs(cfg, x, positions=positions), plan, dtype)
        self.compilations = 0  # of the timed step, traced and compiled while this decoder ran (JAX only)
        self.matmul_precision = None
        if ops.library == "jax":
            from ..jax.common import effective_precision

            self.matmul_precision = effective_precision(matmul_precision)

    def new_cache(self, batch: int, capacity: int, step: int, paging=None) -> NamedCache | PagedNamedCache:
        """A `NamedCache`, or with ``paging`` (page size, pool pages, seed) a `paged.PagedNamedCache`."""
        if paging is not None:
            return PagedNamedCache(self.ops, batch, self.cfg, *paging)
        return NamedCache(self.ops, batch, self.cfg, capacity, ring_capacity(self.cfg, step))

    def chunk(self, cache: NamedCache, tokens: slice, positions, valid, record: dict | None = None):
        """Feed the run's tokens ``tokens`` (positions, valid (B, n)) through ``cache``: their output "b n o"."""
        ops, cfg, plan = self.ops, self.cfg, self.plan
        x = self.x[:, tokens]  # "b n d": the chunk's tokens
        tables = None
        if self.tables is not None:  # the chunk's positions: the temperature's with the cache offset
            tables = {name: tuple(table[:, tokens] for table in group) for name, group in self.tables.items()}
        slots, keep = cache.claim(positions, valid)
        own = cache.ring is not None and positions.shape[1] > cache.ring  # a prefill longer than the ring
        paged = isinstance(cache, PagedNamedCache)
        k_positions, k_valid = (positions, valid) if own else cache.key_slots()
        allowed = decode_allowed(cfg, positions, k_positions, k_valid)  # (B, 1, n, T), NumPy
        blocked, empty_rows = (ops.asarray(m, cast=False) for m in grouped_allowed(cfg, allowed, plan))
        where = SimpleNamespace(positions=positions, kv_positions=k_positions)  # what score_tables reads
        bias = {
            name: ops.asarray(table, cast=False) for name, table in score_tables(cfg, where, plan, self.dtype).items()
        }
        args = (
            self.weights,
            x,
            tables,
            cache.keys,
            cache.values,
            tuple(ops.asarray(a, cast=False) for a in slots) if paged else ops.asarray(slots, cast=False),
            blocked,
            empty_rows,
            bias,
        )
        if self.matmul_precision is None:  # NumPy and torch: in place, as it runs
            output, cache.keys, cache.values = device_step(ops, plan, cfg, *args, keep=keep, own=own, record=record)
            return output
        import jax

        recorded = record is not None
        key = ("einops.jax.decode", cfg, self.dtype, repr(ops.device), keep, own, recorded)
        _, jitted = shared_program(key, partial(_jax_step, ops, plan, cfg, key, keep=keep, own=own, recorded=recorded))
        traced = sum(TRACES.values())
        with jax.default_matmul_precision(self.matmul_precision):
            output, cache.keys, cache.values, stages = jitted(*args)
        if recorded:
            record.update(stages)  # the untimed stage dump: the same step with its stages as outputs
        else:
            self.compilations += sum(TRACES.values()) - traced
        return output


def device_step(
    ops, plan, cfg, weights, x, tables, keys, values, slots, blocked, empty_rows, bias, *, keep, own, record=None
):
    """A chunk's device half: (output "b n o", keys, values). The chunk projected (`layer.project_heads`), its keys
    and values written at ``slots`` (`put`), its queries attending (`layer.attend`) over the cache's slots, or over
    its own keys when ``own`` (a prefill longer than a ring). A paged cache's ``slots`` are ``(page, offset,
    table)``: the pools written there (`paged.store_pages`) and read back through the table (`paged.read_pages`)."""
    _, _, v, _, _, q_rotated, k_rotated = project_heads(ops, plan, weights, x, x, x, tables, cfg=cfg, record=record)
    if isinstance(slots, tuple):
        keys, values = store_pages(ops, keys, slots, k_rotated), store_pages(ops, values, slots, v)
        over = tuple(read_pages(pool, slots[2], cache_pattern(plan)) for pool in (keys, values))
    else:
        keys, values = put(ops, keys, slots, k_rotated, keep), put(ops, values, slots, v, keep)
        over = (k_rotated, v) if own else (keys, values)
    output = attend(ops, plan, weights, q_rotated, *over, blocked, empty_rows, bias, cfg=cfg, record=record, x_gate=x)
    return output, keys, values


# Traces of each shared JAX step program (`_jax_step` counts itself while JAX traces it): how often it compiled.
TRACES: Counter = Counter()


def _jax_step(ops, plan, cfg, key, *args, keep, own, recorded):
    """`device_step` as JAX traces it: its results and, when ``recorded``, its stage tensors (else an empty dict)."""
    if not recorded:
        TRACES[key] += 1  # Python runs here only while JAX traces: once per compilation
    record = {} if recorded else None
    return (*device_step(ops, plan, cfg, *args, keep=keep, own=own, record=record), record or {})


def _numerics(backend, dtype: str, device: str, plan: EinsumPlan) -> dict:
    info = backend._numerics_info(dtype, device)
    info["patterns"] = f"{plan.name}: scores '{plan.scores}', context '{plan.context}'; cache '{cache_pattern(plan)}'"
    if backend.array_library == "jax":
        info["execution"] = "each chunk's device half jitted: one compilation per chunk length and mask structure"
    return info


def _precision_wrapped(backend, device: str, fn):
    if backend.array_library != "torch":
        return fn
    from ..jax.common import allows_tf32
    from ..torch.common import with_matmul_precision

    return with_matmul_precision(fn, device, allows_tf32(backend.matmul_precision))  # TF32 set and restored (GPU)


def prepare_einops_decode_run(
    backend, ops, cfg, params, inputs: DecodeInputs, dtype: str, device: str, page_size=None, page_seed=0
) -> PreparedDecode:
    """A whole decode run through a `NamedCache`, or a `paged.PagedNamedCache` of ``page_size`` tokens a page
    (`Backend._prepare_decode_run`)."""
    decoder = EinopsDecoder(ops, cfg, params, inputs.x, inputs.positions, dtype, backend.matmul_precision)
    positions, valid, chunks = inputs.positions, inputs.valid, inputs.chunks()
    capacity = cache_capacity(cfg, inputs.tokens, inputs.step)
    paging = None
    if page_size is not None:  # the paged kind: (page size, pool pages, seed)
        paging = (page_size, pool_pages(inputs.batch, page_size, chunks, cfg.window), page_seed)

    def run_chunks(records: list | None):
        cache = decoder.new_cache(inputs.batch, capacity, inputs.step, paging)
        outputs = []
        for start, stop in chunks:
            record = None if records is None else {}
            window = slice(start, stop)
            outputs.append(decoder.chunk(cache, window, positions[:, window], valid[:, window], record))
            if records is not None:
                records.append(record)
        return outputs

    def run():
        before = decoder.compilations
        outputs = run_chunks(None)
        if backend.array_library == "jax":
            # This run's compilations, as JAX's adapter counts them (`bench --mode decode` flags a timed run
            # that compiled); the count over every run so far flagged each prefill's first, untimed call.
            info["compilations"] = decoder.compilations - before
        return outputs

    run = _precision_wrapped(backend, device, run)

    def step_stages():
        records: list = []
        _precision_wrapped(backend, device, lambda: run_chunks(records))()
        return [stage_tensors(ops, decoder.plan, record, cfg.rope) for record in records]

    def to_numpy(outputs):
        return np.concatenate([tensor_to_numpy(out) for out in outputs], axis=1)  # (B, N, D)

    info = _numerics(backend, dtype, device, decoder.plan)
    if backend.array_library == "jax":
        info["compilations"] = 0  # none until the first run
    probe = decoder.new_cache(inputs.batch, capacity, inputs.step, paging)
    info["cache"] = probe.info() if paging else probe.info(cache_pattern(decoder.plan))
    return PreparedDecode(
        run, to_numpy, step_stages=step_stages, synchronize=lambda outs: ops.synchronize(outs[-1]), info=info
    )


def prepare_einops_decode_step(backend, ops, cfg, params, job: DecodeStep) -> Prepared:
    """One step of ``step`` tokens on a cache holding ``context`` tokens of random numbers (`bench --mode decode`).

    Every call of ``forward`` writes the same step at the same slots (the write index is set back),
    so each timed call is the same step at the same context; a ring is already full. ``cache="paged"``: a
    `paged.PagedNamedCache` holding the whole context in pages (`DecodeStep.paging`), rewound after each call. A
    ragged batch (``job.lengths``): each row's tokens the last of its slots, its pads invalid (`DecodeStep.cached`).
    """
    batch, context, step, dtype, device = job.batch, job.context, job.step, job.dtype, job.device
    rng = np.random.default_rng(job.seed)
    x = rng.standard_normal((batch, step, cfg.d_model))  # the step's new tokens, "b n d"
    positions = job.positions()  # (B, n)
    decoder = EinopsDecoder(ops, cfg, params, x, positions, dtype, backend.matmul_precision)
    paged = job.cache == PAGED
    cache = decoder.new_cache(batch, context + step, step, job.paging(cfg.window) if paged else None)
    first = 0 if cache.ring is None else max(0, context - cache.ring)
    rewind = cache.rewind if paged else partial(setattr, cache, "written")  # the write index set back
    rewind(first)
    if context > first:
        n = context - first
        fill, held = job.cached(first)  # (B, n) each: a ragged batch's pads invalid
        keys, values = (
            ops.asarray(rng.standard_normal((batch, n, cfg.n_kv_heads, d))) for d in (cfg.d_k, cfg.d_v)
        )  # "b n g k", "b n g v": arbitrary numbers
        if paged:  # the pools written through the block table, as a chunk's device half does (`store_pages`)
            where, _ = cache.claim(fill, held)
            where = tuple(ops.asarray(a, cast=False) for a in where)
            cache.k, cache.v = store_pages(ops, cache.k, where, keys), store_pages(ops, cache.v, where, values)
        else:
            cache.write(keys, values, fill, held)
    every = np.ones((batch, step), dtype=bool)

    def forward(record=None):
        rewind(context)  # the same slots on every call
        return decoder.chunk(cache, slice(0, step), positions, every, record)

    def native_stages():
        record: dict = {}
        _precision_wrapped(backend, device, lambda: forward(record))()
        return stage_tensors(ops, decoder.plan, record, cfg.rope)

    info = {**_numerics(backend, dtype, device, decoder.plan), "context": context, "step": step}
    info["cache"] = cache.info() if paged else cache.info(cache_pattern(decoder.plan))
    timed = _precision_wrapped(backend, device, forward)
    warm = (lambda: ops.synchronize(timed())) if backend.array_library == "jax" else None  # traces and compiles
    return Prepared(timed, tensor_to_numpy, native_stages, ops.synchronize, compile=warm, info=info)
