"""The einops convention: einsum and rearrange keep ``(N, h, d_k)``; no axis is ever swapped by hand.

Every contraction names its axes, and the einsum output spec says where each axis
goes, so the heads never need the transpose that the reshape + transpose convention
spends on them. Single-letter axis names, used everywhere below::

    b batch   n / q query tokens   s key tokens   d input features
    h query head   g kv head   r query head within its group (query head h = g*G + r)
    k d_k   v d_v   c merged context features (H*Dv)   o d_model (output)

The pipeline (plain MHA)::

    q        = einsum("b n d, h k d -> b n h k")          # weight rearranged once, "(h k) d -> h k d"
    k        = einsum("b n d, h k d -> b n h k")
    v        = einsum("b n d, h v d -> b n h v")
    scores   = einsum("b q h k, b s h k -> b h q s")
    context  = einsum("b h q s, b s h v -> b q h v")
    merged   = rearrange("b q h v -> b q (h v)")          # a reshape: no axis moves
    output   = einsum("b q c, o c -> b q o")

With grouped kv heads (GQA) the query-head axis is split as (g, r): g the kv head it
reads, r its place in the group (query head h = g*G + r)::

    q        = einsum("b n d, g r k d -> b n g r k")      # weight "(g r k) d -> g r k d"
    scores   = einsum("b q g r k, b s g k -> b g q r s")  # kv head g is shared by its r query heads
    context  = einsum("b g q r s, b s g v -> b q g r v")
    merged   = rearrange("b q g r v -> b q (g r v)")

Rotary embeddings (``cfg.rope``) name the feature pairs in a rearrange pattern: "half"
splits the head's features as ``(two k)`` (feature ``i`` and ``i + r/2``), "interleaved"
as ``(k two)`` (features ``2i`` and ``2i + 1``); the turned pairs are packed back with
``einops.pack`` and merged by the inverse pattern. Partial rotary splits off the
features past ``r`` with ``einops.unpack``. No axis moves::

    pairs    = rearrange("b n h (k two) -> b n h k two")     # interleaved; "(two k)" for half

The variants name their axes the same way. QK-norm takes the mean of squares with
``einops.reduce``: over ``k`` per head (``"head"``: ``"b n h k -> b n h 1"``) or over the whole
projection, ``(h k)`` (``"projection"``: ``"b n h k -> b n 1 1"``, its weight split as the bias
is, ``"(h k) -> h k"``). The sinks are split to broadcast against the scores (``"h -> 1 h 1 1"``,
``"(g r) -> g r"`` once, then ``"g r -> 1 g 1 r 1"``). ALiBi's bias is made in NumPy at prepare time
(`core.variants.alibi_bias`) and laid out like the mask; T5's table is gathered by bucket
inside the pass (so its gradient flows) and the gathered ``(b, q, s, h)`` is put in the
scores' layout by one named rearrange, ``"b q s h -> b h q s"`` (under GQA the table is split
``"n (g r) -> n g r"`` first and the gather read ``"b q s g r -> b g q r s"``): the only
rearrange of the forward pass that moves an axis, on a bias whose gather puts the head last.

The same code runs on NumPy, torch and JAX arrays: ``einops.einsum`` and
``einops.rearrange`` dispatch on the array type. Scaling, masking and the softmax need
a few library ops: each library's ops object of the framework layer (`frameworks.ops`,
the one every adapter runs its score steps through), which also does the in-place updates
where the library allows them. In the forward pass every rearrange but the relative bias's only splits or merges
neighbouring axes (a reshape), and every change of axis order is an einsum output spec. The GQA scores are
laid out ``(b, g, q, r, s)``, the order a batched matmul over (b, g) produces, so no
library has to reorder the largest tensor after computing it. A test reads this
module's source to prove it calls no transpose, permute, swapaxes or ``.T``.

NumPy: ``einops.einsum`` calls ``np.einsum`` without ``optimize``, which runs NumPy's C
loops (measured several times slower than BLAS: docs/notes/backends-measurements.md). `NumpyOps.einsum` calls ``np.einsum``
itself with the contraction path given explicitly (two operands have one path), which
sends each contraction through NumPy's batched matmul. NumPy has no bfloat16
arithmetic of its own: with ml_dtypes bfloat16 each einsum and the softmax run in
float32 on upcast operands and their results are rounded back (recorded in
``Prepared.info``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, rotary_tables

from .._layouts import TOKENS_FIRST_STAGE_AXES
from ..frameworks.ops import temperature_factors
from ..jax.common import VARIANT_STAGE_AXES


@dataclass(frozen=True)
class EinsumPlan:
    """Every einops pattern of one pipeline layout, as data."""

    name: str
    weight_q: str  # canonical (out, in) query weight -> per-head weight
    bias_q: str
    weight_kv: str  # the same for the key and value weights (kv heads)
    bias_kv: str
    project_q: str
    project_k: str
    project_v: str
    scores: str
    context: str
    merge: str
    mask: str  # combined mask (b, h, q, s) -> the layout of the scores
    heads_q: str  # the axes of q before its features, for the rotary patterns
    heads_kv: str  # the same for k
    table_q: str  # rotary table (b, n, r/2) -> broadcastable against q
    table_kv: str  # the same against k
    sink: str  # sinks, (H,) or split (Hkv, G) by `layer.canonical_weights` -> broadcastable against the scores
    rel_bias: str  # T5's table (split (n, Hkv, G) under GQA) gathered by bucket -> the scores' layout
    # stage name -> rearrange to the stage's axes, for the stages this layout holds in other
    # axes than the contract's; every other stage is shown as the pipeline holds it.
    stage_views: dict[str, str]


# Plain MHA: the head axis h as it is.
MHA_PLAN = EinsumPlan(
    name="mha",
    weight_q="(h k) d -> h k d",
    bias_q="(h k) -> h k",
    weight_kv="(h k) d -> h k d",
    bias_kv="(h k) -> h k",
    project_q="b n d, h k d -> b n h k",
    project_k="b n d, h k d -> b n h k",
    project_v="b n d, h v d -> b n h v",
    scores="b q h k, b s h k -> b h q s",
    context="b h q s, b s h v -> b q h v",
    merge="b q h v -> b q (h v)",
    mask="b h q s -> b h q s",
    heads_q="b n h",
    heads_kv="b n h",
    table_q="b n k -> b n 1 k",
    table_kv="b n k -> b n 1 k",
    sink="h -> 1 h 1 1",
    rel_bias="b q s h -> b h q s",
    stage_views={},
)

# GQA: the query-head axis split as (g, r), g the kv head it reads, r its place in the group.
# The scores are (b, g, q, r, s): the order a batched matmul over (b, g) produces.
GQA_PLAN = EinsumPlan(
    name="gqa",
    weight_q="(g r k) d -> g r k d",
    bias_q="(g r k) -> g r k",
    weight_kv="(g k) d -> g k d",
    bias_kv="(g k) -> g k",
    project_q="b n d, g r k d -> b n g r k",
    project_k="b n d, g k d -> b n g k",
    project_v="b n d, g v d -> b n g v",
    scores="b q g r k, b s g k -> b g q r s",
    context="b g q r s, b s g v -> b q g r v",
    merge="b q g r v -> b q (g r v)",
    mask="b (g r) q s -> b g q r s",
    heads_q="b n g r",
    heads_kv="b n g",
    table_q="b n k -> b n 1 1 k",
    table_kv="b n k -> b n 1 k",
    sink="g r -> 1 g 1 r 1",
    rel_bias="b q s g r -> b g q r s",
    stage_views={
        "q_heads": "b n g r k -> b n (g r) k",
        "q_normed": "b n g r k -> b n (g r) k",
        "q_rotated": "b n g r k -> b n (g r) k",
        "q_rotated_normed": "b n g r k -> b n (g r) k",  # Llama 4's norm after rotary
        "q_tempered": "b n g r k -> b n (g r) k",  # and its temperature
        "scores": "b g q r s -> b (g r) q s",
        "capped_scores": "b g q r s -> b (g r) q s",
        "biased_scores": "b g q r s -> b (g r) q s",
        "masked_scores": "b g q r s -> b (g r) q s",
        "weights": "b g q r s -> b (g r) q s",
        "context": "b q g r v -> b q (g r) v",
    },
)

OUTPUT = "b q c, o c -> b q o"

# The projection einsums write the heads directly, so the contract's merged q, k and v
# (B, N, heads*d) are made here from the heads stages, in both plans: stage -> (heads
# stage, rearrange). A merge of neighbouring axes, so a view where the heads allow it.
MERGED_PROJECTIONS = {
    "q": ("q_heads", "b n h k -> b n (h k)"),
    "k": ("k_heads", "b n g k -> b n (g k)"),
    "v": ("v_heads", "b n g v -> b n (g v)"),
}

# Every other stage: the pipeline tensor it is read from, its own name but for the heads,
# which the projection einsums write as q, k and v.
PIPELINE_TENSORS = {name: name for name in TOKENS_FIRST_STAGE_AXES if name not in MERGED_PROJECTIONS}
PIPELINE_TENSORS.update(q_heads="q", k_heads="k", v_heads="v")
# The variants' stages, recorded under their own names when their variant is on.
PIPELINE_TENSORS.update({name: name for name in VARIANT_STAGE_AXES})

# Tokens first, heads after them, as the einsum output specs write them (the variants'
# stages too; `stage_tensors` returns those of the configuration, `jax.common.tokens_first_axes`).
STAGE_AXES = {**TOKENS_FIRST_STAGE_AXES, **VARIANT_STAGE_AXES}


def plan_for(cfg: MHAConfig) -> EinsumPlan:
    """The plain-MHA patterns, or the (g, r) patterns for grouped kv heads.

    One set would do for both (r of size 1), but a unit axis costs XLA a full copy of
    the scores, so plain MHA keeps its single head axis.
    """
    return MHA_PLAN if cfg.group_size == 1 else GQA_PLAN


def axis_sizes(pattern: str, sizes: dict[str, int]) -> dict[str, int]:
    """The axis lengths einops needs for ``pattern`` (it rejects lengths of axes the pattern lacks)."""
    names = set(pattern.replace("(", " ").replace(")", " ").replace("->", " ").split())
    return {name: size for name, size in sizes.items() if name in names}


def position_tables(ops, cfg: MHAConfig, inputs, plan: EinsumPlan, dtype: str) -> dict | None:
    """The tables of the tokens' positions, laid out against the heads by ``plan``'s patterns, as the library's
    arrays, each a tuple with the tokens on axis 1: ``"rotary"`` (q_cos, q_sin, k_cos, k_sin) (1|B, N, 1[, 1], r/2)
    with rope; ``"temper"`` (Llama 4's factors (1|B, Nq, 1[, 1], 1), in at least float32) with the temperature.
    None when there are neither. ``inputs``: positions and kv_positions (a decode run's: every position, once)."""
    import einops

    tables = {}
    rotary = rotary_tables(cfg, inputs)
    if rotary is not None:
        q_layout = [einops.rearrange(table, plan.table_q) for table in (rotary.q_cos, rotary.q_sin)]
        k_layout = [einops.rearrange(table, plan.table_kv) for table in (rotary.k_cos, rotary.k_sin)]
        tables["rotary"] = tuple(ops.asarray(table) for table in (*q_layout, *k_layout))  # against q and k
    temper = temper_table(ops, cfg, inputs.positions, plan, dtype)
    if temper is not None:
        tables["temper"] = temper
    return tables or None


def temper_table(ops, cfg: MHAConfig, positions, plan: EinsumPlan, dtype: str) -> tuple | None:
    """``(factors,)``: the temperature's factors of the query ``positions`` (1|B, Nq) laid out against the query
    heads by ``plan`` (1|B, Nq, 1[, 1], 1), the library's array in at least float32; None without it."""
    import einops

    factors = temperature_factors(cfg, positions)  # (1|B, Nq) float64
    if factors is None:
        return None
    laid_out = einops.rearrange(factors[..., None], plan.table_q)  # (1|B, Nq, 1[, 1], 1)
    return (ops.asarray(laid_out.astype(np.float64 if dtype == "float64" else np.float32), cast=False),)
