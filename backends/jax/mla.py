"""DeepSeek's multi-head latent attention (MLA) in the JAX convention: the ``naive`` and ``absorbed`` strategies.

One head written unbatched, then ``jax.vmap`` over heads and over the batch, ``jax.jit``, as in `layer`. What a
head's function receives:

* its own slices, mapped over the head axis (``in_axes=0``): ``q_nope_h`` (N, dn), the rotated ``q_rot_h``
  (N, dr), ``W_UK_h`` (dn, R) and ``W_UV_h`` (dv, R) (head h's rows of kv_b_proj), ``W_O_h`` (D, dv);
* the ones every head shares, not mapped (``in_axes=None``): the latent ``c`` (T, R) and the ONE rotated key
  ``k_rope`` (T, dr). The shared rotary key is broadcast by vmap itself: each head's call sees the same array,
  rotated once before the vmap by the keys' positions, never copied per head or rotated per head.

``naive`` expands the head's keys ``c @ W_UK_h^T`` and values ``c @ W_UV_h^T``; ``absorbed`` scores the head's
folded query ``q_nope_h @ W_UK_h`` against ``c`` itself (with ``q_rot_h . k_rope``): multi-query attention over
the latent, the context ``A_h @ c`` (N, R) brought out by ``W_O_h W_UV_h`` (D, R); the heads' outputs are summed.
The score steps (the softcap, the masks, the softmax) on JAX's ops object; Mistral 4's temperature multiplies both
query parts, ``q_nope`` and the rotated ``q_rot``, by their positions' factors before the vmap (they ride with the
rotary tables: ``tables[4]``, None without it). The backward is ``jax.vjp`` of this
pass; decode writes each step's ``[c | k_rope]`` into one static cache (B, T, R + dr) in a jitted step that
donates it (``lax.dynamic_update_slice``).

Stages: `head` returns its stages by name, and the vmaps stack them (B, H, ...); the timed program returns only the
output (the rest is dead code to XLA), and ``native_stages`` jits a dump of the same pass that returns them all, as
the other JAX paths do: the latent and the shared key, ``q_latent``, ``q``, the scores and their steps; the naive
form adds its expanded values ``v_heads`` and the context.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, allowed_positions
from mha_rosetta.core.decode import DecodeInputs, decode_allowed
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES
from mha_rosetta.core.variants.mla_heads import check_one_input

from .._mla import ABSORBED, latent_cache_info
from ..base import Prepared, PreparedDecode, StageTensor, tensor_to_numpy
from ..frameworks.jax import effective_precision
from ..frameworks.ops import score_steps
from ..frameworks.ops_jax import JaxOps
from ..vocabulary import UnsupportedCase
from .common import (
    CompiledForward,
    compiled_prepared,
    jax_inputs,
    jax_params,
    jax_target,
    numpy_rotary_tables,
    rms_norm_last_axis,
    rotate_last_axis,
    temperature_table,
    to_jax,
)
from .vjp import canonical_param_grads, jax_vjp_prepared


def _masks(cfg: MHAConfig, allowed, batch: int, queries: int, keys: int):
    """(blocked, empty_rows) as NumPy bool (B, H, Nq, Nk) / (B, H, Nq, 1) from ``allowed``, or (None, None)."""
    if allowed is None:
        return None, None
    allowed = np.broadcast_to(allowed, (batch, cfg.n_heads, queries, keys))
    empty = ~allowed.any(axis=-1, keepdims=True)
    return np.ascontiguousarray(~allowed), (np.ascontiguousarray(empty) if empty.any() else None)


def head(cfg: MHAConfig, form: str, q_nope, q_rot, w_uk, w_uv, w_o, kv_latent, k_rope, blocked, empty) -> dict:
    """One head, one sequence, unbatched, by stage name: its scores and their steps (N, T), the naive form's values
    ``v_heads`` (T, dv) and ``context`` (N, dv), and ``output``, its contribution to the output (N, D) (`o_proj` of
    its context). The forward reads only ``output``: the rest is dead code to XLA."""
    stages: dict = {}

    def keep(name, value, parent, before):  # each score step's result, by its stage name
        stages[name] = value

    if form == ABSORBED:
        scores = (q_nope @ w_uk) @ kv_latent.T + q_rot @ k_rope.T  # (N, R) @ (R, T): W_UK_h folded into q
    else:
        scores = q_nope @ (kv_latent @ w_uk.T).T + q_rot @ k_rope.T  # the head's own keys, expanded
    stages["scores"] = scores * cfg.scale
    weights = score_steps(JaxOps(), cfg, stages["scores"], blocked=blocked, empty_rows=empty, on_stage=keep)
    if form == ABSORBED:
        stages["output"] = (weights @ kv_latent) @ (w_o @ w_uv).T  # (N, R) @ (R, D): W_O_h W_UV_h folded in
    else:
        v = stages["v_heads"] = kv_latent @ w_uv.T  # (T, dv): the head's own values, expanded
        stages["context"] = weights @ v  # (N, dv)
        stages["output"] = stages["context"] @ w_o.T  # (N, dv) @ (dv, D)
    return stages


def heads_and_batch(cfg: MHAConfig, form: str, blocked, empty):
    """`head` vmapped over heads (the shared latent and rotary key with ``in_axes=None``) and then over the batch;
    the masks (B, H, Nq, Nk), mapped on both, where present."""
    import jax

    def one(*args):
        return head(cfg, form, *args)

    masks = tuple(None if a is None else 0 for a in (blocked, empty))
    over_heads = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None, None, *masks))  # latent, k_rope: the same for all
    return jax.vmap(over_heads, in_axes=(0, 0, None, None, None, 0, 0, *masks))  # the weights: the same for all


def latent_rows(cfg: MHAConfig, p: dict, x, k_cos, k_sin):
    """``(kv_latent (B, N, R), k_rope (B, N, dr))`` of tokens ``x`` (B, N, D): what the cache holds."""
    kv_a = x @ p["w_kv_a"].T + (0 if p.get("b_kv_a") is None else p["b_kv_a"])  # (B, N, R + dr)
    R = cfg.kv_lora_rank
    kv_latent = rms_norm_last_axis(kv_a[..., :R], p["kv_a_norm"], cfg.norm_eps)
    return kv_latent, rotate_last_axis(kv_a[..., R:], k_cos, k_sin, cfg.rope)  # rotated once, shared by all heads


def factor_table(cfg: MHAConfig, positions: np.ndarray, dtype: str):
    """The temperature's factors of ``positions`` (1|B, N), NumPy in at least float32 (`common.temperature_table`),
    or None without it: the fifth of the tables `mla_pass` reads."""
    return temperature_table(cfg, positions, dtype).get("temper")


def mla_pass(cfg: MHAConfig, form: str, p: dict, x_q, kv_latent, k_rope, q_cos, q_sin, blocked, empty, factors=None):
    """The output (B, N, D) of the queries of tokens ``x_q`` over the latent rows; ``factors`` (1|B, N): the
    temperature's of the queries, or None."""
    return mla_stages(cfg, form, p, x_q, kv_latent, k_rope, q_cos, q_sin, blocked, empty, factors)["output"]


def mla_stages(
    cfg: MHAConfig, form: str, p: dict, x_q, kv_latent, k_rope, q_cos, q_sin, blocked, empty, factors=None
) -> dict:
    """`mla_pass`'s stages by name (`STAGE_AXES`): ``q_latent``, ``q``, `head`'s stages with the head and batch axes
    the vmaps give them in front, and ``output`` (B, N, D)."""
    B, N, _ = x_q.shape
    H, dn, dv, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.d_v, cfg.kv_lora_rank
    stages: dict = {}
    source = x_q
    if p.get("w_q_a") is not None:
        q_a = x_q @ p["w_q_a"].T + (0 if p.get("b_q_a") is None else p["b_q_a"])  # (B, N, Rq)
        source = stages["q_latent"] = rms_norm_last_axis(q_a, p["q_a_norm"], cfg.norm_eps)
    stages["q"] = source @ p["w_q"].T  # (B, N, H*Dk): q_b_proj has no bias
    q = stages["q"].reshape(B, N, H, cfg.d_k).transpose(0, 2, 1, 3)  # (B, H, N, Dk)
    q_nope = q[..., :dn]  # (B, H, N, dn)
    q_rot = rotate_last_axis(q[..., dn:], q_cos[:, None], q_sin[:, None], cfg.rope)  # (B, H, N, dr)
    if factors is not None:  # the temperature: every head and feature of a query row times its position's factor
        q_nope, q_rot = (JaxOps().temper_queries(part, factors[:, None, :, None]) for part in (q_nope, q_rot))
    w_o_heads = p["w_o"].reshape(-1, H, dv).transpose(1, 0, 2)  # (H, D, dv): columns h*dv:(h+1)*dv
    w_uk, w_uv = p["w_k"].reshape(H, dn, R), p["w_v"].reshape(H, dv, R)  # (H, dn, R), (H, dv, R)
    per_head = heads_and_batch(cfg, form, blocked, empty)(
        q_nope, q_rot, w_uk, w_uv, w_o_heads, kv_latent, k_rope, blocked, empty
    )  # each stage (B, H, ...): the batch vmap's axis, then the heads'
    out = per_head.pop("output").sum(axis=1)  # (B, H, N, D) -> (B, N, D): the heads' contributions summed
    return {**stages, **per_head, "output": out if p.get("b_o") is None else out + p["b_o"]}


def latent_step(cfg: MHAConfig, form: str, p: dict, cache, x, start, tables, blocked, empty):
    """One decode chunk: the rows ``[c | k_rope]`` of tokens ``x`` (B, s, D) written into the static ``cache``
    (B, T, R + dr) at ``start`` (``lax.dynamic_update_slice``), then their queries over it: (cache, output (B, s, D))."""
    import jax
    from jax import lax

    qc, qs, kc, ks, factors = tables  # factors: the temperature's of the chunk's queries (B, s), or None
    kv_latent, k_rope = latent_rows(cfg, p, x, kc, ks)
    zero = jax.numpy.zeros_like(start)  # the indices of one integer type (int64 under float64)
    cache = lax.dynamic_update_slice(cache, jax.numpy.concatenate([kv_latent, k_rope], -1), (zero, start, zero))
    R = cfg.kv_lora_rank
    return cache, mla_pass(cfg, form, p, x, cache[..., :R], cache[..., R:], qc, qs, blocked, empty, factors)


def _forward(cfg: MHAConfig, form: str, every_stage: bool = False):
    """``forward(p, x_q, x_k, x_v, tables, blocked, empty)``: the output, or with ``every_stage`` every stage by name
    (the stage dump, jitted apart: `CompiledForward.trace_and_run`)."""

    def forward(p, x_q, x_k, x_v, tables, blocked, empty):
        q_cos, q_sin, k_cos, k_sin, factors = tables
        kv_latent, k_rope = latent_rows(cfg, p, x_k, k_cos, k_sin)
        stages = mla_stages(cfg, form, p, x_q, kv_latent, k_rope, q_cos, q_sin, blocked, empty, factors)
        return dict(stages, kv_latent=kv_latent, k_rope=k_rope) if every_stage else stages["output"]

    return forward


# Each stage as `mla_stages` and `latent_rows` give it (batch first; `head`'s with the vmaps' head axis after it).
_SCORES = (("B", "H", "Nq", "Nk"), "one head's (Nq, Nk), vmapped over heads then batch (out_axes 0 both)")
STAGE_AXES = {
    "kv_latent": (("B", "Nk", "kv_lora_rank"), "RMSNorm over the last axis of the first R features of x @ w_kv_a.T"),
    "k_rope": (
        ("B", "Nk", "qk_rope_head_dim"),
        "rotated once before the vmap; in_axes=None: every head's call reads this one array, never copied per head",
    ),
    "q_latent": (("B", "Nq", "q_lora_rank"), "RMSNorm(x @ w_q_a.T + b_q_a) over the last axis"),
    "q": (("B", "Nq", "H*Dk"), "q_latent (or x) @ w_q.T, before reshape(B, N, H, Dk).transpose(0, 2, 1, 3)"),
    **dict.fromkeys(("scores", *SCORE_VARIANT_STAGES, "masked_scores", "weights"), _SCORES),
    "v_heads": (("B", "Hkv", "Nk", "Dv"), "one head's c @ W_UV_h.T (T, dv), vmapped (naive)"),
    "context": (("B", "H", "Nq", "Dv"), "one head's weights @ v_h (N, dv), vmapped (naive)"),
    "output": (("B", "Nq", "D"), "the heads' o_proj contributions summed over the head axis"),
}


def stage_tensors(stages: dict) -> dict[str, StageTensor]:
    """`StageTensor` of each stage of the dump, with its axes and how it was made (`STAGE_AXES`)."""
    return {name: StageTensor(value, *STAGE_AXES[name]) for name, value in stages.items()}


def _arguments(cfg: MHAConfig, inputs: MHAInputs, dtype: str, target):
    check_one_input(inputs.key, inputs.value)
    tables = tuple(to_jax(t, dtype, target) for t in numpy_rotary_tables(cfg, inputs))
    tables += (to_jax(factor_table(cfg, inputs.positions, dtype), None, target),)  # the temperature's, or None
    B, Nq, Nk = inputs.query.shape[0], inputs.query.shape[1], inputs.key.shape[1]
    blocked, empty = _masks(cfg, allowed_positions(cfg, inputs), B, Nq, Nk)
    return tables, to_jax(blocked, None, target), to_jax(empty, None, target)


def prepare_jax_mla(cfg, params, inputs, dtype, device, strategy, matmul_precision, info):
    target = jax_target(dtype, device)
    primals = (jax_params(params, dtype, target), *jax_inputs(inputs, dtype, target))
    compiled = CompiledForward(
        _forward(cfg, strategy), (*primals, *_arguments(cfg, inputs, dtype, target)), matmul_precision
    )

    def native_stages():  # every stage, from a jitted dump of the same pass (the timed program: the output only)
        return stage_tensors(compiled.trace_and_run(_forward(cfg, strategy, every_stage=True)))

    return compiled_prepared(compiled, native_stages, {**info, "strategy": strategy})


def prepare_jax_mla_vjp(cfg, params, inputs, cotangent, dtype, device, strategy, matmul_precision, info):
    target = jax_target(dtype, device)
    primals = (jax_params(params, dtype, target), *jax_inputs(inputs, dtype, target))
    extras = _arguments(cfg, inputs, dtype, target)
    return jax_vjp_prepared(
        _forward(cfg, strategy),
        primals,
        extras,
        cotangent,
        dtype,
        target,
        matmul_precision,
        canonical_param_grads,
        {**info, "strategy": strategy},
    )


def decode_chunk_arrays(cfg: MHAConfig, inputs: DecodeInputs, dtype: str) -> list[tuple]:
    """Each chunk of a decode run, NumPy: ``(x (B, s, D), start (int32), (q_cos, q_sin, k_cos, k_sin) (B, s, dr/2)
    and the temperature's factors (B, s) or None, blocked (B, H, s, T), empty (B, H, s, 1) or None)``; the masks by
    the positions of the slots written so far."""
    tables = numpy_rotary_tables(cfg, SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions))
    factors = factor_table(cfg, inputs.positions, dtype)  # (1|B, N): every position of the run, or None
    B, N, _ = inputs.x.shape
    chunks = []
    for start, stop in inputs.chunks():
        window = slice(start, stop)
        written = inputs.valid & (np.arange(N) < stop)  # (B, T): slots written so far (the rest never seen)
        allowed = decode_allowed(cfg, inputs.positions[:, window], inputs.positions, written)  # (B, 1, s, T)
        blocked, empty = _masks(cfg, allowed, B, stop - start, N)
        chunk_tables = (*(t[:, window] for t in tables), None if factors is None else factors[:, window])
        chunks.append((inputs.x[:, window], np.int32(start), chunk_tables, blocked, empty))
    return chunks


def prepare_jax_mla_decode_run(cfg, params, inputs: DecodeInputs, dtype, device, strategy, matmul_precision, info):
    """A whole decode run: one static latent cache (B, T, R + dr), each chunk a jitted step that donates it."""
    import jax

    target = jax_target(dtype, device)
    p = jax_params(params, dtype, target)
    B, N, _ = inputs.x.shape
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    jitted = jax.jit(partial(latent_step, cfg, strategy), donate_argnums=(1,))
    chunks = [
        (to_jax(x, dtype, target), start, (*(to_jax(t, dtype, target) for t in tables[:4]), to_jax(tables[4], None, target)),
         to_jax(blocked, None, target), to_jax(empty, None, target))
        for x, start, tables, blocked, empty in decode_chunk_arrays(cfg, inputs, dtype)
    ]  # fmt: skip

    def run():
        with jax.default_matmul_precision(effective_precision(matmul_precision)):
            cache = jax.numpy.zeros((B, N, rows), dtype=p["w_kv_a"].dtype, device=target)
            outputs = []
            for x, start, tables, blocked, empty in chunks:
                cache, out = jitted(p, cache, x, start, tables, blocked, empty)
                outputs.append(out)
            return outputs

    layout = "(B, T, R + dr): [c | k_rope] a row per token, static, written by dynamic_update_slice (donated)"
    cache_info = latent_cache_info(cfg, B, N, np.dtype(p["w_kv_a"].dtype).itemsize, layout)

    def to_numpy(outputs):
        return np.concatenate([tensor_to_numpy(out) for out in outputs], axis=1)  # (B, N, D)

    def synchronize(outputs):
        jax.block_until_ready(outputs)

    return PreparedDecode(run, to_numpy, synchronize=synchronize, info={**info, "form": strategy, "cache": cache_info})


def prepare_jax_mla_decode_step(cfg, params, job, matmul_precision, info) -> Prepared:
    """One timed step of MLA's ``job.strategy`` form (`bench --mode decode`): ``job.step`` new tokens onto the static
    latent cache (B, T + s, R + dr) holding ``job.context`` tokens of arbitrary numbers, drawn as the NumPy step
    draws them (the step's tokens, then the cache's columns). The step is the run's jitted program, compiled ahead
    (``info["compilations"]``); it is not donated, so that every timed call is the same step on the same cache (each
    call writes a new cache: ``info["cache_copied_per_call"]``, as JAX's other timed step). A ragged batch is refused."""
    import jax

    if job.lengths is not None:
        raise UnsupportedCase("jax: MLA's timed step takes a rectangular batch (every row holds the context)")
    B, T, s, form = job.batch, job.context, job.step, job.strategy
    target = jax_target(job.dtype, job.device)
    p = jax_params(params, job.dtype, target)
    rng = np.random.default_rng(job.seed)
    everywhere = np.broadcast_to(np.arange(T + s, dtype=np.int64), (B, T + s))  # (B, T + s): the run's positions
    tables = numpy_rotary_tables(cfg, SimpleNamespace(positions=everywhere, kv_positions=everywhere))
    factors = factor_table(cfg, everywhere[:, T:], job.dtype)  # the step's positions' (B, s), or None
    x = rng.standard_normal((B, s, cfg.d_model))  # (B, s, D)
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    cache = np.zeros((B, T + s, rows))  # (B, T + s, R + dr): rows :T the cached tokens, NumPy's columns transposed
    cache[:, :T] = rng.standard_normal((B, rows, T)).transpose(0, 2, 1)
    allowed = decode_allowed(cfg, everywhere[:, T:], everywhere, np.ones((B, T + s), dtype=bool))  # (B, 1, s, T + s)
    blocked, empty = _masks(cfg, allowed, B, s, T + s)

    args = (
        p, to_jax(cache, job.dtype, target), to_jax(x, job.dtype, target), np.int32(T),
        (*(to_jax(t[:, T:], job.dtype, target) for t in tables), to_jax(factors, None, target)),
        to_jax(blocked, None, target), to_jax(empty, None, target),
    )  # fmt: skip
    jitted, state = jax.jit(partial(latent_step, cfg, form)), {}
    info = {**info, "form": form, "context": T, "step": s, "compilations": {"step": 0}, "cache_copied_per_call": True}

    def compile_step() -> None:
        with jax.default_matmul_precision(effective_precision(matmul_precision)):
            state["compiled"] = jitted.lower(*args).compile()
        info["compilations"]["step"] += 1  # ahead of time, once: the timed forward calls the executable

    def forward():
        if "compiled" not in state:
            compile_step()
        return state["compiled"](*args)[1]  # (B, s, D)

    def every_stage(p, cache, x, start, tables, blocked, empty):  # the stage dump: the step's queries, whole cache
        cache, _ = latent_step(cfg, form, p, cache, x, start, tables, blocked, empty)
        latent, k_rope = cache[..., : cfg.kv_lora_rank], cache[..., cfg.kv_lora_rank :]
        return dict(
            mla_stages(cfg, form, p, x, latent, k_rope, *tables[:2], blocked, empty, tables[4]),
            kv_latent=latent,
            k_rope=k_rope,
        )

    def stages():  # jitted apart, untimed (the timed executable returns the output only)
        with jax.default_matmul_precision(effective_precision(matmul_precision)):
            return stage_tensors(jax.jit(every_stage)(*args))

    layout = "(B, T, R + dr): [c | k_rope] a row per token, static, written by dynamic_update_slice"
    info["cache"] = latent_cache_info(cfg, B, T + s, np.dtype(p["w_kv_a"].dtype).itemsize, layout)
    return Prepared(
        forward, tensor_to_numpy, stages, synchronize=jax.block_until_ready, compile=compile_step, info=info
    )
