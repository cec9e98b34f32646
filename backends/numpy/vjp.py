"""The NumPy adapter's backward pass, written by hand in column samples.

The hand-written backward of each head-split strategy of `backends.numpy.layer`, read against the forward it
differentiates; the steps the strategies share (projections, attention, QK-norm, the output) are in `vjp_steps`.

NumPy has no automatic differentiation, so this is the backward a column-sample user
writes. Every projection is ``Y = W @ X + b`` with ``X`` of shape ``(in, tokens)``, and its
gradients are the column-sample formulas::

    dW = dY @ X.T        (out, in): the canonical layout directly, no transpose
    dX = W.T @ dY        (in, tokens)
    db = dY summed over the token columns (and the batch)

In row samples (``y = x @ W_B + b`` with ``W_B = W.T``) the same numbers appear as
``dW_B = x.T @ dy``, the transpose: ``dW_A = (dW_B).T``. Per head, with the scores kept one
column per query, ``S = scale * K^T Q`` ``(Nk, Nq)``, ``A`` = softmax over keys (axis -2)
and ``C = V A`` ``(Dv, Nq)``::

    dA = V^T dC,   dV = dC A^T,   dS = A * (dA - sum over keys of dA * A),
    dQ = scale * K dS,   dK = scale * Q dS^T

and a kv head's ``dK``, ``dV`` are summed over the query heads of its group (GQA).

Each strategy's backward undoes its own forward: STANDARD and DIRECT_RESHAPE reshape the
gradients back the way their forward reshaped the activations (so the direct-reshape
mistake is the exact gradient of the wrong function, and the check catches it against the
oracle's gradients), SLICING writes each head's gradient into its row block, PER_HEAD
gives each head's matrix its own ``dW_h = dQ_h @ X.T`` (row block h of ``dW_q``).

The variants (`core.variants`), each undone in reverse pipeline order, in the same layout:

* the score steps: `frameworks.ops.score_steps_backward` on NumPy's ops object (keys on axis -2),
  which gives each head's sink its gradient per query column, summed here over batch and queries;
  the score bias is added, so its gradient passes through, and each bucket's entry of ``rel_bias``
  sums the score gradients of the (key, query) cells that read it;
* QK-norm: RMSNorm's backward down each token's column (`variants.rms_norm_rows_vjp`), over each
  head's Dk rows or over all the projection's rows (the per-head strategy sums the
  projection's statistics over its heads' row blocks, as its forward does); the weights'
  gradients summed over batch, tokens (and heads).

Half precision follows the forward's policy (`common.NumpyPrecision`): every stage,
forward and backward, is stored in the half type, computed in float32.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams
from mha_rosetta.core.grad import GRAD_STAGE_NAMES

from .._recording import relation_to
from ..base import PreparedVJP, StageTensor, tensor_to_numpy
from ..frameworks.score_parts import part_params
from .heads import _merge_reshape, _split_direct, _split_reshape, rotate_rows  # the forward's own splits, rotation
from .variants import scored_vjp
from .vjp_steps import ColumnVJPSteps


def prepare_numpy_vjp(
    layer_class,
    cfg: MHAConfig,
    params: MHAParams,
    inputs: MHAInputs,
    cotangent,
    precision,
    strategy: str,
    vjp_class=None,
) -> PreparedVJP:
    """Forward+backward of ``strategy`` on a `ColumnSampleMHA` (``layer_class``) built once.

    ``vjp_class`` replaces `ColumnSampleVJP` (the explainer's deliberately wrong GQA backward).
    """
    layer = layer_class(cfg, params, inputs, precision, batched=False)
    vjp = (vjp_class or ColumnSampleVJP)(layer, cotangent)
    run = getattr(vjp, strategy)
    info = {
        "backward": "hand-written, column samples: dW = dY @ X.T, dX = W.T @ dY, db = dY summed",
        "strategy": strategy,
        **layer.precision.info(),
    }
    return PreparedVJP(run=run, to_grads=vjp.to_grads, info=info)


class ColumnSampleVJP(ColumnVJPSteps):
    """The backward of each strategy of a `ColumnSampleMHA`, on its converted arrays."""

    def __init__(self, layer, cotangent: np.ndarray) -> None:
        self.layer = L = layer
        P = L.precision
        self.round = lambda a: P.operand(P.store(a))  # a stage rounded to storage, kept in compute
        # (B, Nq, D) rows -> (B, D, Nq) columns, rounded like every input.
        self.d_out = np.ascontiguousarray(P.operand(P.round_to_storage(cotangent)).transpose(0, 2, 1))  # (B, D, Nq)
        self._begin()

    def _begin(self) -> None:
        """Fresh accumulators for the variant parameters' gradients, which every head adds into (each run)."""
        cfg, compute = self.layer.cfg, self.layer.precision.compute
        # The score parts' parameters (`frameworks.score_parts`), each of its canonical shape (the sinks (H,)).
        self.d_parts = {spec.name: np.zeros(spec.shape(cfg), dtype=compute) for spec in part_params(cfg)}
        rel = cfg.rel_buckets is not None
        self.d_rel_bias = np.zeros((cfg.rel_buckets, cfg.n_heads), dtype=compute) if rel else None  # (buckets, H)
        self.d_norms: dict = {"q": None, "k": None}
        self.d_gate = self.d_gated = None  # the gate's stage gradient; (dX, dW_gate, db_gate) of its projection

    def _variant_grads(self, grads: dict) -> dict:
        """``grads`` with the variant parameters' gradients that this configuration has (canonical shapes)."""
        r, step = self.round, self.layer.norm_step
        # The norm's weights by their MHAParams fields (the registry's `NormStep.weight`), then the score parts'.
        named = {} if step is None else {step.weight(which): self.d_norms[which] for which in ("q", "k")}
        named.update(self.d_parts)
        named["rel_bias"] = self.d_rel_bias
        if self.d_gated is not None:  # X feeds the gate too: its dX adds to the query projection's
            d_x, named["w_gate"], named["b_gate"] = self.d_gated
            grads["d_x_q"] = r(grads["d_x_q"] + d_x)
        grads.update({name: r(d) for name, d in named.items() if d is not None})
        return grads

    # -- building blocks ------------------------------------------------------------------
    def _project(self, w, b, x):
        return self.layer.precision.operand(self.layer._project(w, b, x))

    def _projections(self):
        """The forward's merged q, k and v (`ColumnSampleMHA._projections`), in the compute dtype."""
        return tuple(self.layer.precision.operand(y) for y in self.layer._projections())

    def _rotate(self, heads, which: str, head_axis: bool):
        """The forward's rotary embedding (`ColumnSampleMHA._rotate`), in the compute dtype."""
        return self.layer.precision.operand(self.layer._rotate(heads, which, head_axis))

    def _scored(self, rotated, which: str, head: int | None = None):
        """The forward's steps after rotary ("q", "k") or the value norm ("v") on batched heads (``head`` None) or
        one head's block (`LayerRecording._after_rotary`, `_read_values`), in the compute dtype."""
        L = self.layer
        scored = L._read_values(None, rotated) if which == "v" else L._after_rotary(None, rotated, which, head)
        return L.precision.operand(scored)

    def _unscore(self, which: str, before, d_scored, batched: bool, stages: dict | None = None):
        """`_scored`'s backward (`variants.scored_vjp`), rounded like every stage; the gradient itself without the
        steps. ``stages``: receives the backward stages on the way (the batched heads' gradients, by name)."""
        d, steps = scored_vjp(self.layer, which, before, d_scored, batched, self.round)
        if stages is not None:
            stages.update(steps)
        return d

    def _unrotate(self, d_rotated, which: str, head_axis: bool):
        """The rotary embedding's backward: its transpose, the rotation by minus each angle (sin negated)."""
        L = self.layer
        if L.rotary is None:
            return d_rotated
        cos, sin = L.rotary[which]  # (1|B, r/2, N)
        if head_axis:
            cos, sin = cos[:, None], sin[:, None]  # (1|B, 1, r/2, N): every head alike
        return L.precision.operand(rotate_rows(d_rotated, cos, -sin, L.cfg.rope, L.precision))

    @staticmethod
    def group_sum(d_heads: np.ndarray) -> np.ndarray:
        """(B, Hkv, G, d, N) -> (B, Hkv, d, N): kv head g fed the G query heads of its group; their gradients add up."""
        return d_heads.sum(axis=2)

    # -- batched heads: STANDARD and DIRECT_RESHAPE ----------------------------------------
    def standard(self) -> dict:
        return self._batched(split=_split_reshape, split_back=_merge_reshape)

    def direct_reshape(self) -> dict:
        return self._batched(split=_split_direct, split_back=_unsplit_direct)

    def _batched(self, split, split_back) -> dict:
        L = self.layer
        B, Nq, Nk, H, Hkv, G, Dk, Dv = L.sizes
        self._begin()
        P = L.precision
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        heads = (split(q, H), split(k, Hkv), split(v, Hkv))  # (B, H, Dk, Nq), (B, Hkv, Dk, Nk), (B, Hkv, Dv, Nk)
        q_normed, k_normed = (P.operand(x) for x in L._normed_heads((q, k, v), heads, split))  # heads without qk_norm
        # Rotary (cfg.rope) turns the heads' feature rows; the normed heads themselves without rope.
        q_rotated, k_rotated = self._rotate(q_normed, "q", True), self._rotate(k_normed, "k", True)
        # Llama 4's steps after rotary, Gemma 4's value norm: what the scores and the weighted sum read.
        q_heads = self._scored(q_rotated, "q").reshape(B, Hkv, G, Dk, Nq)  # query head h = g*G + r
        k_heads = self._scored(k_rotated, "k")[:, :, None]  # (B, Hkv, 1, Dk, Nk), shared by the group
        v_heads = self._scored(heads[2], "v")[:, :, None]  # (B, Hkv, 1, Dv, Nk)
        saved, context = self._attend(q_heads, k_heads, v_heads, L.mask, (B, H, Nk, Nq))
        merged = split_back(context.reshape(B, H, Dv, Nq))  # (B, H*Dv, Nq)
        output, d_merged, d_w_o, d_b_o = self._output_and_merged_backward(merged)
        d_context = split(d_merged, H).reshape(B, Hkv, G, Dv, Nq)  # the merge's adjoint is the split
        d_q_rotated, d_k_rotated, d_v_heads, inner = self._attend_backward(q_heads, k_heads, v_heads, saved, d_context)
        # The steps after rotary and the value norm undone (the gradients themselves without them).
        steps: dict = {}  # their backward stages, by name
        d_q_rotated = self._unscore("q", q_rotated, d_q_rotated.reshape(B, H, Dk, Nq), True, steps)  # (B, H, Dk, Nq)
        d_k_rotated = self._unscore("k", k_rotated, self.round(self.group_sum(d_k_rotated)), True, steps)
        d_v_heads = self._unscore("v", P.operand(heads[2]), self.round(self.group_sum(d_v_heads)), True, steps)
        d_q_normed = self._unrotate(d_q_rotated, "q", True)  # the rotation undone: (B, H, Dk, Nq)
        d_k_normed = self._unrotate(d_k_rotated, "k", True)  # (B, Hkv, Dk, Nk)
        # QK-norm undone (the split's adjoint is the merge): (B, H, Dk, Nq) and (B, H*Dk, Nq), likewise for k.
        d_q_heads, d_q = self._unnorm_split("q", q, d_q_normed, H, split, split_back)
        d_k_heads, d_k = self._unnorm_split("k", k, d_k_normed, Hkv, split, split_back)
        d_v = split_back(d_v_heads)  # (B, Hkv*Dv, Nk)
        grads = self._input_grads(d_q, d_k, d_v, {"w_o": d_w_o, "b_o": d_b_o})
        grads["output"] = output
        self._variant_grads(grads)
        d_context = d_context.reshape(B, H, Dv, Nq)  # (B, H, Dv, Nq)
        scores_axes = ("B", "H", "Nk", "Nq")
        # Provenance as in the forward stages: the split and merge adjoints are reshapes (measured view or copy).
        stages = {
            "d_output": StageTensor(self.d_out, ("B", "D", "Nq")),
            **({} if self.d_gate is None else {"d_gate": StageTensor(self.d_gate, ("B", "H*Dv", "Nq"))}),
            "d_merged": StageTensor(d_merged, ("B", "H*Dv", "Nq")),
            "d_context": StageTensor(
                d_context, ("B", "H", "Dv", "Nq"), "", relation_to(d_context, d_merged), "d_merged"
            ),
            "d_weights": StageTensor(inner["d_weights"].reshape(B, H, Nk, Nq), scores_axes),
            "d_v_heads": StageTensor(d_v_heads, ("B", "Hkv", "Dv", "Nk")),
        }
        for name in ("d_biased_scores", "d_capped_scores", "d_scores"):  # the variants' only where present
            if name in inner:
                stages[name] = StageTensor(inner[name].reshape(B, H, Nk, Nq), scores_axes)
        head_axes = {"q": ("B", "H", "Dk", "Nq"), "k": ("B", "Hkv", "Dk", "Nk"), "v": ("B", "Hkv", "Dv", "Nk")}
        stages.update({name: StageTensor(value, head_axes[name[2]]) for name, value in steps.items()})
        stages["d_q_rotated"] = StageTensor(d_q_rotated, ("B", "H", "Dk", "Nq"))
        stages["d_k_rotated"] = StageTensor(d_k_rotated, ("B", "Hkv", "Dk", "Nk"))
        if L.norm_step is not None:
            stages["d_q_normed"] = StageTensor(d_q_normed, ("B", "H", "Dk", "Nq"))
            stages["d_k_normed"] = StageTensor(d_k_normed, ("B", "Hkv", "Dk", "Nk"))
        stages.update(
            d_q_heads=StageTensor(d_q_heads, ("B", "H", "Dk", "Nq")),
            d_k_heads=StageTensor(d_k_heads, ("B", "Hkv", "Dk", "Nk")),
            d_q=StageTensor(d_q, ("B", "H*Dk", "Nq"), "", relation_to(d_q, d_q_heads), "d_q_heads"),
            d_k=StageTensor(d_k, ("B", "Hkv*Dk", "Nk"), "", relation_to(d_k, d_k_heads), "d_k_heads"),
            d_v=StageTensor(d_v, ("B", "Hkv*Dv", "Nk"), "", relation_to(d_v, d_v_heads), "d_v_heads"),
        )
        grads["stages"] = {name: stages[name] for name in GRAD_STAGE_NAMES if name in stages}  # the backward's order
        return grads

    # -- one head at a time: SLICING and PER_HEAD ------------------------------------------
    def slicing(self) -> dict:
        L = self.layer
        B, Nq, Nk, H, Hkv, G, Dk, Dv = L.sizes  # noqa: RUF059 (every size named once)
        self._begin()
        P = L.precision
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        q_normed = [P.operand(x) for x in L._normed_slices(q, H, "q")]  # H x (B, Dk, Nq): row blocks without qk_norm
        k_normed = [P.operand(x) for x in L._normed_slices(k, Hkv, "k")]  # Hkv x (B, Dk, Nk)
        heads = [self._head(h, q_normed, k_normed, v) for h in range(H)]  # per head: saved, context, its slices
        merged = np.concatenate([context for _, context, _, _ in heads], axis=1)  # (B, H*Dv, Nq)
        output, d_merged, d_w_o, d_b_o = self._output_and_merged_backward(merged)
        d_q = np.empty_like(q)  # (B, H*Dk, Nq): every row block written once below (the normed queries' gradient)
        d_k = np.zeros(k.shape, dtype=q.dtype)  # (B, Hkv*Dk, Nk): query heads of a group add into it
        d_v = np.zeros(v.shape, dtype=q.dtype)  # (B, Hkv*Dv, Nk)
        for h, (saved, _, (q_h, k_g, v_g, g), q_rotated) in enumerate(heads):
            d_context = d_merged[:, h * Dv : (h + 1) * Dv]  # (B, Dv, Nq): row block h, a view
            d_q_h, d_k_h, d_v_h, _ = self._attend_backward(q_h, k_g, v_g, saved, d_context)
            d_q[:, h * Dk : (h + 1) * Dk] = self._unrotate(self._unscore("q", q_rotated, d_q_h, False), "q", False)
            d_k[:, g * Dk : (g + 1) * Dk] += d_k_h  # still rotated (and normed after): undone once per kv head below
            d_v[:, g * Dv : (g + 1) * Dv] += d_v_h
        # (B, Hkv, Dk, Nk): what the keys' norm after rotary read (only with it: the backward's time otherwise)
        k_rotated = self._rotate(np.stack(k_normed, 1), "k", True) if L.cfg.qk_norm_after_rope else None
        d_k = self._unscore("k", k_rotated, _split_reshape(self.round(d_k), Hkv), True)
        d_k = self._unrotate(d_k, "k", True)  # (B, Hkv, Dk, Nk)
        d_v = _merge_reshape(self._unscore("v", _split_reshape(v, Hkv), _split_reshape(self.round(d_v), Hkv), True))
        # QK-norm undone on the merged projections (views of row blocks): the queries' and the keys'.
        _, d_q = self._unnorm_split("q", q, _split_reshape(d_q, H), H, _split_reshape, _merge_reshape)
        _, d_k = self._unnorm_split("k", k, d_k, Hkv, _split_reshape, _merge_reshape)
        grads = self._input_grads(d_q, d_k, self.round(d_v), {"w_o": d_w_o, "b_o": d_b_o})
        grads["output"] = output
        return self._variant_grads(grads)

    def _head(self, h: int, q_normed: list, k_normed: list, v):
        """Forward of query head h on its (QK-normed) row-block slices and a row-block view of v."""
        L = self.layer
        Dv, g = L.cfg.d_v, L.cfg.kv_head_of(h)
        q_rotated = self._rotate(q_normed[h], "q", False)  # (B, Dk, Nq), rotated with rope
        q_h = self._scored(q_rotated, "q", h)  # (B, Dk, Nq): the steps after rotary
        k_g = self._scored(self._rotate(k_normed[g], "k", False), "k", g)  # (B, Dk, Nk)
        v_g = self._scored(v[:, g * Dv : (g + 1) * Dv], "v", g)  # (B, Dv, Nk)
        saved, context = self._attend_one(h, q_h, k_g, v_g)
        return saved, context, (q_h, k_g, v_g, g), q_rotated

    def _attend_one(self, h: int, q_h, k_g, v_g):
        L = self.layer
        B, Nq, Nk = L.sizes[:3]
        mask = None if L.mask is None else L.mask.for_head(h)
        return self._attend(q_h, k_g, v_g, mask, (B, Nk, Nq), head=h)

    def per_head(self) -> dict:
        L = self.layer
        B, Nq, Nk, H, Hkv, G, Dk, Dv = L.sizes  # noqa: RUF059 (every size named once)
        self._begin()
        P = L.precision
        k_heads = [self._project(L.w_k_heads[g], L.b_k_heads[g], L.x_k) for g in range(Hkv)]  # Hkv x (B, Dk, Nk)
        v_heads = [self._project(L.w_v_heads[g], L.b_v_heads[g], L.x_v) for g in range(Hkv)]  # Hkv x (B, Dv, Nk)
        q_heads = [self._project(L.w_q_heads[h], L.b_q_heads[h], L.x_q) for h in range(H)]  # H x (B, Dk, Nq)
        k_rotated = [self._rotate(P.operand(k_g), "k", False) for k_g in L._norm_blocks(k_heads, "k")]  # QK-normed
        q_rotated = [self._rotate(P.operand(q_h), "q", False) for q_h in L._norm_blocks(q_heads, "q")]
        # What the scores and the weighted sum read: Llama 4's steps after rotary, Gemma 4's value norm.
        q_scored = [self._scored(q_h, "q", h) for h, q_h in enumerate(q_rotated)]  # H x (B, Dk, Nq)
        k_scored = [self._scored(k_g, "k", g) for g, k_g in enumerate(k_rotated)]  # Hkv x (B, Dk, Nk)
        v_read = [self._scored(P.operand(v_g), "v", g) for g, v_g in enumerate(v_heads)]  # Hkv x (B, Dv, Nk)
        forward = [self._attend_one(h, q_scored[h], k_scored[h // G], v_read[h // G]) for h in range(H)]
        merged = np.concatenate([context for _, context in forward], axis=1)  # (B, H*Dv, Nq)
        output, d_merged, d_w_o, d_b_o = self._output_and_merged_backward(merged)
        d_k_heads = [0.0] * Hkv
        d_v_heads = [0.0] * Hkv
        d_q_heads = []
        for h, (saved, _) in enumerate(forward):
            g = h // G
            d_context = d_merged[:, h * Dv : (h + 1) * Dv]  # (B, Dv, Nq)
            d_q_h, d_k_h, d_v_h, _ = self._attend_backward(q_scored[h], k_scored[g], v_read[g], saved, d_context)
            d_q_heads.append(self._unscore("q", q_rotated[h], d_q_h, False))
            d_k_heads[g] = d_k_heads[g] + d_k_h  # the group's query heads add up
            d_v_heads[g] = d_v_heads[g] + d_v_h
        grads = {"w_o": d_w_o, "b_o": d_b_o, "output": output}
        # The rotations, then QK-norm, undone head by head (over the projection the heads share its statistics).
        d_q_normed = [self._unrotate(d, "q", False) for d in d_q_heads]
        d_k_rotated = [
            self._unscore("k", k_g, self.round(d), False) for k_g, d in zip(k_rotated, d_k_heads, strict=True)
        ]  # the norm after rotary undone per kv head
        d_k_normed = [self._unrotate(d, "k", False) for d in d_k_rotated]
        d_v_heads = [
            self._unscore("v", P.operand(v_g), self.round(d), False) for v_g, d in zip(v_heads, d_v_heads, strict=True)
        ]  # the value norm undone per kv head (rounded, as before, without it)
        # Each head's own matrix W_h (d, in): dW_h = dQ_h @ X.T is row block h of the canonical dW.
        for name, d_ys, x, with_bias in (
            ("q", self._unnorm("q", q_heads, d_q_normed), L.x_q, L.b_q is not None),
            ("k", self._unnorm("k", k_heads, d_k_normed), L.x_k, L.b_k is not None),
            ("v", d_v_heads, L.x_v, L.b_v is not None),
        ):
            w_heads = getattr(L, f"w_{name}_heads")  # (heads, d, in)
            parts = [self._linear_backward(d_y, x, w_heads[i], with_bias) for i, d_y in enumerate(d_ys)]
            grads[f"d_x_{name}"] = self.round(sum(d_x for d_x, _, _ in parts))  # every head read the same X
            grads[f"w_{name}"] = np.concatenate([d_w for _, d_w, _ in parts], axis=0)  # (heads*d, in)
            grads[f"b_{name}"] = np.concatenate([d_b for _, _, d_b in parts]) if with_bias else None
        return self._variant_grads(grads)

    # -- untimed: back to the exchange layout ---------------------------------------------
    @staticmethod
    def to_grads(grads: dict) -> dict:
        out = {}
        for name, value in grads.items():
            if name == "output" or value is None:
                continue
            if name == "stages":
                out[name] = value
            elif name.startswith("d_x_"):
                out[name] = tensor_to_numpy(value).transpose(0, 2, 1)  # (B, F, N) columns -> (B, N, F) rows, a view
            else:
                out[name] = tensor_to_numpy(value)
        return out


def _unsplit_direct(x: np.ndarray) -> np.ndarray:
    """The inverse of `_split_direct`: (B, H, d, N) -> (B, H*d, N), putting every cell back."""
    B, heads, d, N = x.shape
    rows = x.transpose(0, 1, 3, 2).reshape(B, N, heads * d)  # (B, N, H*d), copy
    return rows.transpose(0, 2, 1)  # (B, H*d, N), view
