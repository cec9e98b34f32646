"""A paged KV cache in the JAX convention: a static page pool read by a gather inside the one jitted step.

The pool is four device arrays of static shapes, donated to every step (XLA writes the new slots
in place): keys ``(pages, P, Hkv, Dk)`` and values ``(pages, P, Hkv, Dv)`` (tokens before heads,
the layout of the contiguous ``(B, T, Hkv, Dk)`` cache cut into pages of P slots, vLLM's too), and
each slot's position and validity ``(pages, P)``. Which page holds which row's tokens is
`core.page_pool.PagePool`'s, on the host (a seeded shuffled free list; with a window, whole pages
freed once no later query can see them). A step receives the block table of the held pages,
``(B, M)`` int32 padded with `core.paged.PAD` to ``M`` (the most pages a row holds at once over the
run, a static shape: one program for every step), and inside the jitted step, per row:

    pages    = pool[table]                      # (M, P, Hkv, Dk): the gather, in logical order
    keys     = pages.reshape(M * P, Hkv, Dk)    # the row's slots from its first held page on
    keys     = keys.at[new slots].set(k_new)    # the step's own keys at their logical slots
    context  = attention over keys (the contiguous step's `decode_programs.attend_over_cache`)

and after the rows, the step's keys and values are scattered into their pages at
``(page (B, s), offset (s,))`` (vLLM's ``reshape_and_cache``): the pool leaves the step written.
The gather copies the held keys once per step; it is what paging costs over the contiguous cache.
A slot is a key when its page is held (not PAD), it was written (its logical index is below the
tokens written: a page given again still holds a freed row's old slots after the write offset)
and its token was real; causality, the window and the chunks are read on the positions as in the
contiguous step. The prefill is the same program with ``s`` = the prefill's tokens (its keys
attend over the pages they are written to), so a run compiles it for the prefill, the step, and
a last shorter step.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core.decode import decode_stage_names, ring_capacity
from mha_rosetta.core.page_pool import PagePool, pool_pages
from mha_rosetta.core.paged import PAD

from .._paged import PagedCacheBase
from ..base import Prepared, tensor_to_numpy
from .common import shared_program, to_jax
from .decode import JaxDecoder, _block, _stage_tensors
from .decode_programs import TRACES, attend_over_cache, step_rotary_tables
from .layer import _mha_one_item, cached_heads

PAGED_LAYOUT = (
    "a static pool of K (pages, P, Hkv, Dk) and V (pages, P, Hkv, Dv), donated to each step, through a block table "
    "(B, M) in a seeded shuffled physical order; the gather of a row's pages runs inside the one jitted step; "
    "a window frees whole pages"
)
_POOL = ("k_pages", "v_pages", "pos", "valid")  # the pool's arrays, (pages, P, ...) each
_PER_ROW = ("q_pos", "q_valid", "table", "temper")  # the step's arrays with a batch axis (vmapped); the rest are shared


def _paged_attend(q_rotated, k_rotated, v_heads, allowed, head, item, *, cfg, head_mask_axis):
    """`layer._mha_one_item`'s attention step for one row: gather its pages, place the step's tokens, attend.

    ``item``: the pool (shared by the rows), this row's ``table`` (M,), the step's ``q_pos`` and
    ``q_valid`` (s,), ``index`` (tokens written before the step) and ``start`` (the logical index
    of the first held page's first slot). Returns the context (s, H, Dv).
    """
    import jax.numpy as jnp

    table = item["table"]  # (M,): physical pages in logical order, PAD past the held ones
    M, P = table.shape[0], item["pos"].shape[1]
    held = table != PAD
    pages = jnp.where(held, table, 0)  # PAD reads page 0, masked below

    def view(pool):  # (pages, P, ...) -> (M, P, ...) gather -> (M*P, ...): the row's slots in logical order
        return pool[pages].reshape(M * P, *pool.shape[2:])

    s = k_rotated.shape[0]
    logical = item["start"] + jnp.arange(M * P, dtype=item["index"].dtype)  # (M*P,) token index of each slot
    written = jnp.repeat(held, P) & (logical < item["index"]) & view(item["valid"])  # stale slots after the offset
    new = item["index"] - item["start"] + jnp.arange(s, dtype=item["index"].dtype)  # (s,) the step's slots
    keys = view(item["k_pages"]).at[new].set(k_rotated)  # (M*P, Hkv, Dk)
    values = view(item["v_pages"]).at[new].set(v_heads)  # (M*P, Hkv, Dv)
    k_pos = view(item["pos"]).at[new].set(item["q_pos"])  # (M*P,)
    k_valid = written.at[new].set(item["q_valid"])  # (M*P,)
    heads = attend_over_cache(q_rotated, keys, values, k_pos, k_valid, head, item, cfg=cfg)
    return {"context": heads["context"]}


def _paged_step_program(cfg, key: tuple, params, x, tables, extras, pool, scalars, page, offset):
    """One chunk of s tokens through the pool: x (B, s, D); ``scalars``: ``index`` and ``start`` (traced int32);
    ``page`` (B, s) and ``offset`` (s,): where the step's tokens go. Returns (the pool written, the stages)."""
    import jax

    TRACES[key] += 1  # runs only while JAX traces (and so compiles) this program
    one_item = partial(_mha_one_item, cfg=cfg, head_mask_axis=None, attend=_paged_attend)
    item = {**extras, **pool, **scalars}
    item_axes = {name: (0 if name in _PER_ROW else None) for name in item}
    table_axes = None if tables is None else 0
    stages = jax.vmap(one_item, in_axes=(None, 0, 0, 0, None, table_axes, item_axes))(
        params, x, x, x, None, tables, item
    )
    keys, values = cached_heads(cfg, stages)  # what the scores and the weighted sum read
    new = {
        "k_pages": keys,
        "v_pages": values,
        "pos": extras["q_pos"],
        "valid": extras["q_valid"],
    }
    slots = (page, offset[None, :])  # (B, s) and (1, s): each token's page and slot
    pool = {name: pool[name].at[slots].set(new[name]) for name in _POOL}  # (B, s, ...) scattered into the pages
    return pool, {name: stages[name] for name in decode_stage_names(cfg)}


class JaxPagedDecoder(PagedCacheBase, JaxDecoder):
    """`JaxDecoder`'s ``prefill`` and ``step`` over a static page pool of ``n_pages`` pages of ``page_size`` tokens.

    ``live_pages``: the most pages a row holds at once (the block table's static width M).
    """

    axes = "(pages, P, Hkv, Dk)"

    def __init__(
        self, cfg, params, *, batch, page_size, n_pages, live_pages, seed, dtype, device, matmul_precision, span
    ):
        self._setup(cfg, params, batch=batch, dtype=dtype, device=device, matmul_precision=matmul_precision, span=span)
        self.pool = PagePool(batch, page_size, n_pages, seed, cfg.window)
        self.live_pages = live_pages
        P, Hkv = page_size, cfg.n_kv_heads
        self.cache = {
            "k_pages": to_jax(np.zeros((n_pages, P, Hkv, cfg.d_k)), dtype, self.target),  # (pages, P, Hkv, Dk)
            "v_pages": to_jax(np.zeros((n_pages, P, Hkv, cfg.d_v)), dtype, self.target),  # (pages, P, Hkv, Dv)
            "pos": to_jax(np.zeros((n_pages, P), np.int32), None, self.target),  # (pages, P): each slot's position
            "valid": to_jax(np.zeros((n_pages, P), bool), None, self.target),  # (pages, P): False = unwritten / pad
        }
        self.k, self.v = self.cache["k_pages"], self.cache["v_pages"]  # `PagedCacheBase.nbytes` reads them
        self._keys = {"step": ("jax.decode.paged", cfg)}  # closes over cfg only: P and M are shapes
        self._traces_at_start = {kind: TRACES[key] for kind, key in self._keys.items()}
        _, self._step = shared_program(
            self._keys["step"], partial(_paged_step_program, cfg, self._keys["step"]), donate_argnums=(4,)
        )

    def step(self, x, positions, valid, tables):
        """One chunk of s tokens (the prefill too): x (B, s, D) float64, positions and valid (B, s), tables or None."""
        import jax

        index = self.used
        page, offset, given = self.pool.write_slots(x.shape[1], valid)  # (B, s), (s,); the window frees first
        if len(given):  # a page given again (or once pads only) holds none of this row's tokens yet
            self.cache["valid"] = self.cache["valid"].at[to_jax(given.astype(np.int32), None, self.target)].set(False)
        live, start = self.pool.live()  # (B, n) held pages in logical order, the first one's token index
        table = np.full((self.batch, self.live_pages), PAD, dtype=np.int32)  # (B, M): a static shape
        table[:, : live.shape[1]] = live
        x_jax, tables_jax, extras, pool, _ = self.step_args(x, positions, valid, tables)
        extras["table"] = to_jax(table, None, self.target)
        scalars = {
            name: jax.device_put(np.int32(value), self.target) for name, value in (("index", index), ("start", start))
        }
        device = (to_jax(page.astype(np.int32), None, self.target), to_jax(offset.astype(np.int32), None, self.target))
        with jax.default_matmul_precision(self.precision):
            self.cache, stages = self._step(self.weights, x_jax, tables_jax, extras, pool, scalars, *device)
        self.k, self.v = self.cache["k_pages"], self.cache["v_pages"]
        self.used += x.shape[1]
        return stages

    prefill = step  # the prefill's keys attend over the pages they are written to: the same program

    def info(self) -> dict:
        return {**super().info(), "block_table_width": self.live_pages}  # M: the static width of the step's table


def paged_decoders(cfg, params, inputs, *, page_size: int, page_seed: int):
    """A function of `JaxDecoder`'s common keywords that makes a fresh `JaxPagedDecoder` for a run of ``inputs``
    (its pool sized for the run's chunks, `core.page_pool.pool_pages`)."""
    chunks = inputs.chunks()
    sizes = {
        "page_size": page_size,
        "n_pages": pool_pages(inputs.batch, page_size, chunks, cfg.window),
        "live_pages": pool_pages(1, page_size, chunks, cfg.window),  # the most pages one row holds at once
        "seed": page_seed,
    }
    return partial(JaxPagedDecoder, cfg, params, batch=inputs.batch, **sizes)


def prepare_paged_decode_step(cfg, params, job, matmul_precision: str, info: dict):
    """`decode.prepare_decode_step`'s timed step (`bench --mode decode`) through a `JaxPagedDecoder`: the pool
    holds the context (`DecodeStep.paging`: pages of 16, a window frees whole pages as the step is written).

    The cached numbers are the contiguous step's draws (K then V, ``(B, T, Hkv, D)`` with T its slots, then the
    step's x; token t's key is slot t % T's), so every key the step can see is the contiguous step's. Each
    ``forward`` rewinds the pool to the context and runs `JaxPagedDecoder.step`: its host half (the block table,
    the slots, the step's arrays put on the device) is timed with it, as a paged engine does it every step; the
    pool is donated, as in a run. The first call (``compile``) traces and compiles it.
    """
    import jax

    batch, context, step = job.batch, job.context, job.step
    page_size, n_pages, seed = job.paging(cfg.window)
    chunks = [(0, context), (context, context + step)]
    decoder = JaxPagedDecoder(
        cfg, params, batch=batch, page_size=page_size, n_pages=n_pages, seed=seed, dtype=job.dtype,
        device=job.device, matmul_precision=matmul_precision, span=context + step,
        live_pages=pool_pages(1, page_size, chunks, cfg.window),
    )  # fmt: skip
    rng = np.random.default_rng(job.seed)
    ring = ring_capacity(cfg, step)
    Hkv, T = cfg.n_kv_heads, context + step if ring is None else ring  # the contiguous step's slots
    slot_of = np.arange(context) % T  # (context,): token t sits in slot t % T there
    k_new, v_new = (rng.standard_normal((batch, T, Hkv, d))[:, slot_of] for d in (cfg.d_k, cfg.d_v))  # (B, ctx, ..)
    floats = ("k_pages", "v_pages")  # float64 here, cast once by `to_jax` as the contiguous step's cache is
    pool = {name: np.array(a, dtype=np.float64 if name in floats else a.dtype) for name, a in decoder.cache.items()}
    if context:
        cached, held = job.cached()  # (B, context) each: a ragged batch's pads invalid, their pages the null page
        page, offset, _ = decoder.pool.write_slots(context, held)  # (B, context), (context,)
        slots = (page, offset[None, :])
        pool["k_pages"][slots], pool["v_pages"][slots] = k_new, v_new  # (B, context, Hkv, D) into their pages
        pool["pos"][slots], pool["valid"][slots] = cached, held
    decoder.cache = {
        name: to_jax(array, job.dtype if name in floats else None, decoder.target) for name, array in pool.items()
    }  # (pages, P, ...) each
    decoder.k, decoder.v = decoder.cache["k_pages"], decoder.cache["v_pages"]
    decoder.used = context
    x = rng.standard_normal((batch, step, cfg.d_model))  # (B, s, D)
    positions, every = job.positions(), np.ones((batch, step), dtype=bool)
    tables = step_rotary_tables(cfg, job)  # (B, s, r/2) each, or None

    def run_step() -> dict:
        decoder.pool.rewind(context)  # the same slots on every call, no new page
        decoder.used = context
        return decoder.step(x, positions, every, tables)  # the step's stages, "output" (B, s, D) among them

    def compile_step() -> None:
        jax.block_until_ready(run_step()["output"])
        info["compilations"] = dict(decoder.compilations)

    info.update(context=context, step=step, cache=decoder.info(), compilations={"step": 0})
    info["host_half_timed"] = "the block table, the slots and the step's arrays are made and put on every call"
    return Prepared(
        lambda: run_step()["output"],
        tensor_to_numpy,
        lambda: _stage_tensors(cfg, run_step(), f"one paged step at context {context}"),
        _block,
        compile=compile_step,
        info=info,
    )
