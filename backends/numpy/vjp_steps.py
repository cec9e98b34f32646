"""The backward of the steps every strategy of the NumPy layer shares, by hand in column samples
(`ColumnVJPSteps`, a part of `vjp.ColumnSampleVJP`): the projections ``Y = W @ X + b``, one head's or every head's
attention (scores, the score steps, the weighted sum), T5's bucket gradients, QK-norm, the output and its gate.

The formulas are `vjp`'s (its module docstring); each strategy there joins these steps in its own head split.
"""

from __future__ import annotations

import numpy as np

from ..frameworks.ops import score_steps, score_steps_backward
from ..frameworks.score_parts import softmax_part
from .variants import gate_logits_vjp, rms_norm_rows_vjp


def _swap(a: np.ndarray) -> np.ndarray:
    return a.swapaxes(-1, -2)  # a transposed view


class ColumnVJPSteps:
    """The shared backward steps of `vjp.ColumnSampleVJP` (a mixin: ``self.layer`` is the forward's
    `layer.ColumnSampleMHA`; ``self.round``, the variant gradients' accumulators and `_project` are the VJP's)."""

    def _linear_backward(self, d_y, x, w, with_bias: bool):
        """Y = W @ X + b per batch item: (dX, dW, db) with dW = sum_b dY @ X.T, dX = W.T @ dY."""
        r = self.round
        d_w = r(np.matmul(d_y, _swap(x)).sum(axis=0))  # (out, in): one dY @ X.T per batch item, summed
        d_x = r(np.matmul(_swap(w), d_y))  # (B, in, N)
        d_b = r(d_y.sum(axis=(0, 2))) if with_bias else None  # (out,): over batch and token columns
        return d_x, d_w, d_b

    def _attend(self, q, k, v, mask, scores_shape, head: int | None = None):
        """Forward of one head or of every head, column samples: returns (saved, context).

        q (..., Dk, Nq), k (..., Dk, Nk), v (..., Dv, Nk) broadcast together; ``mask`` is a
        `MaskArrays` for the scores viewed as ``scores_shape`` ((B, H, Nk, Nq) with ``head`` None,
        or (B, Nk, Nq) for query head ``head``). ``saved`` is what `_attend_backward` reads: the
        weights (..., Nk, Nq), what the score steps saved for their backward, the head and the scores' shape.
        """
        r, L = self.round, self.layer
        cfg, V = L.cfg, L.variants
        shape = (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), k.shape[-1], q.shape[-1])
        scores = r(cfg.scale * np.matmul(_swap(k), q)).reshape(scores_shape)  # (..., Nk, Nq)
        steps: dict = {}  # the weights and each step's input its backward reads
        blocked, empty = (None, None) if mask is None else (mask.blocked, mask.empty_rows)
        bias, parts = V.head_bias(head), V.head_parts(head)
        weights = score_steps(
            L.ops, cfg, scores, bias=bias, blocked=blocked, empty_rows=empty, **parts, saved=steps
        )  # (..., Nk, Nq), one column per query like the scores
        weights = L.precision.operand(weights).reshape(shape)
        saved = {"weights": weights, "steps": steps, "head": head, "scores_shape": scores_shape}
        return saved, r(np.matmul(v, weights))  # (..., Nk, Nq), (..., Dv, Nq)

    def _attend_backward(self, q, k, v, saved, d_context):
        """(dQ, dK, dV, inner) for the same broadcast shapes as `_attend` (dK, dV before any group sum).

        ``inner`` holds the score-side backward stages (d_weights, d_biased_scores, d_capped_scores,
        d_scores, as present: `frameworks.ops.score_steps_backward`); the softmax's part's (`score_parts.softmax_part`)
        and the relative bias's gradients are added into ``self.d_parts`` / ``self.d_rel_bias``.
        """
        r, L = self.round, self.layer
        cfg, P = L.cfg, L.precision
        weights, head, scores_shape = saved["weights"], saved["head"], saved["scores_shape"]
        d_weights = r(np.matmul(_swap(v), d_context))  # (..., Nk, Nq): dA = V^T dC
        d_v = np.matmul(d_context, _swap(weights))  # (..., Dv, Nk): dV = dC A^T
        # The score steps undone (softmax over keys, axis -2; blocked keys and empty columns have A = 0).
        d_scores, per_query, inner = score_steps_backward(L.ops, cfg, d_weights, saved["steps"], weights.shape)
        d_scores, inner = P.operand(d_scores), {name: P.operand(d) for name, d in inner.items()}
        if per_query is not None:  # the softmax part's gradient per query (each head's sink), (..., 1, Nq)
            per_query = per_query.reshape(*scores_shape[:-2], -1)  # (B, H, Nq) or (B, Nq), a view
            d_part = self.d_parts[softmax_part(cfg).name]  # (H,)
            if head is None:
                d_part += per_query.sum(axis=(0, 2))
            else:
                d_part[head] += per_query.sum()
        if self.d_rel_bias is not None:  # each bucket sums the gradients of the cells that read it
            self._add_bucket_grads(inner["d_biased_scores"].reshape(scores_shape), head)
        d_q = r(cfg.scale * np.matmul(k, d_scores))  # (..., Dk, Nq): dQ = scale K dS
        d_k = cfg.scale * np.matmul(q, _swap(d_scores))  # (..., Dk, Nk): dK = scale Q dS^T
        return d_q, d_k, d_v, inner

    def _add_bucket_grads(self, d_biased: np.ndarray, head: int | None) -> None:
        """Each T5 bucket's entry of query head h sums the score gradients of the cells that read it.

        ``d_biased`` (B, H, Nk, Nq) (``head`` None) or (B, Nk, Nq); the buckets are (1|B, Nk, Nq).
        """
        V, n = self.layer.variants, self.layer.cfg.rel_buckets
        heads = range(d_biased.shape[1]) if head is None else [head]
        for h in heads:
            d_h = d_biased[:, h] if head is None else d_biased  # (B, Nk, Nq)
            buckets = np.broadcast_to(V.buckets, d_h.shape)  # (B, Nk, Nq)
            self.d_rel_bias[:, h] += np.bincount(buckets.ravel(), weights=d_h.ravel(), minlength=n)

    def _unnorm(self, which: str, x_blocks: list, d_blocks: list) -> list:
        """The backward of the norm before rotary (`ColumnHeadSteps.norm_step`: QK-norm): the gradients of its inputs
        ``x_blocks`` from those of its outputs (compute dtype).

        The blocks are as the forward normed them: one (the merged projection, or batched heads), or
        one per head (PER_HEAD). The weight's gradient is kept in ``self.d_norms[which]``; without
        the norm the gradients pass through.
        """
        L = self.layer
        cfg, V, P = L.cfg, L.variants, L.precision
        if L.norm_step is None:
            return d_blocks
        xs = [P.operand(x) for x in x_blocks]
        if L._norms_projection:  # the blocks share one statistic per token
            d_xs, d_ws = rms_norm_rows_vjp(xs, V.norm_weight_blocks(which, len(xs)), cfg.norm_eps, d_blocks)
            d_w = np.concatenate(d_ws)  # (n*Dk,): block i's rows i*Dk:(i+1)*Dk
        else:  # each block over its own rows, one weight for every head
            weight = V.norms[which]
            parts = [rms_norm_rows_vjp([x], [weight], cfg.norm_eps, [d]) for x, d in zip(xs, d_blocks, strict=True)]
            d_xs, d_w = [d_x for (d_x,), _ in parts], sum(d_w for _, (d_w,) in parts)
        self.d_norms[which] = d_w
        return [self.round(d) for d in d_xs]

    def _unnorm_split(self, which: str, merged, d_normed_heads, n_heads: int, split, split_back) -> tuple:
        """(d_heads, d_merged): the norm before rotary undone for heads made by ``split`` from the projection ``merged``.

        Over the projection the norm came before the split: its backward runs on the merged
        gradient; over the head it runs on the heads (without a norm the gradients pass through).
        """
        if self.layer._norms_projection:
            (d_merged,) = self._unnorm(which, [merged], [split_back(d_normed_heads)])
            return split(d_merged, n_heads), d_merged
        (d_heads,) = self._unnorm(which, [split(merged, n_heads)], [d_normed_heads])
        return d_heads, split_back(d_heads)

    def _output_and_merged_backward(self, merged):
        L = self.layer
        gate, read = None, merged  # what W_o reads: merged, or merged * gate with the output gate
        if L.variants.w_gate is not None:
            gate, read = (L.precision.operand(a) for a in L.ops.output_gate(merged, L.variants.gate_logits(L.x_q)))
        output = self._project(L.w_o, L.b_o, read)  # (B, D, Nq): the forward's result, computed as autograd would
        d_merged, d_w_o, d_b_o = self._linear_backward(self.d_out, read, L.w_o, L.b_o is not None)
        if gate is not None:  # read = merged * gate: each factor's gradient is the other times d_read
            self.d_gate = self.round(d_merged * merged)  # (B, H*Dv, Nq)
            d_merged = self.round(d_merged * gate)
            d_logits = gate_logits_vjp(gate, self.d_gate)  # (B, H*Dv, Nq): through the sigmoid
            self.d_gated = self._linear_backward(d_logits, L.x_q, L.variants.w_gate, L.variants.b_gate is not None)
        return output, d_merged, d_w_o, d_b_o

    def _input_grads(self, d_q, d_k, d_v, grads: dict) -> dict:
        """The merged projections' backward: dX, dW, db for q, k and v."""
        L = self.layer
        for name, d_y, x, w, b in (
            ("q", d_q, L.x_q, L.w_q, L.b_q),
            ("k", d_k, L.x_k, L.w_k, L.b_k),
            ("v", d_v, L.x_v, L.w_v, L.b_v),
        ):
            grads[f"d_x_{name}"], grads[f"w_{name}"], grads[f"b_{name}"] = self._linear_backward(
                d_y, x, w, b is not None
            )
        return grads
