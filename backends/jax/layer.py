"""The JAX convention: one head written unbatched, ``jax.vmap`` over heads and batch, ``jax.jit``.

This is how equinox writes attention: the single-head function below sees
``q (Nq, Dk)``, ``k (Nk, Dk)``, ``v (Nk, Dv)`` and ``allowed (Nq, Nk)`` and knows
nothing of heads or batches. ``jax.vmap`` adds the head axes, then the batch axis, and
``jax.jit`` compiles the whole forward pass into one XLA program. Projections are
row samples, ``x @ W.T + b``, with the canonical ``(out, in)`` weights as they are.

Plain MHA is one vmap over the heads. Grouped-query attention (GQA) is a double vmap,
not a repeat of the kv heads: the projected queries ``(Nq, H*Dk)`` are reshaped to
``(Nq, Hkv, G, Dk)`` (G = H // Hkv, so query head ``h = g*G + r``). The inner vmap
maps over the G query heads of one group with that group's k and v unmapped
(``in_axes=None``: shared, not copied); the outer vmap maps over the Hkv groups with
k and v mapped. Query head ``h`` therefore reads kv head ``h // G``, the grouping of
torch's ``enable_gqa`` and ``jax.nn.dot_product_attention``. (With G = 1 the double
vmap computes the same numbers, but XLA then copies the whole score tensor once more.)

The rotary embedding (``cfg.rope``) is written the same way: `_rotate_one_head` turns the
features of one head, ``x (N, Dk)`` with tables ``(N, r/2)``, and is vmapped over the
heads of q and of k (the tables unmapped: every head sees the same angles).

The variants (`core.variants`) are written the same way. The output gate (``attn_output_gate``) is one
item's ``sigmoid(x_q @ w_gate.T + b_gate)`` ``(Nq, H*Dv)``, laid out like the merged heads (its columns
h*Dv:(h+1)*Dv gate head h), multiplied in before ``w_o``; a decode step's items are its own tokens.
The norm before rotary (QK-norm: the registry's `norm_step`, `common.normed_heads`) normalises the merged
projection ``(N, H*Dk)`` before the split (place ``"projection"``) or the heads ``(N, H, Dk)`` after it
(``"head"``). Everything a head owns travels with it through the
head vmaps in one dict: its score parts (its sink logit), its ALiBi slope and its column of T5's table
(``rel_bias.T`` (H, buckets)), each ``(H, ...)`` and mapped on axis 0 (``(Hkv, G, ...)`` under GQA); the per-item tables
(ALiBi's distances, T5's buckets) are mapped by the batch vmap only. `_attend_one_head` then
runs the score steps on JAX's ops object (`frameworks.ops.score_steps`), in the order of the stages.
Which variants are on is read from the static config, never from a traced value.

Every head axis is mapped where it lies (``in_axes=1``: tokens stay first), and the
context comes back with ``out_axes=1`` as ``(Nq, H, Dv)``, so neither the head split nor
the merge needs a transpose: both are reshapes. Where XLA puts things in memory is its
own business (the stage notes say "XLA-managed layout").
"""

from __future__ import annotations

import dataclasses
from functools import partial

from mha_rosetta.core import MHAConfig, MHAInputs, linear, stage_names
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES

from .._layouts import TOKENS_FIRST_STAGE_AXES, XLA_LAYOUT
from ..frameworks.ops import STEP_HOW, after_rotary, read_values, score_steps
from ..frameworks.ops_jax import TRACED_OPS
from ..frameworks.score_parts import picked_parts, score_parts
from .chunked import pad_mask_to_blocks
from .common import (
    allowed_for_heads,
    normed_heads,
    numpy_rotary_tables,
    output_gate,
    rotate_last_axis,
    score_bias_inputs,
    to_jax,
)

# The score-like results of `_attend_one_head` (head axis first from the vmap, (H, Nq, Nk));
# the context keeps tokens first, (Nq, H, Dv), so that merging heads is a reshape.
_SCORE_STAGES = ("scores", *SCORE_VARIANT_STAGES, "masked_scores", "weights")


def _head_out_axes(cfg: MHAConfig) -> dict[str, int]:
    """Where the head vmaps put the head axis of each result of `_attend_one_head` for ``cfg``."""
    present = set(stage_names(cfg))
    return {**{name: 0 for name in _SCORE_STAGES if name in present}, "context": 1}


# The axes of the 2017-23 stages as `_mha_one_item` returns them (batched by the outer vmap):
# tokens first, heads after them, so that the split and the merge are reshapes. A
# configuration's own list, the variants' stages included, is `common.tokens_first_axes(cfg)`.
STAGE_AXES = TOKENS_FIRST_STAGE_AXES

STAGE_NOTES = {
    "q": f"x_q @ w_q.T + b_q; {XLA_LAYOUT}",
    "q_heads": f"reshape of q to (Nq, H, Dk) (then (Nq, Hkv, G, Dk) under GQA); vmap maps axis 1, no transpose; {XLA_LAYOUT}",
    "k_heads": f"reshape of k; vmap maps axis 1; {XLA_LAYOUT}",
    "v_heads": f"reshape of v; vmap maps axis 1; {XLA_LAYOUT}",
    "q_rotated": f"_rotate_one_head vmapped over the heads (in_axes=1, out_axes=1); {XLA_LAYOUT}",
    "k_rotated": f"_rotate_one_head vmapped over the kv heads; {XLA_LAYOUT}",
    "q_normed": f"RMSNorm (x * rsqrt(mean(x**2) + eps) * w) over the last axis; {XLA_LAYOUT}",
    "k_normed": f"RMSNorm of the keys, the same way; {XLA_LAYOUT}",
    "capped_scores": f"{STEP_HOW['capped_scores']} per head; {XLA_LAYOUT}",
    "biased_scores": f"{STEP_HOW['biased_scores']} per head, rel_bias.T[h] gathered by bucket; {XLA_LAYOUT}",
    "scores": f"vmap out_axes=0 puts heads first; {XLA_LAYOUT}",
    "context": f"vmap out_axes=1 keeps tokens first; {XLA_LAYOUT}",
    "merged": f"reshape of context (Nq, H, Dv) -> (Nq, H*Dv), no transpose; {XLA_LAYOUT}",
    "gate": f"jax.nn.sigmoid(x_q @ w_gate.T + b_gate) per item (batch vmap): w_o reads merged * gate; {XLA_LAYOUT}",
}


def _attend_one_head(q, k, v, allowed, head, item, *, cfg: MHAConfig):
    """Attention of one head, unbatched: q (Nq, Dk), k (Nk, Dk), v (Nk, Dv), allowed (Nq, Nk) or None.

    ``head``: what this head owns (its score parts by keyword (), ``slope`` (), ``rel`` (buckets,)), the entries
    its variants need; ``item``: this batch item's tables (``distance`` (Nq, Nk), ``bucket`` (Nq, Nk)).
    """
    # Scaling q costs Nq*Dk multiplies instead of Nq*Nk on the scores (equinox and flax do the same).
    scores = (q * cfg.scale) @ k.T  # (Nq, Nk)
    stages = {"scores": scores}
    bias = None
    if cfg.has_score_bias:
        bias = 0.0
        if "slope" in head:  # a distance's slope (`score_parts.distance_slopes`: ALiBi's)
            bias = head["slope"] * item["distance"]  # (Nq, Nk): m_h (p_j - p_i)
        if cfg.rel_buckets is not None:
            bias = bias + head["rel"][item["bucket"]]  # (Nq, Nk): a gather of this head's bucket column
    blocked = None if allowed is None else ~allowed  # the JAX convention masks by what is allowed

    def keep(name, value, parent, before):
        stages[name] = value

    parts = picked_parts(cfg, head)  # this head's score parts, scalars
    weights = score_steps(TRACED_OPS, cfg, scores, bias=bias, blocked=blocked, **parts, on_stage=keep)
    context = weights @ v  # (Nq, Dv)
    return {**stages, "context": context}


def head_owned(cfg: MHAConfig, params: dict, score_tables: dict) -> dict:
    """What each query head owns for `_attend_one_head`, every entry (H, ...): the score parts by keyword
    (`frameworks.score_parts`, each (H,) as it is: the head vmap lays it out), the distances' slopes (ALiBi's, where
    ``score_tables`` has them: `common.score_bias_inputs`), and T5's table as
    ``rel_bias.T`` (H, buckets) (a transpose inside the traced pass: its gradient flows back)."""
    head = score_parts(cfg, params, lambda value: value)  # (H,) each
    if "slopes" in score_tables:
        head["slope"] = score_tables["slopes"]  # (H,)
    if cfg.rel_buckets is not None:
        head["rel"] = params["rel_bias"].T  # (buckets, H) -> (H, buckets)
    return head


def _rotate_one_head(x, cos, sin, *, style: str):
    """The rotary embedding of one head, unbatched: x (N, Dk), cos and sin (N, r/2)."""
    return rotate_last_axis(x, cos, sin, style)


def _rotate_heads(heads, cos, sin, *, style: str | None):
    """`_rotate_one_head` vmapped over the head axis of (N, heads, Dk); the heads themselves without rope."""
    import jax

    if style is None:
        return heads
    return jax.vmap(partial(_rotate_one_head, style=style), in_axes=(1, None, None), out_axes=1)(heads, cos, sin)


def _attend_all_heads(q_heads, k_heads, v_heads, allowed, head, item, *, cfg: MHAConfig, head_mask_axis: int | None):
    """`_attend_one_head` vmapped over every query head.

    q_heads (Nq, H, Dk), k_heads (Nk, Hkv, Dk), v_heads (Nk, Hkv, Dv), the rotated ones where rope is on;
    ``head`` (`head_owned`) mapped with the query heads, ``item`` shared by them.

    Returns scores-like stages (H, Nq, Nk) and the context (Nq, H, Dv).
    """
    import jax

    n_q, n_k = q_heads.shape[0], k_heads.shape[0]
    H, Hkv, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v
    one_head = partial(_attend_one_head, cfg=cfg)
    out_axes = _head_out_axes(cfg)
    if G == 1:
        # Plain MHA: one vmap, every head with its own k and v. (A double vmap with G = 1
        # would compute the same numbers but costs XLA a copy of the scores.)
        over_heads = jax.vmap(one_head, in_axes=(1, 1, 1, head_mask_axis, 0, None), out_axes=out_axes)
        return over_heads(q_heads, k_heads, v_heads, allowed, head, item)
    q_heads = q_heads.reshape(n_q, Hkv, G, Dk)  # (Nq, Hkv, G, Dk): query head h = g*G + r
    head = {name: value.reshape(Hkv, G, *value.shape[1:]) for name, value in head.items()}  # (Hkv, G, ...)
    # Inner vmap: the G query heads of one group share that group's k and v (in_axes None).
    over_group = jax.vmap(one_head, in_axes=(1, None, None, head_mask_axis, 0, None), out_axes=out_axes)
    # Outer vmap: the Hkv groups, each with its own k and v.
    over_groups = jax.vmap(over_group, in_axes=(1, 1, 1, head_mask_axis, 0, None), out_axes=out_axes)
    heads = over_groups(
        q_heads, k_heads, v_heads, allowed, head, item
    )  # scores (Hkv, G, Nq, Nk), context (Nq, Hkv, G, Dv)
    # (XLA:CPU still copies the GQA scores once to reorder them; the plain-MHA path does not.)
    stages = {name: heads[name].reshape(H, n_q, n_k) for name in out_axes if name != "context"}  # (H, Nq, Nk)
    return {**stages, "context": heads["context"].reshape(n_q, H, Dv)}  # context (Nq, H, Dv)


def _mha_one_item(
    params,
    x_q,
    x_k,
    x_v,
    allowed,
    tables,
    score_tables,
    *,
    cfg: MHAConfig,
    head_mask_axis: int | None,
    attend=None,
    sum_squares=None,
):
    """Every stage for one batch item: x_q (Nq, D), x_k (Nk, kdim), x_v (Nk, vdim).

    ``allowed`` is None, (Nq, Nk) shared by all heads (head_mask_axis None), or per head
    (head_mask_axis 0): (H, Nq, Nk) without GQA, (Hkv, G, Nq, Nk) with it. ``tables`` is
    None or the rotary (q_cos, q_sin, k_cos, k_sin) of this item, (N, r/2) each.
    ``score_tables``: the score bias's tables of this item (`common.score_bias_inputs`; an
    empty dict without ALiBi or relative bias). ``attend`` replaces `_attend_all_heads` (the
    chunked strategy's, which returns the context only). ``sum_squares``: see `common.normed_heads`.
    """
    n_q, n_k = x_q.shape[0], x_k.shape[0]
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    q = linear(x_q, params["w_q"], params["b_q"])  # (Nq, H*Dk)
    k = linear(x_k, params["w_k"], params["b_k"])  # (Nk, Hkv*Dk)
    v = linear(x_v, params["w_v"], params["b_v"])  # (Nk, Hkv*Dv); bias="qkv": b_o is None below
    q_heads = q.reshape(n_q, H, Dk)  # (Nq, H, Dk)
    k_heads = k.reshape(n_k, Hkv, Dk)  # (Nk, Hkv, Dk)
    v_heads = v.reshape(n_k, Hkv, Dv)  # (Nk, Hkv, Dv)
    normed = normed_heads(cfg, params, q, k, q_heads, k_heads, sum_squares)  # the norm before rotary's, or {}
    q_normed, k_normed = normed.get("q_normed", q_heads), normed.get("k_normed", k_heads)
    q_cos, q_sin, k_cos, k_sin = (None,) * 4 if tables is None else tables
    q_rotated = _rotate_heads(q_normed, q_cos, q_sin, style=cfg.rope)  # (Nq, H, Dk)
    k_rotated = _rotate_heads(k_normed, k_cos, k_sin, style=cfg.rope)  # (Nk, Hkv, Dk)
    # Llama 4's steps after rotary and Gemma 4's value norm (frameworks.ops, JAX's ops object), features last;
    # the temperature's factors (Nq,) are this item's (`common.score_bias_inputs`, a decode step's extras).
    steps: dict = {}
    factors = score_tables["temper"][:, None, None] if "temper" in score_tables else None  # (Nq, 1, 1)

    def on_stage(name, value, parent):  # each step's stage, by name
        steps[name] = value

    q_scored = after_rotary(TRACED_OPS, cfg, q_rotated, "q", factors, on_stage=on_stage)  # (Nq, H, Dk)
    k_scored = after_rotary(TRACED_OPS, cfg, k_rotated, "k", on_stage=on_stage)  # (Nk, Hkv, Dk)
    v_read = read_values(TRACED_OPS, cfg, v_heads, on_stage=on_stage)  # (Nk, Hkv, Dv)
    head = head_owned(cfg, params, score_tables)
    item = {name: value for name, value in score_tables.items() if name not in ("slopes", "temper")}
    attend = _attend_all_heads if attend is None else attend
    heads = attend(q_scored, k_scored, v_read, allowed, head, item, cfg=cfg, head_mask_axis=head_mask_axis)
    merged = heads["context"].reshape(n_q, H * Dv)  # (Nq, H*Dv): head h in columns h*Dv:(h+1)*Dv
    gated = output_gate(x_q, params, merged) if cfg.attn_output_gate else {}  # (Nq, H*Dv) each: this item's tokens'
    output = linear(gated.pop("gated", merged), params["w_o"], params["b_o"])  # (Nq, D)
    stages = dict(q=q, k=k, v=v, q_heads=q_heads, k_heads=k_heads, v_heads=v_heads, **normed)
    stages.update(q_rotated=q_rotated, k_rotated=k_rotated, **steps)
    return {**stages, **heads, "merged": merged, **gated, "output": output}


def cached_heads(cfg: MHAConfig, stages: dict) -> tuple:
    """What a decode cache holds of `_mha_one_item`'s stages: (the keys the scores read, the values the weighted
    sum reads): the rotated keys, normed after rotary with qk_norm_after_rope; the values, normed with value_norm."""
    keys = stages["k_rotated_normed" if cfg.qk_norm_after_rope else "k_rotated"]
    return keys, stages["v_normed" if cfg.value_norm else "v_heads"]


def mask_for_vmap(cfg: MHAConfig, inputs: MHAInputs):
    """The combined mask shaped for the vmaps, with the in_axes that go with it.

    Returns ``(allowed, batch_axis, head_axis)``: a mask shared by every batch item or
    every head is passed once and left unmapped (``None``) instead of being broadcast.
    """
    allowed = allowed_for_heads(cfg, inputs)  # (B|1, H|1, Nq, Nk) or None
    if allowed is None:
        return None, None, None
    batch, heads, n_q, n_k = allowed.shape
    if heads == 1:
        allowed, head_axis = allowed[:, 0], None  # (B|1, Nq, Nk)
    elif cfg.group_size == 1:
        head_axis = 0  # (B|1, H, Nq, Nk): one vmap over heads
    else:
        allowed, head_axis = (
            allowed.reshape(batch, cfg.n_kv_heads, cfg.group_size, n_q, n_k),
            0,
        )  # (B|1, Hkv, G, Nq, Nk)
    if batch == 1:
        return allowed[0], None, head_axis
    return allowed, 0, head_axis


def batched_tables(tables: tuple | None) -> tuple:
    """The rotary tables (1|B, N, r/2) and their batch in_axes; a table shared by every item is passed unmapped.

    Give it NumPy tables, before they go to the device: ``table[0]`` is then a view, where on a JAX
    array it is an eager gather that JAX compiles for every new shape (measured in jax-sharded's mesh
    worker on the default check, warm: 1.4 s of its 3.1 s building 112 cases, 44 gathers compiled).
    """
    if tables is None:
        return None, None
    shared = [table.shape[0] == 1 for table in tables]
    return (
        tuple(table[0] if one else table for table, one in zip(tables, shared, strict=True)),
        tuple(None if one else 0 for one in shared),
    )


def vmapped_pass(cfg: MHAConfig, inputs: MHAInputs, dtype: str, target, attend=None, chunk=None, attend_extras=None):
    """Every stage vmapped over heads and batch, the output-only forward, its extra arguments on
    ``target``, and the key that names this program (`common.shared_program`).

    The extras are the mask, the rotary tables and the score bias's tables:
    ``forward(params, x_q, x_k, x_v, *extras)``. ``attend`` and ``chunk``: the chunked strategy's
    attention step (a partial whose keywords say everything it closes over) and its blocks, from
    `chunked.chunked_attention`, and ``attend_extras`` its per-item tables with their batch axes
    (`chunked.chunked_tables`), passed in place of the score bias's tables.
    """
    import jax

    if attend is not None and chunk is None:
        raise ValueError("vmapped_pass: attend (the chunked step) needs the chunk it was made for; got chunk=None")

    # The chunked step computes causality and the window per tile: its mask is the user's only.
    mask_cfg = cfg if attend is None else dataclasses.replace(cfg, causal=False, window=None)
    allowed, batch_axis, head_axis = mask_for_vmap(mask_cfg, inputs)
    if attend is not None:
        allowed = pad_mask_to_blocks(allowed, inputs, chunk)
    tables, table_axes = batched_tables(numpy_rotary_tables(cfg, inputs))
    tables = None if tables is None else tuple(to_jax(table, dtype, target) for table in tables)
    score_tables, score_axes = score_bias_inputs(cfg, inputs, dtype) if attend is None else attend_extras
    score_tables = {name: to_jax(value, None, target) for name, value in score_tables.items()}
    one_item = partial(_mha_one_item, cfg=cfg, head_mask_axis=head_axis, attend=attend)
    all_stages = jax.vmap(one_item, in_axes=(None, 0, 0, 0, batch_axis, table_axes, score_axes))

    def forward(params, x_q, x_k, x_v, allowed, tables, score_tables):
        # Unused stages are dead code to XLA: the compiled forward computes only the output.
        return all_stages(params, x_q, x_k, x_v, allowed, tables, score_tables)["output"]

    # What the closures capture: the config, the chunked step's keywords (its blocks and whether it skips tiles
    # by index), and the vmap axes (from the mask and table shapes).
    axes = tuple(sorted(score_axes.items()))
    attend_key = None if attend is None else tuple(sorted(attend.keywords.items()))
    key = ("jax.layer", cfg, attend_key, batch_axis, head_axis, table_axes, axes)
    return all_stages, forward, (to_jax(allowed, None, target), tables, score_tables), key
