"""The variants of 2024-26 attention (`core.variants`) in column samples: what the NumPy layer, its
hand-written backward and its chunked strategy share.

Column samples keep features as rows and tokens as columns, so:

* RMSNorm (QK-norm) takes its statistics down each column: over the ``d_k`` feature *rows*
  of one head's block (``qk_norm="head"``, one ``(Dk, 1)`` weight for every head) or over
  every row of the merged projection before the split (``"projection"``, an ``(H*Dk, 1)``
  weight). The per-head strategy holds the heads apart and never builds the merged
  projection, so there the projection's statistic is summed over the heads' row blocks:
  the one number per token that all heads share. `rms_norm_rows` takes the row blocks as
  a list for that reason; a single block is the plain case.
* The score bias (ALiBi, T5's buckets) is laid out like the scores, ``(1|B, H, Nk, Nq)``, one
  column per query. Its tables are computed here at prepare time with `core.variants` (the
  slopes, the buckets of each key-minus-query distance), as the rotary tables are; adding it
  to the scores is the layer's own step.
* The score parts of the variants' parameters (`frameworks.score_parts`: each head's logit in the
  softmax's denominator) are ``(1, H, 1, 1)``: one value per head, broadcast against each query's column.
* The output gate (``attn_output_gate``, Qwen3-Next) is ``sigmoid(W_gate @ X + b_gate)`` ``(B, H*Dv, N)``:
  ``W_gate`` is a column-sample weight like ``W_q`` (its rows are per head, row block h gates head h), so
  the gate has the merged context's layout, one row per merged feature and one column per token, and
  ``merged * gate`` is elementwise before ``W_o`` (the logits `ColumnVariants.gate_logits`, the sigmoid and
  the product `NumpyOps.output_gate`): every strategy, the chunked one and decode through the layer's
  ``_finish``, the backward through `gate_logits_vjp`.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, t5_buckets
from mha_rosetta.core.variants import NormStep, norm_step

from ..frameworks.score_parts import distance_slopes, score_parts
from .common import NumpyPrecision


# -- QK-norm ------------------------------------------------------------------------------
def rms_norm_rows(blocks: list, weights: list, eps: float, precision: NumpyPrecision) -> list:
    """RMSNorm of column samples over their feature rows: ``x / sqrt(mean over rows of x**2 + eps) * w``.

    ``blocks`` are arrays ``(..., d_i, N)`` that together hold the normalised features (one
    block: a plain RMSNorm over its rows; several: the row blocks of one projection held
    apart, sharing one statistic per token); ``weights`` are their ``(d_i, 1)`` weights. Each
    result is new, computed in the compute dtype and rounded once to storage.
    """
    P = precision
    xs = [P.operand(x) for x in blocks]
    inv_rms = _inverse_rms(xs, eps)  # (..., 1, N): one per token column
    return [P.store(x * inv_rms * w) for x, w in zip(xs, weights, strict=True)]


def _inverse_rms(xs: list, eps: float) -> np.ndarray:
    """``1 / sqrt(mean(x**2) + eps)`` over the rows of all blocks together, (..., 1, N)."""
    squares = sum(np.sum(x * x, axis=-2, keepdims=True) for x in xs)  # (..., 1, N)
    rows = sum(x.shape[-2] for x in xs)
    return 1.0 / np.sqrt(squares / rows + eps)


def rms_norm_rows_vjp(blocks: list, weights: list, eps: float, d_ys: list) -> tuple[list, list]:
    """The backward of `rms_norm_rows` (compute dtype): (d_blocks, d_weights), each weight's gradient ``(d_i,)``.

    With ``r`` the inverse RMS of each token column and ``g = dY * w``, over all the rows
    together: ``dX = r g - X r**3 mean(g X)``; ``dw = sum of dY X r`` over every axis but the
    feature rows (batch, heads, tokens).
    """
    inv_rms = _inverse_rms(blocks, eps)  # (..., 1, N)
    gs = [d_y * w for d_y, w in zip(d_ys, weights, strict=True)]
    rows = sum(x.shape[-2] for x in blocks)
    mean_gx = sum(np.sum(g * x, axis=-2, keepdims=True) for g, x in zip(gs, blocks, strict=True)) / rows
    d_xs = [inv_rms * g - x * inv_rms**3 * mean_gx for g, x in zip(gs, blocks, strict=True)]
    d_ws = [_sum_but_rows(d_y * x * inv_rms) for d_y, x in zip(d_ys, blocks, strict=True)]
    return d_xs, d_ws


def scored_vjp(layer, which: str, before: np.ndarray, d_scored: np.ndarray, batched: bool, round_stage) -> tuple:
    """The backward of `LayerRecording._after_rotary` ("q", "k") and `_read_values` ("v") on column samples
    (compute dtype): (the gradient of the heads ``before`` them (..., d, N), the backward stages on the way by name)
    from the gradient of what the scores or the weighted sum read, each step's result rounded by ``round_stage``. The
    temperature is a diagonal map (its factors again, laid out by ``batched`` as the forward's); the weightless norms
    are RMSNorm's backward down each token's column with a weight of ones, each head on its own."""
    cfg, stages = layer.cfg, {}
    d = d_scored
    if which == "q" and cfg.attn_temperature_tuning:
        stages["d_q_tempered"] = d
        d = round_stage(d * layer._laid_out_factors(batched))  # (..., Dk, Nq) times each query column's factor
    if cfg.qk_norm_after_rope if which != "v" else cfg.value_norm:
        stages["d_v_normed" if which == "v" else f"d_{which}_rotated_normed"] = d
        ones = np.ones((before.shape[-2], 1), dtype=before.dtype)  # (d, 1): no weight
        (d,), _ = rms_norm_rows_vjp([before], [ones], cfg.norm_eps, [d])
        d = round_stage(d)
    return d, stages


def gate_logits_vjp(gate: np.ndarray, d_gate: np.ndarray) -> np.ndarray:
    """The sigmoid's backward: the gate logits' gradient ``d_gate * g (1 - g)`` (B, H*Dv, N), compute dtype."""
    return d_gate * gate * (1.0 - gate)


def _sum_but_rows(a: np.ndarray) -> np.ndarray:
    """(..., d, N) summed over every axis but the feature rows -> (d,)."""
    return np.moveaxis(a, -2, -1).reshape(-1, a.shape[-2]).sum(axis=0)  # (..., N, d) -> (rest, d), a copy


# -- the score variants, as the layer holds them --------------------------------------------
class ColumnVariants:
    """One layer's variant parameters and tables in column samples, in the compute dtype (None where off).

    ``norm_step``: the norm of the queries and keys before rotary (`core.variants.norm_step`: QK-norm), or None;
    ``norms["q"]``/``norms["k"]``: its weights (``norm_step.weight``) as ``(d, 1)`` columns (``d = Dk`` over the
    head, the projection's width over the projection), empty without it. ``bias``: ALiBi plus T5's relative bias,
    ``(1|B, H, Nk, Nq)``; ``buckets`` ``(1|B, Nk, Nq)`` (the backward sums each bucket's score
    gradients); ``slopes`` ``(H,)``; ``parts``: the score parts by keyword (`frameworks.score_parts`), each
    ``(1, H, 1, 1)``; ``rel_table`` ``(buckets, H)``.
    ``full_bias`` False leaves ``bias`` and ``buckets`` None (they are quadratic in the tokens).
    """

    def __init__(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, precision: NumpyPrecision, full_bias: bool = True
    ) -> None:
        P = self.precision = precision
        self.cfg = cfg

        def stored(a):  # a parameter rounded to storage, held in the compute dtype (as every weight)
            return None if a is None else P.operand(P.round_to_storage(a))

        step: NormStep | None = norm_step(cfg)
        self.norm_step = step
        weights = {} if step is None else {which: getattr(params, step.weight(which)) for which in ("q", "k")}
        self.norms = {which: stored(w)[:, None] for which, w in weights.items()}  # (d, 1) columns
        self.parts = score_parts(cfg, params, lambda a: stored(a)[None, :, None, None])  # (1, H, 1, 1) each
        self.rel_table = stored(params.rel_bias)  # (buckets, H) or None
        self.w_gate = stored(params.w_gate)  # (H*Dv, D): a column-sample weight, W_gate @ X
        b_gate = stored(params.b_gate)
        self.b_gate = None if b_gate is None else b_gate[:, None]  # (H*Dv, 1): one value per row
        slopes = distance_slopes(cfg)  # ALiBi's m_h, float64, or None
        self.slopes = None if slopes is None else slopes.astype(P.compute)  # (H,)
        # Key minus query, one column per query: (1|B, Nk, Nq).
        self.distance = None
        self.buckets = None
        self.bias = None
        if cfg.has_score_bias and full_bias:  # the chunked strategy computes it per tile (`tile_bias`) instead
            self.distance = inputs.kv_positions[:, :, None] - inputs.positions[:, None, :]  # (1|B, Nk, Nq), int64
            self.bias = self.tile_bias(self.distance)  # (1|B, H, Nk, Nq)
            if cfg.rel_buckets is not None:
                self.buckets = self.bucket_of(self.distance)

    def bucket_of(self, distance: np.ndarray) -> np.ndarray:
        """T5's bucket of each key-minus-query distance (int64, the same shape)."""
        cfg = self.cfg
        assert cfg.rel_buckets is not None
        return t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)

    def tile_bias(self, distance: np.ndarray) -> np.ndarray | None:
        """What ALiBi and the relative bias add to scores whose key-minus-query distances are ``distance``.

        ``distance`` (1|B, Nk', Nq') (a whole score matrix, or one tile of the chunked strategy)
        -> (1|B, H, Nk', Nq') in the compute dtype, or None without a score bias.
        """
        bias = None
        if self.slopes is not None:  # m_h (p_j - p_i)
            bias = self.slopes[None, :, None, None] * distance[:, None].astype(self.precision.compute)
        if self.rel_table is not None:  # rel_bias[bucket(p_j - p_i), h]
            rel = np.moveaxis(self.rel_table[self.bucket_of(distance)], -1, 1)  # (1|B, Nk', Nq', H) -> (1|B, H, ...)
            bias = rel if bias is None else bias + rel
        return bias

    def head_bias(self, h: int | None):
        """The score bias of query head h (``(1|B, Nk, Nq)``); every head's when h is None."""
        return self.bias if self.bias is None or h is None else self.bias[:, h]

    def head_parts(self, h: int | None) -> dict:
        """The score parts of query head h (scalars); every head's ``(1, H, 1, 1)`` when h is None."""
        return self.parts if h is None else {part: value[0, h, 0, 0] for part, value in self.parts.items()}

    def gate_logits(self, x: np.ndarray) -> np.ndarray:
        """The output gate's logits of the token columns ``x`` (B, D, N): ``W_gate @ X + b_gate`` (B, H*Dv, N), in
        the merged context's layout, in the compute dtype (a new array); NumPy's ops object takes the sigmoid."""
        logits = np.matmul(self.w_gate, x)  # (B, H*Dv, N): one BLAS product per batch item
        if self.b_gate is not None:
            logits += self.b_gate  # in place: (H*Dv, 1) broadcasts over tokens and batch
        return logits

    def norm_weight_blocks(self, which: str, n_blocks: int) -> list:
        """The QK-norm weight of ``which`` ("q" or "k") cut into the weights of ``n_blocks`` row blocks.

        Over the head there is one weight for every block; over the projection block i has
        rows ``i*d:(i+1)*d`` of the projection's weight (views).
        """
        step, w = self.norm_step, self.norms[which]
        assert step is not None  # norms[which] exists only with it
        if step.per_head:
            return [w] * n_blocks
        d = w.shape[0] // n_blocks
        return [w[i * d : (i + 1) * d] for i in range(n_blocks)]
