"""The NumPy adapter's backward pass, written by hand in column samples.

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

Half precision follows the forward's policy (`common.NumpyPrecision`): every stage,
forward and backward, is stored in the half type, computed in float32.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._recording import relation_to
from ..base import PreparedVJP, StageTensor, tensor_to_numpy
from .common import apply_mask_inplace, softmax_inplace
from .layer import _merge_reshape, _split_direct, _split_reshape, rotate_rows  # the forward's own splits, rotation


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


def _swap(a: np.ndarray) -> np.ndarray:
    return a.swapaxes(-1, -2)  # a transposed view


class ColumnSampleVJP:
    """The backward of each strategy of a `ColumnSampleMHA`, on its converted arrays."""

    def __init__(self, layer, cotangent: np.ndarray) -> None:
        self.layer = L = layer
        P = L.precision
        self.round = lambda a: P.operand(P.store(a))  # a stage rounded to storage, kept in compute
        # (B, Nq, D) rows -> (B, D, Nq) columns, rounded like every input.
        self.d_out = np.ascontiguousarray(P.operand(P.round_to_storage(cotangent)).transpose(0, 2, 1))  # (B, D, Nq)

    # -- building blocks ------------------------------------------------------------------
    def _project(self, w, b, x):
        return self.layer.precision.operand(self.layer._project(w, b, x))

    def _projections(self):
        """The forward's merged q, k and v (`ColumnSampleMHA._projections`), in the compute dtype."""
        return tuple(self.layer.precision.operand(y) for y in self.layer._projections())

    def _rotate(self, heads, which: str, head_axis: bool):
        """The forward's rotary embedding (`ColumnSampleMHA._rotate`), in the compute dtype."""
        return self.layer.precision.operand(self.layer._rotate(heads, which, head_axis))

    def _unrotate(self, d_rotated, which: str, head_axis: bool):
        """The rotary embedding's backward: its transpose, the rotation by minus each angle (sin negated)."""
        L = self.layer
        if L.rotary is None:
            return d_rotated
        cos, sin = L.rotary[which]  # (1|B, r/2, N)
        if head_axis:
            cos, sin = cos[:, None], sin[:, None]  # (1|B, 1, r/2, N): every head alike
        return L.precision.operand(rotate_rows(d_rotated, cos, -sin, L.cfg.rope, L.precision))

    def _linear_backward(self, d_y, x, w, with_bias: bool):
        """Y = W @ X + b per batch item: (dX, dW, db) with dW = sum_b dY @ X.T, dX = W.T @ dY."""
        r = self.round
        d_w = r(np.matmul(d_y, _swap(x)).sum(axis=0))  # (out, in): one dY @ X.T per batch item, summed
        d_x = r(np.matmul(_swap(w), d_y))  # (B, in, N)
        d_b = r(d_y.sum(axis=(0, 2))) if with_bias else None  # (out,): over batch and token columns
        return d_x, d_w, d_b

    def _attend(self, q, k, v, mask, scores_shape):
        """Forward of one head or of every head, column samples: returns (weights, context).

        q (..., Dk, Nq), k (..., Dk, Nk), v (..., Dv, Nk) broadcast together; ``mask`` is a
        `MaskArrays` for the scores viewed as ``scores_shape`` ((B, H, Nk, Nq) or (B, Nk, Nq)).
        """
        r, L = self.round, self.layer
        shape = (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), k.shape[-1], q.shape[-1])
        scores = r(L.cfg.scale * np.matmul(_swap(k), q)).reshape(scores_shape)  # (..., Nk, Nq)
        apply_mask_inplace(scores, mask)
        weights = r(softmax_inplace(scores, None if mask is None else mask.empty_rows, axis=-2)).reshape(shape)
        return weights, r(np.matmul(v, weights))  # (..., Nk, Nq), (..., Dv, Nq)

    def _attend_backward(self, q, k, v, weights, d_context):
        """(dQ, dK, dV) for the same broadcast shapes as `_attend` (dK, dV before any group sum)."""
        r, scale = self.round, self.layer.cfg.scale
        d_weights = r(np.matmul(_swap(v), d_context))  # (..., Nk, Nq): dA = V^T dC
        d_v = np.matmul(d_context, _swap(weights))  # (..., Dv, Nk): dV = dC A^T
        # Softmax over keys (axis -2) backward; blocked keys and empty columns have A = 0.
        d_scores = r(weights * (d_weights - np.sum(d_weights * weights, axis=-2, keepdims=True)))  # (..., Nk, Nq)
        d_q = r(scale * np.matmul(k, d_scores))  # (..., Dk, Nq): dQ = scale K dS
        d_k = scale * np.matmul(q, _swap(d_scores))  # (..., Dk, Nk): dK = scale Q dS^T
        return d_q, d_k, d_v, {"d_weights": d_weights, "d_scores": d_scores}

    def _output_and_merged_backward(self, merged):
        L = self.layer
        output = self._project(L.w_o, L.b_o, merged)  # (B, D, Nq): the forward's result, computed as autograd would
        d_merged, d_w_o, d_b_o = self._linear_backward(self.d_out, merged, L.w_o, L.b_o is not None)
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
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        # Rotary (cfg.rope) turns the heads' feature rows; the heads themselves without rope.
        q_heads = self._rotate(split(q, H), "q", True).reshape(B, Hkv, G, Dk, Nq)  # query head h = g*G + r
        k_heads = self._rotate(split(k, Hkv), "k", True)[:, :, None]  # (B, Hkv, 1, Dk, Nk), shared by the group
        v_heads = split(v, Hkv)[:, :, None]  # (B, Hkv, 1, Dv, Nk)
        weights, context = self._attend(q_heads, k_heads, v_heads, L.mask, (B, H, Nk, Nq))
        merged = split_back(context.reshape(B, H, Dv, Nq))  # (B, H*Dv, Nq)
        output, d_merged, d_w_o, d_b_o = self._output_and_merged_backward(merged)
        d_context = split(d_merged, H).reshape(B, Hkv, G, Dv, Nq)  # the merge's adjoint is the split
        d_q_rotated, d_k_rotated, d_v_heads, inner = self._attend_backward(
            q_heads, k_heads, v_heads, weights, d_context
        )
        d_q_rotated = d_q_rotated.reshape(B, H, Dk, Nq)  # (B, H, Dk, Nq)
        d_k_rotated = self.round(self.group_sum(d_k_rotated))  # (B, Hkv, Dk, Nk)
        d_v_heads = self.round(self.group_sum(d_v_heads))  # (B, Hkv, Dv, Nk)
        d_q_heads = self._unrotate(d_q_rotated, "q", True)  # the rotation undone: (B, H, Dk, Nq)
        d_k_heads = self._unrotate(d_k_rotated, "k", True)  # (B, Hkv, Dk, Nk)
        d_q = split_back(d_q_heads)  # (B, H*Dk, Nq): the split's adjoint is the merge
        d_k = split_back(d_k_heads)  # (B, Hkv*Dk, Nk)
        d_v = split_back(d_v_heads)  # (B, Hkv*Dv, Nk)
        grads = self._input_grads(d_q, d_k, d_v, {"w_o": d_w_o, "b_o": d_b_o})
        grads["output"] = output
        d_context = d_context.reshape(B, H, Dv, Nq)  # (B, H, Dv, Nq)
        # Provenance as in the forward stages: the split and merge adjoints are reshapes (measured view or copy).
        grads["stages"] = {
            "d_output": StageTensor(self.d_out, ("B", "D", "Nq")),
            "d_merged": StageTensor(d_merged, ("B", "H*Dv", "Nq")),
            "d_context": StageTensor(
                d_context, ("B", "H", "Dv", "Nq"), "", relation_to(d_context, d_merged), "d_merged"
            ),
            "d_weights": StageTensor(inner["d_weights"].reshape(B, H, Nk, Nq), ("B", "H", "Nk", "Nq")),
            "d_v_heads": StageTensor(d_v_heads, ("B", "Hkv", "Dv", "Nk")),
            "d_scores": StageTensor(inner["d_scores"].reshape(B, H, Nk, Nq), ("B", "H", "Nk", "Nq")),
            "d_q_rotated": StageTensor(d_q_rotated, ("B", "H", "Dk", "Nq")),
            "d_k_rotated": StageTensor(d_k_rotated, ("B", "Hkv", "Dk", "Nk")),
            "d_q_heads": StageTensor(d_q_heads, ("B", "H", "Dk", "Nq")),
            "d_k_heads": StageTensor(d_k_heads, ("B", "Hkv", "Dk", "Nk")),
            "d_q": StageTensor(d_q, ("B", "H*Dk", "Nq"), "", relation_to(d_q, d_q_heads), "d_q_heads"),
            "d_k": StageTensor(d_k, ("B", "Hkv*Dk", "Nk"), "", relation_to(d_k, d_k_heads), "d_k_heads"),
            "d_v": StageTensor(d_v, ("B", "Hkv*Dv", "Nk"), "", relation_to(d_v, d_v_heads), "d_v_heads"),
        }
        return grads

    # -- one head at a time: SLICING and PER_HEAD ------------------------------------------
    def slicing(self) -> dict:
        L = self.layer
        H, Dk, Dv = L.cfg.n_heads, L.cfg.d_k, L.cfg.d_v
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        heads = [self._head(h, q, k, v) for h in range(H)]  # per head: weights, context, and its slices
        merged = np.concatenate([context for _, context, _ in heads], axis=1)  # (B, H*Dv, Nq)
        output, d_merged, d_w_o, d_b_o = self._output_and_merged_backward(merged)
        d_q = np.empty_like(q)  # (B, H*Dk, Nq): every row block written once below
        d_k = np.zeros(k.shape, dtype=q.dtype)  # (B, Hkv*Dk, Nk): query heads of a group add into it
        d_v = np.zeros(v.shape, dtype=q.dtype)  # (B, Hkv*Dv, Nk)
        for h, (weights, _, (q_h, k_g, v_g, g)) in enumerate(heads):
            d_context = d_merged[:, h * Dv : (h + 1) * Dv]  # (B, Dv, Nq): row block h, a view
            d_q_h, d_k_h, d_v_h, _ = self._attend_backward(q_h, k_g, v_g, weights, d_context)
            d_q[:, h * Dk : (h + 1) * Dk] = self._unrotate(d_q_h, "q", False)
            d_k[:, g * Dk : (g + 1) * Dk] += d_k_h  # still rotated: undone once per kv head below
            d_v[:, g * Dv : (g + 1) * Dv] += d_v_h
        B, Hkv, Nk = d_k.shape[0], L.cfg.n_kv_heads, d_k.shape[-1]
        d_k = self._unrotate(self.round(d_k).reshape(B, Hkv, Dk, Nk), "k", True).reshape(B, Hkv * Dk, Nk)  # views
        grads = self._input_grads(d_q, d_k, self.round(d_v), {"w_o": d_w_o, "b_o": d_b_o})
        grads["output"] = output
        return grads

    def _head(self, h: int, q, k, v):
        """Forward of query head h on row-block slices of the merged projections (views)."""
        L = self.layer
        Dk, Dv, g = L.cfg.d_k, L.cfg.d_v, L.cfg.kv_head_of(h)
        q_h = self._rotate(q[:, h * Dk : (h + 1) * Dk], "q", False)  # (B, Dk, Nq), rotated with rope
        k_g = self._rotate(k[:, g * Dk : (g + 1) * Dk], "k", False)  # (B, Dk, Nk)
        v_g = v[:, g * Dv : (g + 1) * Dv]  # (B, Dv, Nk)
        weights, context = self._attend_one(h, q_h, k_g, v_g)
        return weights, context, (q_h, k_g, v_g, g)

    def _attend_one(self, h: int, q_h, k_g, v_g):
        L = self.layer
        B, Nq, Nk = L.sizes[:3]
        mask = None if L.mask is None else L.mask.for_head(h)
        return self._attend(q_h, k_g, v_g, mask, (B, Nk, Nq))

    def per_head(self) -> dict:
        L = self.layer
        B, Nq, Nk, H, Hkv, G, Dk, Dv = L.sizes  # noqa: RUF059 (every size named once)
        k_heads = [self._project(L.w_k_heads[g], L.b_k_heads[g], L.x_k) for g in range(Hkv)]  # Hkv x (B, Dk, Nk)
        v_heads = [self._project(L.w_v_heads[g], L.b_v_heads[g], L.x_v) for g in range(Hkv)]  # Hkv x (B, Dv, Nk)
        q_heads = [self._project(L.w_q_heads[h], L.b_q_heads[h], L.x_q) for h in range(H)]  # H x (B, Dk, Nq)
        k_heads = [self._rotate(k_g, "k", False) for k_g in k_heads]  # rotated with rope
        q_heads = [self._rotate(q_h, "q", False) for q_h in q_heads]
        forward = [self._attend_one(h, q_heads[h], k_heads[h // G], v_heads[h // G]) for h in range(H)]
        merged = np.concatenate([context for _, context in forward], axis=1)  # (B, H*Dv, Nq)
        output, d_merged, d_w_o, d_b_o = self._output_and_merged_backward(merged)
        d_k_heads = [0.0] * Hkv
        d_v_heads = [0.0] * Hkv
        d_q_heads = []
        for h, (weights, _) in enumerate(forward):
            g = h // G
            d_context = d_merged[:, h * Dv : (h + 1) * Dv]  # (B, Dv, Nq)
            d_q_h, d_k_h, d_v_h, _ = self._attend_backward(q_heads[h], k_heads[g], v_heads[g], weights, d_context)
            d_q_heads.append(d_q_h)
            d_k_heads[g] = d_k_heads[g] + d_k_h  # the group's query heads add up
            d_v_heads[g] = d_v_heads[g] + d_v_h
        grads = {"w_o": d_w_o, "b_o": d_b_o, "output": output}
        # Each head's own matrix W_h (d, in): dW_h = dQ_h @ X.T is row block h of the canonical dW.
        for name, d_ys, x, with_bias in (
            ("q", [self._unrotate(d, "q", False) for d in d_q_heads], L.x_q, L.b_q is not None),
            ("k", [self._unrotate(self.round(d), "k", False) for d in d_k_heads], L.x_k, L.b_k is not None),
            ("v", [self.round(d) for d in d_v_heads], L.x_v, L.b_v is not None),
        ):
            w_heads = getattr(L, f"w_{name}_heads")  # (heads, d, in)
            parts = [self._linear_backward(d_y, x, w_heads[i], with_bias) for i, d_y in enumerate(d_ys)]
            grads[f"d_x_{name}"] = self.round(sum(d_x for d_x, _, _ in parts))  # every head read the same X
            grads[f"w_{name}"] = np.concatenate([d_w for _, d_w, _ in parts], axis=0)  # (heads*d, in)
            grads[f"b_{name}"] = np.concatenate([d_b for _, _, d_b in parts]) if with_bias else None
        return grads

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
