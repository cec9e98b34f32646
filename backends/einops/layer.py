"""The einops pipeline: the einsum plans of `plans` run on NumPy, torch or JAX arrays.

The few array operations the pipeline needs that einops itself does not give (in-place updates,
conversions, RMSNorm's rsqrt, and the score steps: `frameworks.ops.score_steps`) are the array
library's ops object's (`frameworks.ops.OPS_BY_LIBRARY`), the same objects every other adapter
runs its scores through; `run_pipeline` is the forward pass, recorded stage by stage;
`stage_tensors` says where each stage's memory comes from (a view, a copy or new), for the explainer.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import STAGE_NAMES, MHAConfig, MHAInputs, MHAParams, allowed_positions
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES
from mha_rosetta.core.variants import norm_step, relative_distances, t5_buckets

from .._layouts import XLA_LAYOUT
from .._recording import NO_ROPE_NOTE, relation_to, shares_memory
from ..base import StageTensor
from ..frameworks.ops import (
    HEAD_STEP_HOW,
    OPS_BY_LIBRARY,
    STEP_HOW,
    after_rotary,
    read_values,
    score_steps,
)
from ..frameworks.score_parts import distance_slopes, part_params, score_parts
from .plans import (
    MERGED_PROJECTIONS,
    OUTPUT,
    PIPELINE_TENSORS,
    STAGE_AXES,
    EinsumPlan,
    axis_sizes,
)

# numpy, torch, jax: the libraries whose ops object has the layer's einsum (MlxOps runs the score steps only, for the
# mlx adapter; einops on MLX would need its einsum and array-construction hooks too, so it is refused by name).
ARRAY_LIBRARIES = tuple(library for library, ops in OPS_BY_LIBRARY.items() if hasattr(ops, "einsum"))


# The feature pairs of each rotary convention, as the grouping of one head's features:
# "half" = (two k), feature two*r/2 + k; "interleaved" = (k two), feature 2k + two.
ROTARY_PAIRS = {"half": "two k", "interleaved": "k two"}


def rotate_pairs(x, cos, sin, style: str, heads: str):
    """The rotary embedding in einops form: x (``heads``..., Dk), tables broadcastable to (``heads``..., r/2)."""
    import einops

    h = cos.shape[-1]  # r/2 pairs
    r, d_k = 2 * h, x.shape[-1]
    x_rot, x_pass = (x, None) if r == d_k else einops.unpack(x, [[r], [d_k - r]], f"{heads} *")
    pair = ROTARY_PAIRS[style]
    pairs = einops.rearrange(x_rot, f"{heads} ({pair}) -> {heads} {pair}", two=2)  # a split, no axis moves
    a, b = (pairs[..., 0, :], pairs[..., 1, :]) if style == "half" else (pairs[..., 0], pairs[..., 1])
    turned, _ = einops.pack([a * cos - b * sin, b * cos + a * sin], f"{heads} {pair.replace('two', '*')}")
    rotated = einops.rearrange(turned, f"{heads} {pair} -> {heads} ({pair})")  # (..., r), a merge
    return rotated if x_pass is None else einops.pack([rotated, x_pass], f"{heads} *")[0]  # (..., Dk)


def _norm_pattern(heads: str, per_head: bool) -> str:
    """einops.reduce's pattern of QK-norm's mean of squares: over ``k`` (``per_head``) or every head axis and ``k``."""
    names = heads.split()  # "b n h" or "b n g r"
    kept = names if per_head else names[:2] + ["1"] * (len(names) - 2)
    return f"{heads} k -> {' '.join(kept)} 1"


def run_pipeline(
    ops,
    plan: EinsumPlan,
    weights: dict,
    x_q,
    x_k,
    x_v,
    blocked,
    empty_rows,
    tables=None,
    score_tables=None,
    *,
    cfg: MHAConfig,
    record: dict | None = None,
):
    """The forward pass in einsum form; ``record`` (a dict) receives the stage tensors when given.

    ``score_tables`` (`score_tables`): ALiBi's bias in the scores' layout and T5's buckets, where on.
    Shapes below are for plain MHA; with GQA read (Hkv, G) for H in q and (Hkv, Nq, G)
    for (H, Nq) in the scores. The two halves, `project_heads` and `attend`, are what a
    decode step (`decode`) runs with the cache's keys between them.
    """
    _, _, v, _, _, q_rotated, k_rotated = project_heads(
        ops, plan, weights, x_q, x_k, x_v, tables, cfg=cfg, record=record
    )  # what the scores and the weighted sum read
    return attend(
        ops,
        plan,
        weights,
        q_rotated,
        k_rotated,
        v,
        blocked,
        empty_rows,
        score_tables,
        cfg=cfg,
        record=record,
        x_gate=x_q,
    )


def project_heads(ops, plan: EinsumPlan, weights: dict, x_q, x_k, x_v, tables=None, *, cfg: MHAConfig, record=None):
    """The token-wise half of the pass: (q, k, v, q_normed, k_normed, q_rotated, k_rotated), heads after tokens,
    where v, q_rotated and k_rotated are what the weighted sum and the scores read: Gemma 4's value norm and Llama 4's
    steps after rotary applied when on (`frameworks.ops.read_values`, `after_rotary`; features on the last axis).

    ``tables``: the position tables of these tokens (`plans.position_tables`), or None.
    ``record`` receives q, k, v, the normed and the rotated heads (and those steps' stages) when given.
    """
    q = ops.einsum(plan.project_q, x_q, weights["w_q"])  # (B, Nq, H, Dk)
    k = ops.einsum(plan.project_k, x_k, weights["w_k"])  # (B, Nk, Hkv, Dk)
    v = ops.einsum(plan.project_v, x_v, weights["w_v"])  # (B, Nk, Hkv, Dv)
    if weights["b_q"] is not None:  # bias="qkv": these three, and b_o is None below
        q = ops.add_bias(q, weights["b_q"])  # b_q as (H, Dk)
        k = ops.add_bias(k, weights["b_k"])  # b_k as (Hkv, Dk)
        v = ops.add_bias(v, weights["b_v"])  # b_v as (Hkv, Dv)
    q_normed, k_normed = q, k
    if (step := norm_step(cfg)) is not None:  # the norm before rotary (QK-norm): (H, Dk) weights over the projection
        w_q, w_k, per_head = weights[step.weight("q")], weights[step.weight("k")], step.per_head  # (Dk,) per head
        q_normed = ops.rms_norm(q, w_q, cfg.norm_eps, _norm_pattern(plan.heads_q, per_head))
        k_normed = ops.rms_norm(k, w_k, cfg.norm_eps, _norm_pattern(plan.heads_kv, per_head))
    q_rotated, k_rotated = q_normed, k_normed  # without rope: the (normed) heads themselves
    tables = tables or {}
    if "rotary" in tables:
        q_cos, q_sin, k_cos, k_sin = tables["rotary"]  # (1|B, Nq, 1, r/2), (1|B, Nk, 1, r/2)
        q_rotated = rotate_pairs(q_normed, q_cos, q_sin, cfg.rope, plan.heads_q)  # (B, Nq, H, Dk)
        k_rotated = rotate_pairs(k_normed, k_cos, k_sin, cfg.rope, plan.heads_kv)  # (B, Nk, Hkv, Dk)
    on_stage = None
    if record is not None:
        record.update(q=q, k=k, v=v, q_rotated=q_rotated, k_rotated=k_rotated)
        if step is not None:
            record.update(q_normed=q_normed, k_normed=k_normed)

        def on_stage(name, value, parent):
            record[name] = value

    factors = tables["temper"][0] if "temper" in tables else None  # (1|B, Nq, 1[, 1], 1)
    q_scored = after_rotary(ops, cfg, q_rotated, "q", factors, on_stage=on_stage)
    k_scored = after_rotary(ops, cfg, k_rotated, "k", on_stage=on_stage)
    values = read_values(ops, cfg, v, on_stage=on_stage)
    return q, k, values, q_normed, k_normed, q_scored, k_scored


def attend(
    ops,
    plan: EinsumPlan,
    weights: dict,
    q_rotated,
    k_rotated,
    v,
    blocked,
    empty_rows,
    score_tables=None,
    *,
    cfg: MHAConfig,
    record: dict | None = None,
    x_gate=None,
):
    """The attention half: scores of the queries against the keys ``k_rotated`` (B, Nk, Hkv, Dk) (a decode
    step's: the cache's slots), the score variants, the mask, the softmax, the context and the output.
    ``x_gate``: the query tokens (B, Nq, D) (a decode step's own), read only with the output gate."""
    import einops

    score_tables = score_tables or {}
    # Scaling q (B*Nq*H*Dk numbers) is cheaper than scaling the scores (B*H*Nq*Nk).
    scores = ops.einsum(plan.scores, ops.scale(q_rotated, cfg.scale), k_rotated)  # (B, H, Nq, Nk)
    bias = None
    if cfg.has_score_bias:
        bias = score_tables.get("sloped", 0.0)  # (1|B, H, Nq, Nk) in the scores' layout
        if cfg.rel_buckets is not None:  # (1|B, Nq, Nk, H) gathered, then laid out as the scores
            bias = bias + einops.rearrange(ops.take(weights["rel_bias"], score_tables["bucket"]), plan.rel_bias)
    parts = score_parts(cfg, weights, lambda w: einops.rearrange(w, plan.sink))  # against the scores
    on_stage = None
    if record is not None:
        record["scores"] = ops.snapshot(scores)  # the steps below may work in place
        buffers = {"scores": scores}  # the live buffers (not snapshots), to measure which step wrote into which

        def on_stage(name, value, parent, before):
            record[name] = value if name == "weights" else ops.snapshot(value)
            buffers[name] = value

    attention = score_steps(
        ops, cfg, scores, bias=bias, blocked=blocked, empty_rows=empty_rows, **parts, on_stage=on_stage
    )  # (B, H, Nq, Nk)
    context = ops.einsum(plan.context, attention, v)  # (B, Nq, H, Dv)
    merged = einops.rearrange(context, plan.merge)  # (B, Nq, H*Dv)
    gate, read = (None, merged) if not cfg.attn_output_gate else output_gate(ops, plan, weights, x_gate, merged)
    output = ops.einsum(OUTPUT, read, weights["w_o"])  # (B, Nq, D)
    if weights["b_o"] is not None:
        output = ops.add_bias(output, weights["b_o"])
    if record is not None:
        record.update(context=context, merged=merged, **({} if gate is None else {"gate": gate}), output=output)
        if ops.has_buffers:
            record["buffers"] = buffers
    return output


def output_gate(ops, plan: EinsumPlan, weights: dict, x, merged) -> tuple:
    """(gate, merged * gate) for the tokens ``x`` (B, Nq, D), (B, Nq, H*Dv) each: the logits by the query
    projection's own einsum (``w_gate`` split like ``w_q``, its rows per head), merged by the context's pattern
    (``plan.merge``, a reshape), the sigmoid and product by the library's ops object."""
    import einops

    logits = ops.einsum(plan.project_q, x, weights["w_gate"])  # (B, Nq, H, Dv); (B, Nq, Hkv, G, Dv) with GQA
    if weights.get("b_gate") is not None:
        logits = ops.add_bias(logits, weights["b_gate"])
    return ops.output_gate(merged, einops.rearrange(logits, plan.merge))


def _head_sizes(cfg: MHAConfig) -> dict[str, int]:
    return {"h": cfg.n_heads, "g": cfg.n_kv_heads, "r": cfg.group_size}


def canonical_weights(cfg: MHAConfig, params: MHAParams, plan: EinsumPlan) -> dict[str, np.ndarray | None]:
    """The canonical (out, in) weights with their head axes split out (reshapes, as NumPy views)."""
    import einops

    sizes = _head_sizes(cfg)
    kv_sizes = {"h": cfg.n_kv_heads, "g": cfg.n_kv_heads}  # the kv weights have one head axis

    def split(array, pattern, lengths):
        return None if array is None else einops.rearrange(array, pattern, **axis_sizes(pattern, lengths))

    return {
        "w_q": split(params.w_q, plan.weight_q, sizes),  # (H, Dk, D) or (Hkv, G, Dk, D)
        "w_k": split(params.w_k, plan.weight_kv, kv_sizes),  # (Hkv, Dk, kdim)
        "w_v": split(params.w_v, plan.weight_kv, kv_sizes),  # (Hkv, Dv, vdim)
        "w_o": params.w_o,  # (D, H*Dv)
        "b_q": split(params.b_q, plan.bias_q, sizes),  # (H, Dk) or (Hkv, G, Dk)
        "b_k": split(params.b_k, plan.bias_kv, kv_sizes),  # (Hkv, Dk)
        "b_v": split(params.b_v, plan.bias_kv, kv_sizes),  # (Hkv, Dv)
        "b_o": params.b_o,  # (D,)
        **_variant_weights(cfg, params, plan, split, sizes, kv_sizes),
    }


def _variant_weights(cfg: MHAConfig, params: MHAParams, plan: EinsumPlan, split, sizes, kv_sizes) -> dict:
    """The variants' parameters the pipeline reads (only those present, as `MHAParams.as_dict` lists them)."""
    weights = {}
    if (step := norm_step(cfg)) is not None:  # the norm before rotary (QK-norm): per head (Dk,) each, every head's
        w_q, w_k = getattr(params, step.weight("q")), getattr(params, step.weight("k"))
        if not step.per_head:  # split like the biases (its features are the heads'): (H, Dk) or (Hkv, G, Dk), (Hkv, Dk)
            w_q, w_k = split(w_q, plan.bias_q, sizes), split(w_k, plan.bias_kv, kv_sizes)
        weights[step.weight("q")], weights[step.weight("k")] = w_q, w_k
    for spec in part_params(cfg):  # the score parts' (`frameworks.score_parts`): one value per query head
        # (H,), or (Hkv, G) split like the heads; laid out against the scores in the pass (plan.sink)
        value = getattr(params, spec.name)
        weights[spec.name] = value if cfg.group_size == 1 else split(value, "(g r) -> g r", sizes)
    if cfg.rel_buckets is not None:
        # (buckets, H), or (buckets, Hkv, G) split like the heads: T5's table, gathered by bucket in the pass
        rel = params.rel_bias
        weights["rel_bias"] = rel if cfg.group_size == 1 else split(rel, "n (g r) -> n g r", sizes)
    if cfg.attn_output_gate:  # the output gate's rows are per head (Dv == Dk): split as w_q and b_q are
        weights["w_gate"] = split(params.w_gate, plan.weight_q, sizes)  # (H, Dv, D) or (Hkv, G, Dv, D)
        weights["b_gate"] = split(params.b_gate, plan.bias_q, sizes)  # (H, Dv) or (Hkv, G, Dv), or None
    return weights


def score_tables(cfg: MHAConfig, inputs: MHAInputs, plan: EinsumPlan, dtype: str) -> dict[str, np.ndarray]:
    """The NumPy tables the score bias reads, made at prepare time with `core.variants`.

    ``sloped``: ALiBi's whole bias ``m_h (p_j - p_i)`` (the slopes `score_parts.distance_slopes`, constants: they
    are not learned; float64, as `core.variants.alibi_bias`) laid out like the mask (``plan.mask``), float32
    for half precision (the bias is added in float32), else ``dtype``; ``bucket`` (1|B, Nq, Nk) int T5's buckets, which index
    ``rel_bias`` inside the pass. Empty without ALiBi or relative bias.
    """
    import einops

    tables: dict[str, np.ndarray] = {}
    slopes = distance_slopes(cfg)  # ALiBi's m_h (H,) float64, or None
    if slopes is not None:
        distance = relative_distances(inputs.positions, inputs.kv_positions).astype(np.float64)  # (1|B, Nq, Nk)
        bias = slopes[None, :, None, None] * distance[:, None]  # (1|B, H, Nq, Nk)
        bias = einops.rearrange(bias, plan.mask, **axis_sizes(plan.mask, _head_sizes(cfg)))
        tables["sloped"] = bias.astype(np.float64 if dtype == "float64" else np.float32)
    if cfg.rel_buckets is not None:
        distance = relative_distances(inputs.positions, inputs.kv_positions)  # (1|B, Nq, Nk)
        buckets = t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)
        tables["bucket"] = buckets.astype(np.int64)
    return tables


def grouped_masks(cfg: MHAConfig, inputs: MHAInputs, plan: EinsumPlan) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(blocked, empty_rows) shaped to broadcast against the scores of ``plan``.

    blocked:    True where a query may NOT attend (what the fill needs), or None.
    empty_rows: the same with the key axis reduced to 1: True for rows with no allowed
                key, or None if there are none.
    """
    return grouped_allowed(cfg, allowed_positions(cfg, inputs), plan)  # (B|1, H|1, Nq, Nk) or None


def grouped_allowed(cfg: MHAConfig, allowed: np.ndarray | None, plan: EinsumPlan):
    """`grouped_masks` of an allowed mask (B|1, H|1, Nq, Nk) already made (a decode step's, over the cache)."""
    import einops

    if allowed is None:
        return None, None
    # A mask shared by all heads keeps unit head axes: (g, r) = (1, 1).
    sizes = _head_sizes(cfg) if allowed.shape[1] > 1 else {"h": 1, "g": 1, "r": 1}
    allowed = einops.rearrange(allowed, plan.mask, **axis_sizes(plan.mask, sizes))  # the scores' layout
    empty = ~allowed.any(axis=-1, keepdims=True)  # key axis reduced to 1
    return ~allowed, (empty if empty.any() else None)


# How each stage is made, where no rearrange of another tensor says it.
_STAGE_ORIGINS = {
    **HEAD_STEP_HOW,  # Llama 4's steps after rotary, Gemma 4's value norm: the ops object's, on the last axis
    "q_heads": "the projection einsum writes the heads directly; no split step",
    "k_heads": "the projection einsum writes the heads directly",
    "v_heads": "the projection einsum writes the heads directly",
    "scores": "einsum output spec puts heads before tokens",
    "capped_scores": STEP_HOW["capped_scores"],
    "biased_scores": STEP_HOW["biased_scores"] + ", the relative bias gathered by bucket",
    "masked_scores": "blocked positions filled with -inf",
    "weights": "softmax of the masked scores",
    "context": "einsum output spec keeps tokens first",
    "gate": "sigmoid of the query projection's einsum with w_gate, merged like the context; w_o reads merged * gate",
    "output": f"einsum '{OUTPUT}'",
}


# The score steps' stages in order (`frameworks.ops.score_steps`): each may write into the buffer of the one before.
_SCORE_STAGES = ("scores", *SCORE_VARIANT_STAGES, "masked_scores", "weights")


def _rearranged(ops, result, source, pattern: str) -> tuple[str, str]:
    """(note, relation) of a tensor made by a rearrange of ``source``: a view or a copy, measured.

    JAX arrays have no buffers to compare (XLA places them): an immutable value made from
    another is counted a copy.
    """
    how = f"rearrange '{pattern}'"
    if not ops.has_buffers:
        return f"{how}; {XLA_LAYOUT}", "copy"
    return how, relation_to(result, source)


def _provenance(ops, name: str, record: dict, rope: str | None) -> tuple[str, str, str | None]:
    """(note, relation, parent) of a pipeline stage but merged, as the forward pass made it."""
    if name in ("q_normed", "k_normed"):
        return "RMSNorm: einops.reduce(x * x, ..., 'mean'), then x * rsqrt(... + eps) * w", "new", f"{name[0]}_heads"
    if name in ("q_rotated", "k_rotated"):
        heads = f"{name[0]}_normed" if f"{name[0]}_normed" in record else f"{name[0]}_heads"
        if rope is None:
            return NO_ROPE_NOTE, "view", heads
        return (
            f"rotary, pairs named by rearrange '(...) ({ROTARY_PAIRS[rope]})', packed back with einops.pack",
            "new",
            heads,
        )
    origin = _STAGE_ORIGINS.get(name, "")
    order = [stage for stage in _SCORE_STAGES if stage in record]  # the score stages this pass made
    if name in order[1:]:
        parent = order[order.index(name) - 1]
        if "buffers" in record and shares_memory(record["buffers"][name], record["buffers"][parent]):
            return f"{origin}, in place", "view", parent
        return origin, "new", parent
    return origin, "new", None


def stage_tensors(ops, plan: EinsumPlan, record: dict, rope: str | None = None) -> dict[str, StageTensor]:
    """The recorded pipeline tensors as StageTensors, with the view/copy facts measured on them."""
    import einops

    stages = {}
    for name, source in PIPELINE_TENSORS.items():
        if source not in record:  # a variant's stage, and its variant is off
            continue
        tensor, pattern = record[source], plan.stage_views.get(name)
        if name == "merged":
            note, relation = _rearranged(ops, record["merged"], record["context"], plan.merge)
            notes, parent = [note], "context"
        else:
            origin, relation, parent = _provenance(ops, name, record, rope)
            notes = [origin] if origin else []
        if pattern is not None:  # the einsum's layout shown in the contract's axes, for inspection
            tensor = einops.rearrange(tensor, pattern)
            notes.append(f"shown as rearrange '{pattern}' of the einsum's {source}")
        if ops.works_in_place and name in ("scores", "capped_scores", "biased_scores", "masked_scores"):
            notes.append("snapshot: the timed pass updates this buffer in place")
        stages[name] = StageTensor(tensor, STAGE_AXES[name], "; ".join(notes), relation, parent)
    for name, (heads, pattern) in MERGED_PROJECTIONS.items():
        source = stages[heads].value
        tensor = einops.rearrange(source, pattern)  # (B, N, heads*d)
        note, relation = _rearranged(ops, tensor, source, pattern)
        stages[name] = StageTensor(tensor, STAGE_AXES[name], note, relation, heads)
    return {name: stages[name] for name in STAGE_NAMES if name in stages}  # pipeline order
