"""``jax-best``: JAX as its best users write it: one jitted function, ``jax.vjp`` of it, a donated decode step.

* The forward is one ``jax.jit`` program. The weights are stored ``(in, out)`` (transposed once, at
  prepare) so that the projections are ``x @ W``: XLA:CPU compiles ``x @ W.T`` on the canonical
  ``(out, in)`` weights to loop fusions that transpose them (about 3.4 ms of a 1k-token decode step
  at d_model 2048, issue 43). GQA folds each group's query heads into the query rows of their kv
  head, heads first (``einsum("bhqd,bhkd->bhqk")``): no repeated keys or values, no move of the scores.
* The backward is ``jax.vjp`` of that function, the forward and the pullback in one jitted program
  (`backends.jax.vjp.jax_vjp_prepared`); the weights' gradients come back ``(in, out)`` and are
  transposed to the canonical layout outside the timed region.
* The decode step is one jitted function whose cache is donated (``donate_argnums``): XLA writes the
  step's slots in place (``lax.dynamic_update_slice`` at a traced index) instead of copying the cache
  every step (2.1x by itself, issue 43). The cache is ``(B*Hkv, C, d)``, one batch axis: read from
  the HLO (jaxlib 0.10.2, XLA:CPU), a ``(B, T, Hkv, d)`` cache is transposed every step, and a
  ``(B, Hkv, T, d)`` one, whose product drops the unit batch axis, made XLA duplicate the value
  cache's update into the context product's fusion and copy the donated cache four times per step
  (8k tokens: 16 MiB each); with the batch and kv-head axes merged the compiled step holds no copy
  and no transpose of either cache (tests/test_best_paths.py reads the HLO). The scores are slots
  first, ``K @ q.T`` (B*Hkv, C, G*s): XLA:CPU reads the keys twice as fast that way as ``q @ K.T``,
  the few query rows first (`scripts/xla-decode-costs`; `jax_programs.best_step` gives the figures).
  The timed step keeps the cache each call returns and donates it to the next, as a generation loop does.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams

from .._layouts import TOKENS_FIRST_STAGE_AXES, xla_provenance
from ..base import Backend, Prepared, PreparedDecode, StageTensor, tensor_to_numpy
from ..jax.common import (
    CompiledForward,
    block_until_ready,
    compiled_prepared,
    effective_precision,
    jax_devices,
    jax_target,
    precision_info,
    shared_program,
    to_jax,
)
from ..jax.vjp import jax_vjp_prepared
from ..stage_cuts import jax_cuts, path_groups
from .common import STATIC, BestPath, DecodeStepInputs, cache_info, decode_chunks, folded_allowed, output_stage
from .jax_programs import TRACES, best_forward, best_step, forward_args, weights_in_out

MATMUL_PRECISION = "highest"  # float32 throughout (a GPU's TF32 only where forced)
CACHE_LAYOUT = "(B*Hkv, C, Dk), (B*Hkv, C, Dv)"
DECODE_LAYOUTS = {
    STATIC: f"{CACHE_LAYOUT} preallocated to the run's C tokens, the batch and kv-head axes merged (the layout "
    "XLA:CPU reads without a copy or a transpose), written in place by lax.dynamic_update_slice at a traced index "
    "inside one jitted step whose cache is donated"
}


class StaticDecoder:
    """The jitted `best_step` (its caches donated unless ``donate=False``) and its executables by argument shapes."""

    def __init__(self, cfg: MHAConfig, params: MHAParams, dtype: str, device: str, donate: bool = True) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.target = jax_target(dtype, device)
        self.p = weights_in_out(params, dtype, self.target)
        self.key = ("best.jax.step", cfg, donate)
        self._traces_at_start = TRACES[self.key]
        _, self.jitted = shared_program(
            self.key, partial(best_step, cfg, self.key), donate_argnums=(2, 3) if donate else ()
        )
        self.precision = effective_precision(MATMUL_PRECISION)
        self._compiled: dict = {}

    @property
    def compilations(self) -> int:
        return TRACES[self.key] - self._traces_at_start

    def empty_cache(self, batch: int, slots: int):
        """Zeroed caches (B*Hkv, C, Dk) and (B*Hkv, C, Dv) on the device."""
        import jax.numpy as jnp

        cfg, rows = self.cfg, batch * self.cfg.n_kv_heads
        with _on(self.target):
            return jnp.zeros((rows, slots, cfg.d_k), self.dtype), jnp.zeros((rows, slots, cfg.d_v), self.dtype)

    def executable(self, x, k_cache, v_cache, index, tables, allowed):
        """The compiled step for these arguments' shapes (compiled here the first time, under the precision)."""
        import jax

        from ..jax.executables import compile_program

        signature = (x.shape, k_cache.shape, None if tables is None else tables[0].shape, allowed is None)
        if signature not in self._compiled:
            args = (self.p, x, k_cache, v_cache, index, tables, allowed)
            with jax.default_matmul_precision(self.precision):
                self._compiled[signature] = compile_program(self.jitted, args, self.key)
        return self._compiled[signature]

    def __call__(self, x, k_cache, v_cache, index, tables, allowed):
        """(output (B, s, D), k_cache, v_cache); the caches passed in are donated (dead after the call)."""
        return self.executable(x, k_cache, v_cache, index, tables, allowed)(
            self.p, x, k_cache, v_cache, index, tables, allowed
        )


def _on(target):
    import jax

    return jax.default_device(target)


def _index(value: int, target):
    import jax

    return jax.device_put(np.int32(value), target)  # a traced scalar: one program for every write index


def _folded_for_cache(cfg: MHAConfig, allowed: np.ndarray | None, batch: int, tokens: int, stop: int, slots: int):
    """The slots each folded query row of a chunk sees, (B*Hkv, C, G*s) (slots first, the step's scores' layout),
    over every slot of the cache (the slots from ``stop`` on are not written yet: blocked); None when the chunk
    sees every one of the C slots.

    ``allowed``: the chunk's pattern (B, 1, s, stop) over the slots written, None when it sees all of them.
    """
    if allowed is None and stop == slots:
        return None
    if allowed is None:
        allowed = np.ones((batch, 1, tokens, stop), dtype=bool)
    folded = folded_allowed(allowed, cfg.group_size)  # (B, 1, G*s, stop)
    full = np.zeros((batch, cfg.n_kv_heads, folded.shape[2], slots), dtype=bool)
    full[..., :stop] = folded  # broadcast over the kv heads
    # (B, Hkv, G*s, C) -> (B*Hkv, G*s, C) (a view) -> (B*Hkv, C, G*s): a copy, slots first, once per chunk
    return np.ascontiguousarray(full.reshape(batch * cfg.n_kv_heads, folded.shape[2], slots).transpose(0, 2, 1))


class JaxBestBackend(BestPath, Backend):
    name = "jax-best"
    convention = (
        "JAX at its best: one jax.jit program, weights stored (in, out) so XLA reads x @ W without a transpose, "
        "jax.vjp for the backward; decoding one jitted step with its (B*Hkv, C, d) cache donated, its scores slots first"
    )
    peer_limits: ClassVar[dict[str, str]] = {
        "forward": "XLA:CPU has no fused attention kernel: jax-best's core (einsum, jax.nn.softmax, einsum over the "
        "(B, H, N, N) scores) takes 21.0-21.6 ms at the reference size on one thread and 11.3-11.5 on two, against "
        "torch's fused SDPA's 13.4-13.7 and 7.7-7.8; jax.nn.dot_product_attention, on CPU XLA's unfused form too "
        "(its weighted sum a separate product: jax-dpa's gap cause), takes 27.1-30.0 and 16.2-16.4 "
        "(`scripts/attention-core-costs`, two runs each; Intel Xeon; measured, issue 43)",
    }
    decode_layouts = DECODE_LAYOUTS

    def devices(self) -> tuple[str, ...]:
        return jax_devices()

    def _prepare(self, cfg, params, inputs, dtype, device, strategy) -> Prepared:
        target = jax_target(dtype, device)
        key = ("best.jax.forward", cfg)
        compiled = CompiledForward(
            partial(best_forward, cfg), forward_args(cfg, params, inputs, dtype, target), MATMUL_PRECISION, key
        )

        def native_stages() -> dict[str, StageTensor]:
            stages = compiled.trace_and_run(partial(best_forward, cfg, stages=True))
            return {
                name: StageTensor(
                    value,
                    TOKENS_FIRST_STAGE_AXES[name],
                    "best_forward's stage dump (jitted apart)",
                    *xla_provenance(name, cfg.rope),
                )
                for name, value in stages.items()
            }

        info = {
            "weights": "(in, out), x @ W",
            **precision_info(device=device, dtype=dtype, matmul_precision=MATMUL_PRECISION),
        }
        return compiled_prepared(compiled, native_stages, info)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        target = jax_target(dtype, device)
        p, x_q, x_k, x_v, tables, allowed = forward_args(cfg, params, inputs, dtype, target)

        def to_canonical(grads: dict) -> dict:  # the weights' gradients (in, out) -> (out, in)
            return {
                name: tensor_to_numpy(g).T if name.startswith("w_") else tensor_to_numpy(g)
                for name, g in grads.items()
                if g is not None
            }

        info = {"weights": "(in, out): their gradients transposed back outside the timed region"}
        return jax_vjp_prepared(
            partial(best_forward, cfg),
            (p, x_q, x_k, x_v),
            (tables, allowed),
            cotangent,
            dtype,
            target,
            MATMUL_PRECISION,
            to_canonical,
            info,
            ("best.jax.forward", cfg),
        )

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache) -> PreparedDecode:
        decoder = StaticDecoder(cfg, params, dtype, device)
        target, slots = decoder.target, inputs.tokens
        calls = []
        for chunk in decode_chunks(cfg, inputs):
            x = to_jax(inputs.x[:, chunk.start : chunk.stop], dtype, target)  # (B, s, D)
            tables = None if chunk.tables is None else tuple(to_jax(t, dtype, target) for t in chunk.tables)
            folded = _folded_for_cache(cfg, chunk.allowed, inputs.batch, chunk.stop - chunk.start, chunk.stop, slots)
            calls.append((x, _index(chunk.start, target), tables, to_jax(folded, None, target)))

        def run():
            k_cache, v_cache = decoder.empty_cache(inputs.batch, slots)  # a fresh cache per run
            outputs = []
            for x, index, chunk_tables, allowed in calls:
                output, k_cache, v_cache = decoder(x, k_cache, v_cache, index, chunk_tables, allowed)
                outputs.append(output)
            info["compilations"] = decoder.compilations
            return outputs

        def compile_all() -> None:
            k_cache, v_cache = decoder.empty_cache(inputs.batch, slots)
            for x, index, chunk_tables, allowed in calls:
                decoder.executable(x, k_cache, v_cache, index, chunk_tables, allowed)
            info["compilations"] = decoder.compilations

        info = {
            "cache": cache_info(cfg, inputs.batch, slots, np.dtype(dtype).itemsize, CACHE_LAYOUT),  # float32 or 64
            "donated": "the cache, to every step (donate_argnums)",
            **precision_info(device=device, dtype=dtype, matmul_precision=MATMUL_PRECISION),
        }
        return PreparedDecode(
            run,
            lambda outputs: np.concatenate([tensor_to_numpy(o) for o in outputs], axis=1),
            synchronize=block_until_ready,
            compile=compile_all,
            info=info,
        )

    def prepare_step(self, cfg, params, data, dtype, device) -> Prepared:
        return prepare_decode_step(cfg, params, data, dtype, device)


def prepare_decode_step(
    cfg: MHAConfig, params: MHAParams, data: DecodeStepInputs, dtype: str, device: str, donate: bool = True
) -> Prepared:
    """One timed step of ``data`` (`common.decode_step_inputs`) on a cache of ``context + step`` slots: each call
    donates the cache the last call returned and keeps the one it returns, writing the same slots every time (so
    every call is the same step). ``donate=False`` only to show what donation saves (tests/test_best_paths.py);
    `step_program` gives the same compiled step, for reading its HLO."""
    decoder, args = step_program(cfg, params, data, dtype, device, donate)
    live = [decoder.p, *args]  # (p, x, k_cache, v_cache, index, tables, allowed): the caches replaced by each call's

    def forward():
        output, live[2], live[3] = decoder(*live[1:])
        return output

    info = {
        "cache": cache_info(cfg, data.x.shape[0], data.context + data.step, np.dtype(dtype).itemsize, CACHE_LAYOUT),
        "context": data.context,
        "step": data.step,
        "donated": "the cache, to every call" if donate else "nothing: each call copies the cache",
        **precision_info(device=device, dtype=dtype, matmul_precision=MATMUL_PRECISION),
    }

    def compile_step() -> None:
        decoder.executable(*args)
        info["compilations"] = decoder.compilations

    # The breakdown's cuts: best_step's stages, each cut jitted apart, donating the live caches from the write on.
    stage_fn = partial(best_step, cfg, ("best.jax.step.cut", cfg), stages=True)
    cuts = jax_cuts(
        stage_fn,
        live,
        path_groups(rope=cfg.rope is not None, decode=True, fused=False),
        cache_args=(2, 3) if donate else (),
        precision=decoder.precision,
    )
    return Prepared(
        forward,
        tensor_to_numpy,
        lambda: output_stage(forward()),
        block_until_ready,
        compile=compile_step,
        info=info,
        stage_cuts=cuts,
    )


def step_program(
    cfg: MHAConfig, params: MHAParams, data: DecodeStepInputs, dtype: str, device: str = "cpu", donate: bool = True
) -> tuple[StaticDecoder, tuple]:
    """The timed step's decoder and its arguments after the weights: (x, k_cache, v_cache, index, tables, allowed).

    ``decoder.executable(*args).as_text()`` is the compiled step's HLO (what the fairness test reads).
    """
    decoder = StaticDecoder(cfg, params, dtype, device, donate)
    batch, context, step = data.x.shape[0], data.context, data.step
    target, slots, rows = decoder.target, context + step, batch * cfg.n_kv_heads
    k_cache, v_cache = (np.zeros((rows, slots, width)) for width in (cfg.d_k, cfg.d_v))
    k_cache[:, :context] = data.k.reshape(rows, context, cfg.d_k)  # (B, Hkv, context, Dk) -> (B*Hkv, context, Dk)
    v_cache[:, :context] = data.v.reshape(rows, context, cfg.d_v)
    tables = None if data.tables is None else tuple(to_jax(t, dtype, target) for t in data.tables)
    allowed = to_jax(_folded_for_cache(cfg, data.allowed, batch, step, slots, slots), None, target)
    args = (to_jax(data.x, dtype, target), to_jax(k_cache, dtype, target), to_jax(v_cache, dtype, target))
    return decoder, (*args, _index(context, target), tables, allowed)
