"""KV-cache decoding in the JAX convention: a static ``(B, T, Hkv, Dk)`` cache, one jitted step.

The cache is preallocated for ``T`` slots, tokens before heads (Flax's and JAX's layout:
``flax.linen`` keeps ``cached_key`` as ``(B, T, H, Dk)`` too), with two bookkeeping arrays
beside the keys and values: ``k_pos (B, T)``, the position each slot holds, and
``k_valid (B, T)``, whether it holds a real token (never written, or a pad: False). XLA wants
static shapes, so nothing in it grows: a step writes its ``s`` new keys and values with
``lax.dynamic_update_slice`` at a write index that is a traced argument, then attends over
all ``T`` slots with the mask of `core.decode.decode_allowed` computed in jnp from ``k_pos``,
``k_valid`` and the step's query positions. The step's shapes are the same at every step, so
``jax.jit`` traces and compiles it once per (cfg, step size, dtype, capacity): a run compiles
the prefill once and the step once, plus once more for a last, shorter step when ``step`` does
not divide the tokens after the prefill. `JaxDecoder.compilations` counts the traces (a counter
incremented inside the traced Python function, which runs only when JAX compiles), and
``PreparedDecode.info["compilations"]`` reports them.

The pipeline of a step is the adapter's own (`layer._mha_one_item`, vmapped over the batch):
projections, head split, QK-norm, rotary, with the cache's write and read in place of its
attention step (`_decode_attend` is its ``attend``), which calls `layer._attend_all_heads` on
the whole cache, so GQA is the same double vmap over ``Hkv`` heads of the cache: keys are cached
after QK-norm and rotary and before any repeat. The variants ride along as in the forward: the
rotary tables come from the whole sequence's positions (`core.rotary_tables`, so a scaling that
reads the sequence length gives the full forward's frequencies), ALiBi's distances are
``k_pos - q_pos`` in jnp, and T5's buckets are looked up in a NumPy table of
`core.variants.t5_buckets` indexed by that distance (computed at prepare time, like every table).

A window makes the cache a ring buffer of `core.decode.ring_capacity` ``= W - 1 + step`` slots:
token ``t`` lives in slot ``t % T``. One token per step is one ``dynamic_update_slice`` at
``index % T``; a step of several tokens can straddle the end of the ring (slots ``T - 1, 0``),
which one dynamic slice cannot write (it would clamp its start and overwrite the wrong slots),
so it is a scatter on the wrapped slots (``.at[slots].set``). The prefill is one jitted forward
over its tokens (attending within the prefill, whatever its length) that then writes its last
``min(P, T)`` tokens into their slots. Without a window, writing past ``T`` is
`core.decode.CacheFull`, checked in Python before the step is called: inside the step,
``dynamic_update_slice`` would clamp the index and silently overwrite the last slots.

The two programs are shared within a process (`common.shared_program`), keyed by what they
close over (the config and the cache's slots); JAX's own cache then tells shapes and dtypes
apart. `TRACES` counts every trace of each program key, and a decoder reports the traces made
since it was built (`JaxDecoder.compilations`): a run that finds its programs compiled reports 0.
During a run the cache is donated to each step (``donate_argnums``): XLA writes the new slots in
place instead of copying the cache. The benchmark's step (`prepare_decode_step`) repeats one
step on one cache, so it cannot donate: each call copies the cache once (said in its info).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, numpy_dtype, prepare_inputs
from mha_rosetta.core.decode import DecodeInputs, cache_capacity, check_capacity, ring_capacity
from mha_rosetta.core.variants import norm_step

from .._layouts import XLA_LAYOUT
from ..base import DecodeStep, Prepared, PreparedDecode, StageTensor, tensor_to_numpy
from ..frameworks.score_parts import distance_slopes
from ..stage_cuts import jax_cuts, path_groups
from .common import (
    effective_precision,
    jax_params,
    jax_target,
    score_bias_inputs,
    shared_program,
    temperature_table,
    to_jax,
    tokens_first_axes,
    variant_provenance,
)
from .decode_programs import (
    TRACES,
    _bucket_table,
    _prefill_program,
    _step_program,
    full_rotary_tables,
    step_rotary_tables,
)
from .layer import STAGE_NOTES, mask_for_vmap

STATIC = "static"
CACHE_LAYOUT = "(B, T, Hkv, Dk)"
DECODE_LAYOUTS = {
    STATIC: (
        f"{CACHE_LAYOUT} preallocated, tokens before heads (Flax's and JAX's layout), written with "
        "lax.dynamic_update_slice at a traced index inside one jitted step; with a window a ring buffer of "
        "W - 1 + step slots"
    )
}


class JaxDecoder:
    """A static ``(B, T, Hkv, Dk)`` KV cache and the two jitted programs that fill it: the prefill and the step.

    ``capacity`` slots per sequence; ``ring`` (a window): slot ``t % capacity``, else `CacheFull`
    past it. `prefill` once, then `step` any number of times; each returns the chunk's token-wise
    stages (`core.decode.decode_stage_names`, tokens first), ``output`` among them. The cache is
    `cache` (JAX arrays), `used` the tokens written so far. `compilations`: each program's traces
    (which is what JAX compiles) since this decoder was built.
    """

    def __init__(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        *,
        batch: int,
        capacity: int,
        dtype: str,
        device: str,
        matmul_precision: str,
        span: int,
    ) -> None:
        self._setup(cfg, params, batch=batch, dtype=dtype, device=device, matmul_precision=matmul_precision, span=span)
        self.capacity, self.ring = capacity, cfg.window is not None
        T, Hkv = capacity, cfg.n_kv_heads
        storage = numpy_dtype(dtype)
        self.cache = {
            "k_cache": to_jax(np.zeros((batch, T, Hkv, cfg.d_k)), dtype, self.target),  # (B, T, Hkv, Dk)
            "v_cache": to_jax(np.zeros((batch, T, Hkv, cfg.d_v)), dtype, self.target),  # (B, T, Hkv, Dv)
            "k_pos": to_jax(np.zeros((batch, T), np.int32), None, self.target),  # (B, T): each slot's position
            "k_valid": to_jax(np.zeros((batch, T), bool), None, self.target),  # (B, T): False = never written / pad
        }
        self.bytes = batch * T * Hkv * (cfg.d_k + cfg.d_v) * np.dtype(storage).itemsize
        # What the programs close over: the config and the slots (the ring and the stage names follow from cfg).
        self._keys = {"prefill": ("jax.decode.prefill", cfg, capacity), "step": ("jax.decode.step", cfg, capacity)}
        self._traces_at_start = {kind: TRACES[key] for kind, key in self._keys.items()}
        # The cache is donated: each step writes its slots in place (the old cache is dead after it).
        key = self._keys["prefill"]
        _, self._prefill = shared_program(
            key, partial(_prefill_program, cfg, capacity, key), static_argnums=(0,), donate_argnums=(5,)
        )
        key = self._keys["step"]
        self.step_program, self._step = shared_program(
            key, partial(_step_program, cfg, capacity, key), donate_argnums=(4,)
        )

    def _setup(self, cfg, params, *, batch, dtype, device, matmul_precision, span) -> None:
        """What every JAX decoder holds besides its cache: the weights on the device, the precision, the tables."""
        self.cfg, self.dtype, self.batch = cfg, dtype, batch
        self.target = jax_target(dtype, device)
        self.weights = jax_params(params, dtype, self.target)
        self.precision = effective_precision(matmul_precision)
        self.used = 0
        self.float_dtype = np.float64 if dtype == "float64" else np.float32  # the score bias's tables
        self.bucket_of = None if cfg.rel_buckets is None else to_jax(_bucket_table(cfg, span), None, self.target)

    @property
    def compilations(self) -> dict[str, int]:
        """The traces (so the compilations) of the prefill and step programs since this decoder was built."""
        return {kind: TRACES[key] - self._traces_at_start[kind] for kind, key in self._keys.items()}

    # -- driving them ---------------------------------------------------------------------------
    def _tables(self, tables):
        if tables is None:
            return None
        cos, sin = (to_jax(table, self.dtype, self.target) for table in tables)  # (B, s, r/2) each
        return (cos, sin, cos, sin)  # self-attention: the keys are the queries' tokens

    def _slopes(self) -> dict:
        slopes = distance_slopes(self.cfg)  # ALiBi's m_h, or None
        return {} if slopes is None else {"slopes": to_jax(slopes.astype(self.float_dtype), None, self.target)}

    def prefill(self, x, positions, valid, tables):
        """The first chunk: x (B, P, D) float64, positions (B, P), valid (B, P), tables (B, P, r/2) or None."""
        import jax

        if self.used:
            raise ValueError(f"prefill must come first: this cache already holds {self.used} tokens")
        if not self.ring:
            check_capacity(self.capacity, 0, x.shape[1])
        mask = None if valid.all() else valid[:, None, None, :]  # (B, 1, 1, P): pads are never keys
        inputs = prepare_inputs(self.cfg, x, mask=mask, positions=positions)
        allowed, batch_axis, head_axis = mask_for_vmap(self.cfg, inputs)
        score_tables, score_axes = score_bias_inputs(self.cfg, inputs, self.dtype)
        axes = (batch_axis, head_axis, tuple(sorted(score_axes.items())))
        args = (
            self.weights,
            to_jax(x, self.dtype, self.target),
            to_jax(allowed, None, self.target),
            self._tables(tables),
            self.cache,
            {name: to_jax(value, None, self.target) for name, value in score_tables.items()},
            to_jax(positions.astype(np.int32), None, self.target),
            to_jax(valid, None, self.target),
        )
        with jax.default_matmul_precision(self.precision):
            self.cache, stages = self._prefill(axes, *args)
        self.used = x.shape[1]
        return stages

    def step_args(self, x, positions, valid, tables) -> tuple:
        """The step's device arguments after ``params``: x (B, s, D), tables, the per-item extras, the cache, index."""
        extras = {
            "q_pos": to_jax(positions.astype(np.int32), None, self.target),  # (B, s)
            "q_valid": to_jax(np.ascontiguousarray(valid), None, self.target),  # (B, s)
            **self._slopes(),
            # Llama 4's temperature at the step's positions, the cache offset included (B, s)
            **{
                name: to_jax(t, None, self.target)
                for name, t in temperature_table(self.cfg, positions, self.dtype).items()
            },
        }
        if self.bucket_of is not None:
            extras["bucket_of"] = self.bucket_of
        import jax

        index = jax.device_put(np.int32(self.used), self.target)  # a traced scalar: one program for every step
        return to_jax(x, self.dtype, self.target), self._tables(tables), extras, self.cache, index

    def step(self, x, positions, valid, tables):
        """One later chunk of s tokens: x (B, s, D) float64, positions (B, s), valid (B, s), tables or None."""
        import jax

        if not self.ring:
            check_capacity(self.capacity, self.used, x.shape[1])  # before the step: inside it would clamp
        with jax.default_matmul_precision(self.precision):
            self.cache, stages = self._step(self.weights, *self.step_args(x, positions, valid, tables))
        self.used += x.shape[1]
        return stages


def cache_info(decoder: JaxDecoder) -> dict:
    """``PreparedDecode.info["cache"]``: the kind, layout, slots per sequence and bytes of K and V."""
    return {"kind": STATIC, "layout": CACHE_LAYOUT, "slots": decoder.capacity, "bytes": decoder.bytes}


def _stage_tensors(cfg: MHAConfig, stages: dict, chunk: str) -> dict[str, StageTensor]:
    axes = tokens_first_axes(cfg)
    notes = {**STAGE_NOTES, "k_rotated": f"the new keys as written to the cache, {CACHE_LAYOUT}; {XLA_LAYOUT}"}
    return {
        name: StageTensor(value, axes[name], f"{chunk}: {notes.get(name, XLA_LAYOUT)}", *variant_provenance(name, cfg))
        for name, value in stages.items()
    }


def prepare_decode_run(
    cfg: MHAConfig,
    params: MHAParams,
    inputs: DecodeInputs,
    dtype: str,
    device: str,
    matmul_precision: str,
    info: dict,
    paged=None,
) -> PreparedDecode:
    """`Backend._prepare_decode_run` of the JAX adapter: a fresh `JaxDecoder` per run (its programs and counts).

    ``paged``: for the paged cache, a function of the decoder's common keywords that makes a
    `paged.JaxPagedDecoder` (`paged.paged_decoders`)."""
    import jax.numpy as jnp

    positions, valid = inputs.positions, inputs.valid  # (B, N) each
    tables = full_rotary_tables(cfg, positions)
    span = int(positions.max() - positions.min())
    capacity = cache_capacity(cfg, inputs.tokens, inputs.step)
    chunks = inputs.chunks()
    state: dict = {}

    common = {"dtype": dtype, "device": device, "matmul_precision": matmul_precision, "span": span}

    def new_decoder() -> JaxDecoder:
        if paged is not None:
            return paged(**common)
        return JaxDecoder(cfg, params, batch=inputs.batch, capacity=capacity, **common)

    def chunk_stages() -> list[dict]:
        decoder = state["decoder"] = new_decoder()
        out = []
        for start, stop in chunks:
            part = (
                inputs.x[:, start:stop],
                positions[:, start:stop],
                valid[:, start:stop],
                None if tables is None else tuple(table[:, start:stop] for table in tables),
            )
            out.append(decoder.prefill(*part) if start == 0 else decoder.step(*part))
        info["compilations"] = dict(decoder.compilations)
        return out

    def run():
        return jnp.concatenate([chunk["output"] for chunk in chunk_stages()], axis=1)  # (B, N, D)

    def step_stages() -> list[dict[str, StageTensor]]:
        return [
            _stage_tensors(cfg, chunk, f"tokens {start}..{stop - 1}")
            for chunk, (start, stop) in zip(chunk_stages(), chunks, strict=True)
        ]

    probe = new_decoder()
    info["cache"] = cache_info(probe) if paged is None else probe.info()
    info["ring_buffer"] = paged is None and ring_capacity(cfg, inputs.step) is not None
    info["compilations"] = dict.fromkeys(probe.compilations, 0)  # filled by each run: its programs' traces
    return PreparedDecode(run, tensor_to_numpy, step_stages, _block, info=info)


# The step returns no scores or weights (token-wise stages only): they are timed in one row with the context.
NO_SCORES_ROW = "scores, softmax, context (one row: the step returns no scores)"


def _block(result) -> None:
    import jax

    jax.block_until_ready(result)


def prepare_decode_step(
    cfg: MHAConfig, params: MHAParams, job: DecodeStep, matmul_precision: str, info: dict
) -> Prepared:
    """One jitted step of ``step`` tokens on a cache holding ``context`` tokens of random numbers (the benchmark's).

    Without a window the cache has ``context + step`` slots; with one it is the ring, full. The
    step is compiled ahead (``compile``, counted in ``info["compilations"]``); the timed ``forward``
    calls the executable on the same cache every time (it cannot donate it, so each call also
    copies the cache once).
    """
    import jax

    batch, context, step, dtype, device = job.batch, job.context, job.step, job.dtype, job.device
    ring = ring_capacity(cfg, step)
    capacity = context + step if ring is None else ring
    rng = np.random.default_rng(job.seed)
    positions = job.positions()  # (B, s)
    decoder = JaxDecoder(
        cfg,
        params,
        batch=batch,
        capacity=capacity,
        dtype=dtype,
        device=device,
        matmul_precision=matmul_precision,
        span=context + step,
    )
    # The slots' tokens: 0..context-1 without a window, else the ring's last `capacity` (slot t % T); a ragged
    # batch's pads among them invalid at position -1 (`DecodeStep.cached`).
    first = max(0, context - capacity)
    slots = np.arange(first, context) % capacity
    k_pos = np.zeros((batch, capacity), np.int32)
    k_valid = np.zeros((batch, capacity), bool)
    k_pos[:, slots], k_valid[:, slots] = job.cached(first)
    T, Hkv = capacity, cfg.n_kv_heads
    decoder.cache = {
        "k_cache": to_jax(rng.standard_normal((batch, T, Hkv, cfg.d_k)), dtype, decoder.target),
        "v_cache": to_jax(rng.standard_normal((batch, T, Hkv, cfg.d_v)), dtype, decoder.target),
        "k_pos": to_jax(k_pos, None, decoder.target),
        "k_valid": to_jax(k_valid, None, decoder.target),
    }
    decoder.used = context
    x = rng.standard_normal((batch, step, cfg.d_model))
    tables = step_rotary_tables(cfg, job)  # (B, s, r/2) each, or None
    args = (decoder.weights, *decoder.step_args(x, positions, np.ones((batch, step), bool), tables))
    jitted = jax.jit(decoder.step_program)  # not donated: the timed call repeats on the same cache
    state: dict = {}

    def compile_step() -> None:
        with jax.default_matmul_precision(decoder.precision):
            state["compiled"] = jitted.lower(*args).compile()
        info["compilations"]["step"] += 1  # ahead of time, once: the timed forward calls the executable

    def forward():
        if "compiled" not in state:
            compile_step()
        return state["compiled"](*args)[1]["output"]  # (B, s, D)

    def native_stages() -> dict[str, StageTensor]:
        with jax.default_matmul_precision(decoder.precision):
            _, stages = jitted(*args)
        return _stage_tensors(cfg, stages, f"one step at context {context}")

    info["cache"] = cache_info(decoder)
    info["cache_copied_per_call"] = True  # the benchmark's step is not donated (see the docstring)
    info["compilations"] = {"step": 0}

    def step_stages(*step_args) -> dict:  # the step's token-wise stages and its written caches, by name
        cache, stages = decoder.step_program(*step_args)
        return {**stages, "k_cache": cache["k_cache"], "v_cache": cache["v_cache"]}

    # The breakdown's cuts (`stage_cuts`); the step exposes no scores: they are one row with the context.
    groups = path_groups(
        rope=cfg.rope is not None, decode=True, fused=True, joined=NO_SCORES_ROW, normed=norm_step(cfg) is not None
    )
    cuts = jax_cuts(step_stages, list(args), groups, precision=decoder.precision)
    return Prepared(forward, tensor_to_numpy, native_stages, _block, compile=compile_step, info=info, stage_cuts=cuts)
