"""MLA's backward in column samples, written by hand for both forms (`mla` is the forward it differentiates).

Every projection is ``Y = W @ X + b`` on token columns, so ``dW = dY @ X.T`` (summed over the batch), ``dX =
W.T @ dY`` and ``db`` is ``dY`` summed over the columns, as in `vjp`. Per head, scores ``S = scale K^T Q`` (T, N),
one column per query, the score steps undone on NumPy's ops object (`frameworks.ops.score_steps_backward`).

* ``naive``: ``dV_h = dC_h A_h^T``, ``dK_nope_h = scale Q_nope_h dS_h^T``; the latent's gradient sums both
  expansions, ``dC = W_UK^T dK_nope + W_UV^T dV``; the shared key's, ``dk_rope = scale sum_h Q_rot_h dS_h^T``
  (every head read it);
* ``absorbed``: the output weight ``W_O_h W_UV_h`` gets ``dY context_h^T`` and hands it on to both factors,
  ``dW_O_h = d(W_O_h W_UV_h) W_UV_h^T`` and ``dW_UV_h = W_O_h^T d(W_O_h W_UV_h)``; the one key head
  ``[C ; k_rope]`` gets ``scale sum_h Q_h dS_h^T`` and, its latent rows read again by the context ``C A_h``,
  ``sum_h dcontext_h A_h^T``; the folded query ``W_UK_h^T q_nope_h`` gives ``dq_nope_h = W_UK_h dq_h`` and
  ``dW_UK_h = q_nope_h dq_h^T``.

Both end in the same tail: the temperature undone (its factors again: a diagonal map), the rotations turned back
(sin negated), the latent's and the query latent's RMSNorms undone down each column (`variants.rms_norm_rows_vjp`),
and the down-projections.
"""

from __future__ import annotations

import numpy as np

from .._mla import ABSORBED
from ..base import PreparedVJP
from ..frameworks.ops import score_steps_backward
from .mla import MLAForward
from .variants import rms_norm_rows_vjp
from .vjp import ColumnSampleVJP


def _t(a):
    return a.swapaxes(-1, -2)  # a transposed view


def _weight_grad(d_y, x):
    """``sum_b dY @ X.T`` (out, in): a projection's weight gradient, canonical layout."""
    return np.matmul(d_y, _t(x)).sum(axis=0)


class MLAVJP:
    """Forward and backward of one MLA form on an `MLAForward`'s converted arrays; ``run`` returns the gradients."""

    def __init__(self, forward: MLAForward, cotangent, form: str) -> None:
        self.forward, self.form = forward, form
        P = forward.layer.precision
        # (B, Nq, D) rows -> (B, D, Nq) columns, rounded like every input.
        self.d_out = np.ascontiguousarray(P.operand(P.round_to_storage(cotangent)).transpose(0, 2, 1))

    def run(self) -> dict:
        F, L, form = self.forward, self.forward.layer, self.form
        cfg, r, d_out = L.cfg, L.round, self.d_out
        latent, q = L.latent(F.x_k), L.queries(F.x_q)
        kv_latent, k_rope = latent["kv_latent"], latent["k_rope"]  # (B, R, T), (B, dr, T)
        steps: dict = {}
        _, context, weights = L.attend(form, q, kv_latent, k_rope, F.mask, saved=steps)
        grads: dict = {"b_o": r(d_out.sum(axis=(0, 2))) if L.b_o is not None else None}
        if form == ABSORBED:
            d_weights, d_latent_ctx = self._absorbed_output(context, weights, kv_latent, grads)
        else:
            d_weights, d_latent_ctx = self._naive_output(q, context, weights), None
        d_scores, _, _ = score_steps_backward(L.ops, cfg, r(d_weights), steps)  # (B, H, T, N)
        d_scores = L.precision.operand(d_scores)
        if form == ABSORBED:
            d_q_nope, d_q_rot, d_kv_latent, d_k_rope = self._absorbed_scores(q, kv_latent, k_rope, d_scores, grads)
            d_kv_latent = d_kv_latent + d_latent_ctx
        else:
            d_q_nope, d_q_rot, d_kv_latent, d_k_rope = self._naive_scores(q, kv_latent, k_rope, d_scores, grads)
        grads["d_x_q"] = self._query_tail(q, r(d_q_nope), r(d_q_rot), grads)
        grads["d_x_k"] = self._latent_tail(latent, r(d_kv_latent), r(d_k_rope), grads)
        grads["d_x_v"] = np.zeros_like(grads["d_x_k"])  # MLA reads no value input: keys and values are one latent
        return grads

    # -- the output and the context, per form ------------------------------------------------------
    def _naive_output(self, q, context, weights):
        """dW_o, and dA = V^T dcontext per head; dV_h = dcontext_h A_h^T kept for the scores' step."""
        L, d_out = self.forward.layer, self.d_out
        B, H, dv, N = context.shape
        merged = context.reshape(B, H * dv, N)  # (B, H*dv, N) view
        self.grads_o = _weight_grad(d_out, merged)  # (D, H*dv)
        d_context = np.matmul(_t(L.w_o), d_out).reshape(B, H, dv, N)  # (B, H, dv, N) view of W_o^T dY
        _, v = q["expanded"]  # (B, H, dv, T)
        self.d_v = np.matmul(d_context, _t(weights))  # (B, H, dv, T)
        return np.matmul(_t(v), d_context)  # (B, H, T, N)

    def _absorbed_output(self, context, weights, kv_latent, grads):
        """dW_o and dW_UV through the folded ``W_O_h W_UV_h``; (dA, the latent's gradient from the context)."""
        L, d_out, cfg = self.forward.layer, self.d_out, self.forward.layer.cfg
        H, dv, R = cfg.n_heads, cfg.d_v, cfg.kv_lora_rank
        d_w_ouv = np.matmul(d_out[:, None], _t(context)).sum(axis=0)  # (H, D, R): dY @ context_h^T
        w_o_heads = L.w_o.reshape(-1, H, dv).transpose(1, 0, 2)  # (H, D, dv) view
        w_uv = L.w_uv.reshape(H, dv, R)  # (H, dv, R) view
        self.grads_o = np.matmul(d_w_ouv, _t(w_uv)).transpose(1, 0, 2).reshape(-1, H * dv)  # (D, H*dv) copy
        grads["w_v"] = L.round(np.matmul(_t(w_o_heads), d_w_ouv).reshape(H * dv, R))  # (H*dv, R)
        d_context = np.matmul(_t(L.w_ouv), d_out[:, None])  # (H, R, D) @ (B, 1, D, N) -> (B, H, R, N)
        d_weights = np.matmul(_t(kv_latent[:, None]), d_context)  # (B, 1, T, R) @ (B, H, R, N) -> (B, H, T, N)
        return d_weights, np.matmul(d_context, _t(weights)).sum(axis=1)  # (B, R, T): C was read by every head

    # -- the scores, per form -----------------------------------------------------------------------
    def _naive_scores(self, q, kv_latent, k_rope, d_scores, grads):
        L = self.forward.layer
        scale, (k_nope, _) = L.cfg.scale, q["expanded"]
        B, T = k_nope.shape[0], k_nope.shape[-1]
        d_q_nope = scale * np.matmul(k_nope, d_scores)  # (B, H, dn, N): dQ = scale K dS
        d_q_rot = scale * np.matmul(k_rope[:, None], d_scores)  # (B, H, dr, N): the shared key, every head
        d_k_nope = (scale * np.matmul(q["q_nope"], _t(d_scores))).reshape(B, -1, T)  # (B, H*dn, T)
        d_k_rope = scale * np.matmul(q["q_rot"], _t(d_scores)).sum(axis=1)  # (B, dr, T): summed over the heads
        d_v = self.d_v.reshape(B, -1, T)  # (B, H*dv, T)
        grads["w_k"], grads["w_v"] = L.round(_weight_grad(d_k_nope, kv_latent)), L.round(_weight_grad(d_v, kv_latent))
        d_kv_latent = np.matmul(_t(L.w_uk), d_k_nope) + np.matmul(_t(L.w_uv), d_v)  # (B, R, T): both expansions
        return d_q_nope, d_q_rot, d_kv_latent, d_k_rope

    def _absorbed_scores(self, q, kv_latent, k_rope, d_scores, grads):
        L = self.forward.layer
        scale, R, H = L.cfg.scale, L.cfg.kv_lora_rank, L.cfg.n_heads
        keys = np.concatenate([kv_latent, k_rope], axis=-2)  # (B, R + dr, T): the one key head
        d_queries = scale * np.matmul(keys[:, None], d_scores)  # (B, H, R + dr, N)
        d_keys = scale * np.matmul(q["absorbed"], _t(d_scores)).sum(axis=1)  # (B, R + dr, T): summed over heads
        d_q_latent = d_queries[:, :, :R]  # (B, H, R, N) view: the folded query W_UK_h^T q_nope_h
        w_uk = L.w_uk.reshape(H, -1, R)  # (H, dn, R) view
        grads["w_k"] = L.round(np.matmul(q["q_nope"], _t(d_q_latent)).sum(axis=0).reshape(-1, R))  # (H*dn, R)
        d_q_nope = np.matmul(w_uk, d_q_latent)  # (B, H, dn, N): W_UK_h dq_h
        return d_q_nope, d_queries[:, :, R:], d_keys[:, :R], d_keys[:, R:]

    # -- the shared tail: rotations turned back, norms undone, down-projections ---------------------
    def _query_tail(self, q, d_q_nope, d_q_rot, grads):
        """dW_q (and the query LoRA's); the query input's gradient (B, D, N)."""
        F, L = self.forward, self.forward.layer
        cfg, r = L.cfg, L.round
        grads["w_o"] = r(self.grads_o)
        d_q_nope, d_q_rot = L.temper(d_q_nope), L.temper(d_q_rot)  # the temperature's backward: its factors again
        d_q_heads = np.concatenate([d_q_nope, L.rotate(d_q_rot, "q", sign=-1.0)], axis=-2)  # (B, H, Dk, N)
        B, _, _, N = d_q_heads.shape
        d_q = d_q_heads.reshape(B, -1, N)  # (B, H*Dk, N) view
        source = q.get("q_latent", F.x_q)
        grads["w_q"] = r(_weight_grad(d_q, source))
        d_source = r(np.matmul(_t(L.w_q), d_q))  # (B, Rq or D, N)
        if L.w_q_a is None:
            return d_source
        (d_q_a,), (grads["q_a_norm"],) = rms_norm_rows_vjp([q["q_a"]], [L.q_a_norm], cfg.norm_eps, [d_source])
        d_q_a = r(d_q_a)
        grads["w_q_a"] = r(_weight_grad(d_q_a, F.x_q))
        grads["b_q_a"] = r(d_q_a.sum(axis=(0, 2))) if L.b_q_a is not None else None
        return r(np.matmul(_t(L.w_q_a), d_q_a))  # (B, D, N)

    def _latent_tail(self, latent, d_kv_latent, d_k_rope, grads):
        """dW_kva, db_kva and the latent norm's weight; the key input's gradient (B, D, N)."""
        F, L = self.forward, self.forward.layer
        r = L.round
        d_k_pe = L.rotate(d_k_rope, "k", sign=-1.0)  # (B, dr, T): the rotation turned back
        (d_c,), (grads["kv_a_norm"],) = rms_norm_rows_vjp([latent["c"]], [L.kv_a_norm], L.cfg.norm_eps, [d_kv_latent])
        d_kv_a = r(np.concatenate([d_c, d_k_pe], axis=-2))  # (B, R + dr, T)
        grads["w_kv_a"] = r(_weight_grad(d_kv_a, F.x_k))
        grads["b_kv_a"] = r(d_kv_a.sum(axis=(0, 2))) if L.b_kv_a is not None else None
        return r(np.matmul(_t(L.w_kv_a), d_kv_a))  # (B, D, T)


def prepare_numpy_mla_vjp(cfg, params, inputs, cotangent, precision, strategy: str) -> PreparedVJP:
    """Forward+backward of MLA's ``strategy`` (``naive`` or ``absorbed``), hand-written in column samples."""
    vjp = MLAVJP(MLAForward(cfg, params, inputs, precision), cotangent, strategy)
    info = {
        "backward": "hand-written, column samples: dW = dY @ X.T, dX = W.T @ dY; MLA's latent and shared key "
        "gradients summed over the heads that read them",
        "strategy": strategy,
        **precision.info(),
    }
    return PreparedVJP(run=vjp.run, to_grads=ColumnSampleVJP.to_grads, info=info)
