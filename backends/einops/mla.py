"""DeepSeek's multi-head latent attention (MLA) in the einops convention: the ``naive`` and ``absorbed`` strategies.

Every contraction names its axes, as in `plans` (single letters, so NumPy's einsum reads them too), with the
axes MLA adds::

    b batch   n / q query tokens   s key tokens (the cache's slots)   d d_model (in)   o d_model (out)
    i what q_b_proj reads (q_lora_rank, or d_model without it)   h head   f a query head's features (nope + rope)
    k nope features   e rope features   l the latent (kv_lora_rank)   v d_v   c merged context features (H*dv)

Where the latent lives: it has no head axis. ``kv_a_proj_with_mqa`` gives ``"b n f"``, unpacked by name into the
latent ``c`` ``"b n l"`` and the one rotary key ``k_pe`` ``"b n e"`` that every head shares. A contraction that
names ``h`` on one side and not on the shared operand broadcasts it to every head, so the shared key is never
repeated or copied per head::

    c, k_pe = unpack(einsum("b n d, f d -> b n f", x, W_kva), [[l], [e]], "b n *")
    c       = RMSNorm over l;   k_rope = rotary(k_pe)                     # what the cache holds: "b s l", "b s e"
    q       = einsum("b n i, h f i -> b n h f", x or RMSNorm(W_qa x), W_q)   # W_q "(h f) i -> h f i"
    q_nope, q_rot = unpack(q, [[k], [e]], "b n h *")

``naive``: each head's keys and values expanded from the latent::

    k_nope  = einsum("b s l, h k l -> b s h k", c, W_UK)                 # W_UK "(h k) l -> h k l"
    v       = einsum("b s l, h v l -> b s h v", c, W_UV)                 # W_UV "(h v) l -> h v l"
    scores  = einsum("b q h k, b s h k -> b h q s", q_nope, k_nope)
            + einsum("b q h e, b s e -> b h q s", q_rot, k_rope)         # no h on the shared key: every head reads it
    output  = einsum("b q c, o c -> b q o", rearrange(einsum("b h q s, b s h v -> b q h v"), "b q h v -> b q (h v)"))

``absorbed``: multi-query attention over the latent (`core.variants.mla_algebra` has the algebra)::

    queries = pack([einsum("b q h k, h k l -> b q h l", q_nope, W_UK), q_rot], "b q h *")   # W_UK_h folded into q
    keys    = pack([c, k_rope], "b s *")                                 # [c | k_rope]: the cache's rows as they are
    scores  = einsum("b q h f, b s f -> b h q s", queries, keys)         # one key head, no h: MQA
    latent  = einsum("b h q s, b s l -> b q h l", weights, c)            # the context stays in the latent
    W_OUV   = einsum("o h v, h v l -> h o l", W_O, W_UV)                 # W_O "o (h v) -> o h v": W_O_h W_UV_h
    output  = einsum("b q h l, h o l -> b q o", latent, W_OUV)           # the heads summed by the contraction

The fold ``W_OUV`` is computed in the pass from ``w_o`` and ``w_v``, so that the backward (the library's autodiff,
`vjp`) reaches both. The scale multiplies the queries, and so does Mistral 4's temperature: both parts, ``q_nope``
and ``q_rot``, times their positions' factors ``"b n 1 1"`` (`plans.temper_table`); the score steps (the softcap,
the positional masks, the softmax) run on the library's ops object (`frameworks.ops.score_steps`), the scores laid
out ``"b h q s"`` as the plain plan's (`plans.MHA_PLAN`: MLA has a kv head per head). Every rearrange here splits or
merges neighbouring axes; every change of axis order is an einsum output spec.

Decode (`prepare_einops_mla_decode_run`): one static cache ``"b s f"`` (B, T, R + dr), the packed ``[c | k_rope]``
of each token, allocated once for the run and written at the chunk's slots by the library's own write
(`decode.put`); both forms read it, ``kv_lora_rank + d_rope`` numbers a token (``info["cache"]``). On JAX arrays
each chunk's step is jitted over the whole cache (its unwritten slots masked), so its shapes are fixed.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, rotary_tables
from mha_rosetta.core.decode import DecodeInputs, decode_allowed
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES
from mha_rosetta.core.variants.mla_heads import check_one_input

from .._mla import ABSORBED, NAIVE, latent_cache_info
from ..base import Prepared, PreparedDecode, StageTensor, tensor_to_numpy
from ..frameworks.ops import score_steps
from ..jax.common import CompiledForward, allows_tf32, compiled_prepared, effective_precision
from ..torch.common import with_matmul_precision
from .decode import _precision_wrapped, put
from .layer import grouped_allowed, grouped_masks, rotate_pairs
from .plans import MHA_PLAN, OUTPUT, axis_sizes, temper_table

SCORES = {
    NAIVE: ("b q h k, b s h k -> b h q s", "b q h e, b s e -> b h q s"),
    ABSORBED: ("b q h f, b s f -> b h q s",),
}
FORM_NOTES = {
    NAIVE: "per-head keys 'b s h k' and values 'b s h v' expanded from the latent 'b s l'; the shared key 'b s e' "
    "read by every head through an einsum that names no h on it",
    ABSORBED: "multi-query attention over the packed [c | k_rope] 'b s f': W_UK folded into each query "
    "('b q h k, h k l -> b q h l'), W_O W_UV into the output ('o h v, h v l -> h o l')",
}
CACHE_LAYOUT = (
    "'b s f' (B, T, R + dr): the packed [c | k_rope] of each token, allocated once for the run and written at the "
    "chunk's slots; read by both forms"
)


def mla_weights(cfg: MHAConfig, params: MHAParams) -> dict:
    """The canonical weights with their head axes named (rearranges that split an axis: views, never a move)."""
    import einops

    H = {"h": cfg.n_heads}

    def split(array, pattern):
        return None if array is None else einops.rearrange(array, pattern, **axis_sizes(pattern, H))

    return {
        "w_q": split(params.w_q, "(h f) i -> h f i"),  # (H, Dk, q_lora_rank or D)
        "w_uk": split(params.w_k, "(h k) l -> h k l"),  # (H, dn, R): W_UK, kv_b_proj's key rows
        "w_uv": split(params.w_v, "(h v) l -> h v l"),  # (H, dv, R): W_UV, its value rows
        "w_o": params.w_o,  # (D, H*dv)
        "b_o": params.b_o,
        "w_q_a": params.w_q_a,  # (q_lora_rank, D) or None
        "b_q_a": params.b_q_a,
        "q_a_norm": params.q_a_norm,
        "w_kv_a": params.w_kv_a,  # (R + dr, D)
        "b_kv_a": params.b_kv_a,
        "kv_a_norm": params.kv_a_norm,  # (R,)
    }


def latent_tables(ops, cfg: MHAConfig, inputs, dtype: str) -> dict | None:
    """The position tables as the library's arrays, each a tuple with the tokens on axis 1: the rotary's ``"q"``
    (cos, sin) "b n 1 e/2" against the heads, ``"k"`` "b n e/2" against the shared key (no head axis); with the
    temperature ``"temper"`` (its factors "b n 1 1", `plans.temper_table`). None without either. ``inputs``:
    positions and kv_positions."""
    import einops

    out = {}
    tables = rotary_tables(cfg, inputs)
    if tables is not None:
        against_heads = [einops.rearrange(table, "b n k -> b n 1 k") for table in (tables.q_cos, tables.q_sin)]
        out["q"] = tuple(ops.asarray(table) for table in against_heads)
        out["k"] = (ops.asarray(tables.k_cos), ops.asarray(tables.k_sin))
    temper = temper_table(ops, cfg, inputs.positions, MHA_PLAN, dtype)  # MLA has a kv head per head: MHA's layout
    if temper is not None:
        out["temper"] = temper
    return out or None


def _linear(ops, pattern: str, x, w, b=None):
    y = ops.einsum(pattern, x, w)
    return y if b is None else ops.add_bias(y, b)


def latent_rows(ops, cfg: MHAConfig, w: dict, x, tables=None):
    """The packed ``[c | k_rope]`` "b n f" of tokens ``x`` "b n d": the normed latent and the rotated shared key."""
    import einops

    kv_a = _linear(ops, "b n d, f d -> b n f", x, w["w_kv_a"], w["b_kv_a"])  # (B, N, R + dr)
    c, k_pe = einops.unpack(kv_a, [[cfg.kv_lora_rank], [cfg.qk_rope_head_dim]], "b n *")  # "b n l", "b n e"
    c = ops.rms_norm(c, w["kv_a_norm"], cfg.norm_eps, "b n l -> b n 1")
    if tables is not None and "k" in tables:
        k_pe = rotate_pairs(k_pe, *tables["k"], cfg.rope, "b n")  # rotated once, for every head
    return einops.pack([c, k_pe], "b n *")[0]  # (B, N, R + dr)


def queries(ops, cfg: MHAConfig, w: dict, x, tables=None, record: dict | None = None):
    """(q_nope "b q h k", the rotated q_rot "b q h e") of tokens ``x`` "b n d", scaled by ``cfg.scale`` (and by the
    temperature's factors, with it)."""
    import einops

    source = x
    if w["w_q_a"] is not None:  # q_lora_rank: q_b_proj reads the normed query latent
        q_a = _linear(ops, "b n d, i d -> b n i", x, w["w_q_a"], w["b_q_a"])  # (B, N, q_lora_rank)
        source = ops.rms_norm(q_a, w["q_a_norm"], cfg.norm_eps, "b n i -> b n 1")
        if record is not None:
            record["q_latent"] = source
    q = ops.einsum("b n i, h f i -> b n h f", source, w["w_q"])  # (B, N, H, Dk): no bias on q_b_proj
    if record is not None:
        record["q"] = einops.rearrange(q, "b n h f -> b n (h f)")  # (B, N, H*Dk), a merge
    q = ops.scale(q, cfg.scale)  # the queries, cheaper than the scores
    q_nope, q_rot = einops.unpack(q, [[cfg.qk_nope_head_dim], [cfg.qk_rope_head_dim]], "b n h *")
    tables = tables or {}
    if "q" in tables:
        q_rot = rotate_pairs(q_rot, *tables["q"], cfg.rope, "b n h")
    if "temper" in tables:  # both parts, each query's features times its position's factor "b n 1 1"
        q_nope, q_rot = (ops.temper_queries(part, tables["temper"][0]) for part in (q_nope, q_rot))
    return q_nope, q_rot


def attend_latent(ops, cfg: MHAConfig, w: dict, form: str, q_nope, q_rot, rows, blocked, empty_rows, record=None):
    """The queries over the packed rows ``rows`` "b s f" (the latent and the shared key): the output "b q o".
    ``record`` (a dict) receives the scores, their steps and (naive) the values, the context and the merge."""
    import einops

    c, k_rope = einops.unpack(rows, [[cfg.kv_lora_rank], [cfg.qk_rope_head_dim]], "b s *")  # "b s l", "b s e"
    if form == ABSORBED:
        folded = ops.einsum("b q h k, h k l -> b q h l", q_nope, w["w_uk"])  # W_UK_h folded into each query
        scores = ops.einsum(SCORES[ABSORBED][0], einops.pack([folded, q_rot], "b q h *")[0], rows)  # MQA
    else:
        k_nope = ops.einsum("b s l, h k l -> b s h k", c, w["w_uk"])  # each head's keys from the latent
        nope, rope = SCORES[NAIVE]
        scores = ops.einsum(nope, q_nope, k_nope) + ops.einsum(rope, q_rot, k_rope)  # (B, H, Nq, T)
    on_stage = None
    if record is not None:
        record["scores"] = ops.snapshot(scores)  # the steps below may work in place

        def on_stage(name, value, parent, before):
            record[name] = ops.snapshot(value)

    weights = score_steps(ops, cfg, scores, blocked=blocked, empty_rows=empty_rows, on_stage=on_stage)  # "b h q s"
    if form == ABSORBED:
        latent = ops.einsum("b h q s, b s l -> b q h l", weights, c)  # the context, still in the latent
        w_o = einops.rearrange(w["w_o"], "o (h v) -> o h v", h=cfg.n_heads)  # a split: head h's columns
        w_ouv = ops.einsum("o h v, h v l -> h o l", w_o, w["w_uv"])  # W_O_h W_UV_h (H, D, R)
        output = ops.einsum("b q h l, h o l -> b q o", latent, w_ouv)  # the heads summed by the contraction
    else:
        v = ops.einsum("b s l, h v l -> b s h v", c, w["w_uv"])  # each head's values from the latent
        context = ops.einsum("b h q s, b s h v -> b q h v", weights, v)
        merged = einops.rearrange(context, "b q h v -> b q (h v)")  # a merge
        output = ops.einsum(OUTPUT, merged, w["w_o"])
        if record is not None:
            record.update(v_heads=v, context=context, merged=merged)
    return output if w["b_o"] is None else ops.add_bias(output, w["b_o"])


def mla_pipeline(ops, w, x_q, x_k, x_v, blocked, empty_rows, tables=None, *, cfg, form, record=None):
    """The forward pass of ``form``, the einops adapter's call signature (``x_v`` is ``x_k``: one latent)."""
    rows = latent_rows(ops, cfg, w, x_k, tables)
    q_nope, q_rot = queries(ops, cfg, w, x_q, tables, record)
    output = attend_latent(ops, cfg, w, form, q_nope, q_rot, rows, blocked, empty_rows, record)
    if record is not None:
        import einops

        record["kv_latent"], record["k_rope"] = einops.unpack(
            rows, [[cfg.kv_lora_rank], [cfg.qk_rope_head_dim]], "b s *"
        )
        record["output"] = output
    return output


# The stages the forms record, in the layout the einsums give them (the checks compare them with every other
# convention's): both forms the latent, the shared key, the queries, the scores and their steps; the naive form adds
# its values, context and merge (the absorbed form's context stays in the latent, 'b q h l', no stage of the table).
STAGE_NOTES = {
    "kv_latent": (("B", "Nk", "kv_lora_rank"), "RMSNorm of the latent unpacked from kv_a: 'b s l'"),
    "k_rope": (("B", "Nk", "qk_rope_head_dim"), "the shared key unpacked from kv_a, rotated: 'b s e', no head axis"),
    "q_latent": (("B", "Nq", "q_lora_rank"), "RMSNorm(einsum 'b n d, i d -> b n i')"),
    "q": (("B", "Nq", "H*Dk"), "einsum 'b n i, h f i -> b n h f', shown as rearrange 'b n h f -> b n (h f)'"),
    **dict.fromkeys(
        ("scores", *SCORE_VARIANT_STAGES, "masked_scores", "weights"),
        (
            ("B", "H", "Nq", "Nk"),
            "'b h q s' as the einsum writes it (naive: two einsums added; absorbed: one), "
            "the scale already on the queries",
        ),
    ),
    "v_heads": (("B", "Nk", "Hkv", "Dv"), "einsum 'b s l, h v l -> b s h v' (naive): each head's values"),
    "context": (("B", "Nq", "H", "Dv"), "einsum 'b h q s, b s h v -> b q h v' (naive)"),
    "merged": (("B", "Nq", "H*Dv"), "rearrange 'b q h v -> b q (h v)' (naive)"),
    "output": (("B", "Nq", "D"), "einsum 'b q c, o c -> b q o' (naive), 'b q h l, h o l -> b q o' (absorbed)"),
}


def stage_tensors(record: dict) -> dict[str, StageTensor]:
    return {name: StageTensor(record[name], axes, note) for name, (axes, note) in STAGE_NOTES.items() if name in record}


def prepare_einops_mla(backend, ops, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype, device, form):
    """The einops adapter's `Prepared` for MLA's ``form``; ``.pipeline`` (torch, NumPy) or ``.fn``/``.args`` (JAX):
    the call the backward differentiates (`vjp`)."""
    check_one_input(inputs.key, inputs.value)  # one latent of the key tokens: value must be the key
    weights = {name: ops.asarray(value) for name, value in mla_weights(cfg, params).items()}
    x_q, x_k, x_v = (ops.asarray(x) for x in (inputs.query, inputs.key, inputs.value))
    blocked, empty_rows = (ops.asarray(m, cast=False) for m in grouped_masks(cfg, inputs, MHA_PLAN))
    info = backend._numerics_info(dtype, device)
    info.update(strategy=form, form=FORM_NOTES[form], patterns=f"scores {' + '.join(map(repr, SCORES[form]))}")
    forward = partial(mla_pipeline, cfg=cfg, form=form)

    def stages_of(*arrays):
        record: dict = {}
        mla_pipeline(*arrays, cfg=cfg, form=form, record=record)
        return record

    args = (weights, x_q, x_k, x_v, blocked, empty_rows, latent_tables(ops, cfg, inputs, dtype))
    if backend.array_library == "jax":
        key = ("einops.jax.mla", cfg, form, dtype, device)  # the closures capture ops (its dtype and device), cfg, form
        compiled = CompiledForward(partial(forward, ops), args, backend.matmul_precision, key)
        return compiled_prepared(compiled, lambda: stage_tensors(compiled.trace_and_run(partial(stages_of, ops))), info)
    run, record = partial(forward, ops, *args), partial(stages_of, ops, *args)
    if backend.array_library == "torch":  # TF32 set for each call and restored (GPU only)
        tf32 = allows_tf32(backend.matmul_precision)
        run, record = with_matmul_precision(run, device, tf32), with_matmul_precision(record, device, tf32)
    run.pipeline = (partial(forward, ops), args)  # the call itself, which the backward differentiates
    return Prepared(run, tensor_to_numpy, lambda: stage_tensors(record()), synchronize=ops.synchronize, info=info)


def _decode_step(ops, cfg, form, w, cache, x, slots, tables, blocked, empty_rows, *, held: int | None):
    """A chunk's device half: its rows written into ``cache`` at ``slots``, its queries over the first ``held``
    slots (None: the whole cache, its unwritten slots masked). (output "b n o", cache)."""
    cache = put(ops, cache, slots, latent_rows(ops, cfg, w, x, tables), x.shape[1])
    q_nope, q_rot = queries(ops, cfg, w, x, tables)
    rows = cache if held is None else cache[:, :held]
    return attend_latent(ops, cfg, w, form, q_nope, q_rot, rows, blocked, empty_rows), cache


def prepare_einops_mla_decode_run(backend, ops, cfg, params, inputs: DecodeInputs, dtype, device, form):
    """A whole decode run of MLA's ``form`` through one static latent cache "b s f" (`Backend._prepare_decode_run`)."""
    B, N = inputs.batch, inputs.x.shape[1]
    w = {name: ops.asarray(value) for name, value in mla_weights(cfg, params).items()}
    xs = ops.asarray(inputs.x)  # "b n d"
    every = SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions)
    tables = latent_tables(ops, cfg, every, dtype)  # every position of the run, once (the temperature's offset)
    fixed = backend.array_library == "jax"  # jitted over the whole cache: fixed shapes, one program per chunk length
    steps = []
    for start, stop in inputs.chunks():
        held = N if fixed else stop
        written = inputs.valid[:, :held] & (np.arange(held) < stop)  # (B, T): the slots written so far
        allowed = decode_allowed(cfg, inputs.positions[:, start:stop], inputs.positions[:, :held], written)
        masks = tuple(ops.asarray(m, cast=False) for m in grouped_allowed(cfg, allowed, MHA_PLAN))  # "b h q s"
        chunk_tables = (
            None
            if tables is None
            else {side: tuple(table[:, start:stop] for table in pair) for side, pair in tables.items()}
        )
        slots = ops.asarray(np.arange(start, stop), cast=False)
        steps.append((xs[:, start:stop], slots, chunk_tables, *masks, None if fixed else held))
    step, precision = partial(_decode_step, ops, cfg, form), nullcontext
    if fixed:
        import jax

        jitted = jax.jit(lambda *args: step(*args, held=None), donate_argnums=(1,))  # the cache donated
        precision = partial(jax.default_matmul_precision, effective_precision(backend.matmul_precision))
    itemsize = ops.asarray(np.zeros(1)).dtype.itemsize

    def run():
        cache = ops.asarray(np.zeros((B, N, cfg.kv_lora_rank + cfg.qk_rope_head_dim)))  # "b s f", allocated once
        outputs = []
        with precision():
            for x, slots, chunk_tables, blocked, empty_rows, held in steps:
                if fixed:
                    out, cache = jitted(w, cache, x, slots, chunk_tables, blocked, empty_rows)
                else:
                    out, cache = step(w, cache, x, slots, chunk_tables, blocked, empty_rows, held=held)
                outputs.append(out)
        return outputs

    def to_numpy(outputs):
        return np.concatenate([tensor_to_numpy(out) for out in outputs], axis=1)  # (B, N, D)

    info = {**backend._numerics_info(dtype, device), "form": FORM_NOTES[form]}
    info["cache"] = latent_cache_info(cfg, B, N, itemsize, CACHE_LAYOUT)
    run = _precision_wrapped(backend, device, run)
    return PreparedDecode(run, to_numpy, synchronize=lambda outs: ops.synchronize(outs[-1]), info=info)
