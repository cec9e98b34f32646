"""The NumPy layer: multi-head attention in column samples, ``Y = W @ X + b``.

The column-sample layer's four head-split strategies (standard, direct_reshape, slicing, per_head), a method
each, and the steps they share: projections, rotary and merge here; the head splits and QK-norm in `heads`
(`ColumnHeadSteps`); scores, mask, softmax and weighted sum in `scores` (`ColumnScoreSteps`). One class joins
them, so that the strategies read top to bottom.

Convention A of the column/row-sample article. Each batch item is a matrix ``X`` of shape ``(features, tokens)``:
every token is a column. A weight in the canonical ``(out, in)`` layout is used as is,
``Y = W @ X``, so each row of ``W`` is a scorer that reads one column (token) and writes
one output feature. The batch is a leading axis, ``(B, features, tokens)``.

What follows from that layout, and what this adapter shows:

* the head split is a reshape of the feature axis ``(B, H*Dk, N) -> (B, H, Dk, N)``: head h
  owns rows ``h*Dk:(h+1)*Dk``, a contiguous block, so no transpose is needed (row samples
  need ``view`` then ``transpose(1, 2)``);
* per head the score matrix keeps one column per query, ``S_h = scale * K_g^T @ Q_h``
  ``(Nk, Nq)`` (the transpose of the row-sample ``Q_h @ K_g^T``), the softmax normalises
  each column (over keys, axis -2), and ``context_h = V_g @ A_h`` is a plain product
  ``(Dv, Nk) @ (Nk, Nq) = (Dv, Nq)``: column samples throughout. The column-wise softmax was measured faster than the
  row-wise one; ``K_g^T`` is a transposed view handed to BLAS with its transpose flag (no
  copy), at a measured cost that the benchmark shows as it is (figures:
  docs/notes/backends-measurements.md);
* the rotary embedding (``cfg.rope``) turns pairs of feature *rows* of each head: rows
  ``i`` and ``i + r/2`` ("half") or rows ``2i`` and ``2i + 1`` ("interleaved", a step-2 slice),
  with cos/sin tables laid out like the data, one column per token ``(r/2, N)``;
* the variants of 2024-26 models (`variants`): QK-norm takes its statistic down each token's
  column, over a head's Dk rows or over every row of the merged projection before the split;
  the score steps (`frameworks.ops.score_steps` on NumPy's ops object, keys on axis -2) act on
  the key-row, query-column scores, the score bias laid out ``(1|B, H, Nk, Nq)`` like them and
  each head's sink ``(1, H, 1, 1)`` against each query column's maximum. Each step's stage
  (``q_normed`` ... ``biased_scores``) exists only with its variant;
* merging heads is the inverse reshape ``(B, H, Dv, N) -> (B, H*Dv, N)``, again a view;
* the output ``W_o @ merged + b_o`` is ``(B, D, Nq)``. Only `to_numpy` (untimed) turns it
  back into the row-sample exchange layout; `prepare` (untimed) turns inputs into columns.

Strategies (the column/row-sample article's variants): STANDARD (merged projections, reshape split);
PER_HEAD (one ``(Dk, D)`` matrix per head, the column/row-sample article's ``W_h`` transposed for columns, in
a loop over heads); SLICING (merged projections, then one head at a time by slicing row
blocks); DIRECT_RESHAPE (the known mistake: it treats the data as row samples and
reshapes ``(N, H*Dk)`` straight to ``(H, N, Dk)``, so each head sees a slice of the tokens
with all their features; kept so the checks can prove they catch it).

Half precision: see `common` (stages stored in float16/bfloat16, products and the
softmax computed in float32, rounded after each stage); `Prepared.info` says so.
"""

from __future__ import annotations

import functools

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions, rotary_tables, split_head_matrices

from .._inputs import convert_inputs
from .._layouts import layer_sizes
from .._recording import LayerRecording, StageRecorder, relation_to
from ..frameworks.ops import temperature_factors
from ..frameworks.ops_numpy import NumpyOps
from .common import MaskArrays, NumpyPrecision
from .heads import (
    COLUMN_SAMPLE_AXES,
    HEAD_SLICE_AXES,
    ROTATE_HOW,
    ColumnHeadSteps,
    _split_direct,
    _split_reshape,
    rotate_rows,
)
from .scores import ColumnScoreSteps
from .variants import ColumnVariants


class ColumnSampleMHA(ColumnHeadSteps, ColumnScoreSteps, LayerRecording):
    """One layer and one set of inputs, converted once to column samples.

    Parameters and inputs are rounded to the storage dtype here and then held in the
    compute dtype (exact: every half value is a float32 value), so the timed pass spends
    no time converting them.

    With ``batched=True`` a score buffer ``(B, Hkv, G, Nk, Nq)`` is allocated here and
    reused by every call. Why: at B=4, H=8, N=512 the scores are 32 MiB, just above
    glibc's largest heap-reuse threshold, so a fresh array is a fresh ``mmap`` and costs
    page faults and zeroing on every call (measured: more than the softmax itself). The
    forward never returns the buffer, so its results stay independent; two *concurrent*
    calls of one Prepared would share it (nothing here makes concurrent calls).
    """

    # The full (Nq, Nk) mask, causal part and window included, and the full score bias; the chunked
    # subclass computes both per tile instead.
    materialise_mask = True
    PROJECTION_AXES = SPLIT_AXES = COLUMN_SAMPLE_AXES
    HEAD_SLICE_AXES = HEAD_SLICE_AXES
    PROJECTION_NOTE = "W @ X + b: rows are features, columns are tokens"
    ROTATE_HOW = ROTATE_HOW
    FEATURE_AXIS = -2  # a head's features are its rows: the norms after rotary and of the values go down columns

    def __init__(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, precision: NumpyPrecision, batched: bool = True
    ) -> None:
        self.cfg = cfg
        self.precision = P = precision
        self.ops = NumpyOps(precision.name, keys_axis=-2)  # the score steps, over keys on axis -2
        self.sizes = layer_sizes(cfg, inputs)  # (B, Nq, Nk, H, Hkv, G, Dk, Dv)
        B, Nq, Nk = self.sizes[:3]

        def weight(w):  # canonical (out, in) is already the column-sample W_A
            return P.operand(P.round_to_storage(w))

        def bias(b):  # (out,) -> (out, 1): one value per row, broadcast over the token columns
            return None if b is None else P.operand(P.round_to_storage(b))[:, None]

        self.w_q, self.w_k, self.w_v, self.w_o = (weight(w) for w in (params.w_q, params.w_k, params.w_v, params.w_o))
        self.b_q, self.b_k, self.b_v, self.b_o = (bias(b) for b in (params.b_q, params.b_k, params.b_v, params.b_o))

        # PER_HEAD: the column/row-sample article's W_h (D, Dk) per head, transposed once to (Dk, D) for W_h^T @ X.
        def per_head(w, n_heads):
            return np.ascontiguousarray(split_head_matrices(w, n_heads).transpose(0, 2, 1))  # (heads, d, in)

        def per_head_bias(b, n_heads):
            return [None] * n_heads if b is None else list(b.reshape(n_heads, -1, 1))  # heads x (d, 1)

        self.w_q_heads = per_head(self.w_q, cfg.n_heads)  # (H, Dk, D)
        self.w_k_heads = per_head(self.w_k, cfg.n_kv_heads)  # (Hkv, Dk, kdim)
        self.w_v_heads = per_head(self.w_v, cfg.n_kv_heads)  # (Hkv, Dv, vdim)
        self.b_q_heads = per_head_bias(self.b_q, cfg.n_heads)
        self.b_k_heads = per_head_bias(self.b_k, cfg.n_kv_heads)
        self.b_v_heads = per_head_bias(self.b_v, cfg.n_kv_heads)

        def columns(x):  # (B, N, F) rows -> (B, F, N) columns, contiguous
            return np.ascontiguousarray(P.operand(P.round_to_storage(x)).transpose(0, 2, 1))  # (B, F, N)

        self.x_q, self.x_k, self.x_v = convert_inputs(inputs, columns)  # self-attention: one array
        tables = rotary_tables(cfg, inputs)
        self.rotary = None
        if tables is not None:  # (1|B, N, r/2) -> (1|B, r/2, N): one column per token, like the data
            self.rotary = {
                "q": (columns(tables.q_cos), columns(tables.q_sin)),
                "k": (columns(tables.k_cos), columns(tables.k_sin)),
            }
        factors = temperature_factors(cfg, inputs.positions)  # (1|B, Nq) float64, or None: Llama 4's temperature
        self.factors = None if factors is None else factors.astype(P.compute)
        # QK-norm weights, score bias (None where off), score parts
        self.variants = ColumnVariants(cfg, params, inputs, P, full_bias=self.materialise_mask)
        allowed = allowed_positions(cfg, inputs) if self.materialise_mask else None
        self.mask = MaskArrays.from_allowed(allowed, keys_axis=-2)
        shape = (B, cfg.n_kv_heads, cfg.group_size, Nk, Nq)
        self.workspace = np.empty(shape, dtype=P.compute) if batched and not P.mixed else None

    # -- building blocks ------------------------------------------------------------------
    @staticmethod
    def _stack(arrays: list, axis: int) -> np.ndarray:
        return np.stack(arrays, axis)

    def _laid_out_factors(self, batched: bool) -> np.ndarray:
        # one factor per query column: (1|B, 1, 1, Nq) against (B, H, Dk, Nq), (1|B, 1, Nq) against (B, Dk, Nq); views
        return self.factors[:, None, None, :] if batched else self.factors[:, None, :]

    def _project(self, w: np.ndarray, b: np.ndarray | None, x: np.ndarray) -> np.ndarray:
        """``W @ X + b`` for every batch item: (out, in) @ (B, in, N) -> (B, out, N)."""
        y = np.matmul(w, x)  # (B, out, N): one BLAS product per batch item
        if b is not None:
            y += b  # in place: (out, 1) broadcasts over tokens and batch
        return self.precision.store(y)

    def _projections(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = self._project(self.w_q, self.b_q, self.x_q)  # (B, H*Dk, Nq)
        k = self._project(self.w_k, self.b_k, self.x_k)  # (B, Hkv*Dk, Nk)
        v = self._project(self.w_v, self.b_v, self.x_v)  # (B, Hkv*Dv, Nk)
        return q, k, v

    def _rotate(self, x: np.ndarray, which: str, head_axis: bool, tokens: slice | None = None) -> np.ndarray:
        """Query ("q") or key ("k") heads (..., Dk, N) rotated along their feature rows; ``x`` itself without rope.

        ``tokens``: the columns of the tables ``x``'s tokens are (a decode chunk's slice of the whole run); all."""
        if self.rotary is None:
            return x
        cos, sin = self.rotary[which]  # (1|B, r/2, N)
        if tokens is not None:
            cos, sin = cos[..., tokens], sin[..., tokens]  # (1|B, r/2, s): the chunk's columns, views
        if head_axis:
            cos, sin = cos[:, None], sin[:, None]  # (1|B, 1, r/2, N): the same angles for every head
        return rotate_rows(x, cos, sin, self.cfg.rope, self.precision)

    def _finish(self, merged: np.ndarray, rec, tokens: slice | None = None) -> np.ndarray:
        """``W_o @ merged + b_o``, the merged context gated first with ``attn_output_gate``; ``tokens``: the columns
        of X a decode chunk's merged context belongs to (all without)."""
        if self.variants.w_gate is not None:  # W_o reads merged * sigmoid(W_gate @ X + b_gate): each token its own
            logits = self.variants.gate_logits(self.x_q if tokens is None else self.x_q[..., tokens])  # (B, H*Dv, Nq)
            gate, merged = self.ops.output_gate(merged, logits)  # (B, H*Dv, Nq) each, new arrays
            if rec is not None:
                rec.record("gate", gate, ("B", "H*Dv", "Nq"), "sigmoid(W_gate @ X + b_gate): a row per merged feature")
        output = self._project(self.w_o, self.b_o, merged)  # (B, D, Nq)
        if rec is not None:
            rec.record("output", output, ("B", "D", "Nq"), "W_o @ merged + b_o; to_numpy transposes it to rows")
        return output

    # -- batched heads: STANDARD and DIRECT_RESHAPE --------------------------------------
    def _standard_heads(self, rec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The standard split's heads (q (B, H, Dk, Nq), k (B, Hkv, Dk, Nk), v (B, Hkv, Dv, Nk)): projected, split,
        QK-normed and rotated, then Llama 4's steps after rotary and Gemma 4's value norm (`_scored_heads`), recorded
        when ``rec`` is given; the chunked strategy's too."""
        H, Hkv = self.cfg.n_heads, self.cfg.n_kv_heads
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        # Head h owns rows h*Dk:(h+1)*Dk: splitting the row axis is a reshape, a view,
        # and no transpose is needed (unlike row samples' view + transpose(1, 2)).
        q_heads = _split_reshape(q, H)  # (B, H, Dk, Nq), view
        k_heads = _split_reshape(k, Hkv)  # (B, Hkv, Dk, Nk), view
        v_heads = _split_reshape(v, Hkv)  # (B, Hkv, Dv, Nk), view
        how = "reshape of the row axis, no transpose"
        heads = (q_heads, k_heads, v_heads)
        q_rotated, k_rotated = self._rotate_split(rec, (q, k, v), heads, how, _split_reshape)  # QK-normed, rotated
        return self._scored_heads(rec, q_rotated, k_rotated, v_heads)  # what the scores and the weighted sum read

    def standard(self, rec: StageRecorder | None = None) -> np.ndarray:
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        q_rotated, k_rotated, v_heads = self._standard_heads(rec)
        context = self._attend_batched(q_rotated, k_rotated, v_heads, rec)  # (B, H, Dv, Nq)
        merged = context.reshape(B, H * Dv, Nq)  # (B, H*Dv, Nq): heads stacked as row blocks
        if rec is not None:
            relation = relation_to(merged, context)
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), "reshape, no transpose", relation, "context")
        return self._finish(merged, rec)

    def direct_reshape(self, rec: StageRecorder | None = None) -> np.ndarray:
        """The known mistake, as someone porting row-sample code would make it here."""
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        q_heads = _split_direct(q, H)  # (B, H, Dk, Nq), wrong cells
        k_heads = _split_direct(k, Hkv)  # (B, Hkv, Dk, Nk), wrong cells
        v_heads = _split_direct(v, Hkv)  # (B, Hkv, Dv, Nk), wrong cells
        how = "the direct-reshape MISTAKE (row data (N, H*d) reshaped straight to (H, N, d))"
        heads = (q_heads, k_heads, v_heads)
        q_rotated, k_rotated = self._rotate_split(rec, (q, k, v), heads, how, _split_direct)  # QK-normed, rotated
        context = self._attend_batched(*self._scored_heads(rec, q_rotated, k_rotated, v_heads), rec)  # (B, H, Dv, Nq)
        # The same mistake undone the same way: (H, N, Dv) reshaped straight to (N, H*Dv).
        rows = context.transpose(0, 1, 3, 2).reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv), copy
        merged = rows.transpose(0, 2, 1)  # (B, H*Dv, Nq), view
        if rec is not None:
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), "the direct-reshape mistake undone", "copy", "context")
        return self._finish(merged, rec)

    # -- one head at a time: SLICING and PER_HEAD -----------------------------------------
    def slicing(self, rec: StageRecorder | None = None) -> np.ndarray:
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        if rec is not None:
            self._record_projections(rec, q, k, v)
        merged = np.empty((B, H * Dv, Nq), dtype=self.precision.storage)  # (B, H*Dv, Nq)
        # Each kv head's keys QK-normed and rotated once, before the loop over query heads.
        k_normed = self._normed_slices(k, Hkv, "k")  # Hkv x (B, Dk, Nk)
        k_rotated = [self._rotate(k_g, "k", head_axis=False) for k_g in k_normed]
        v_heads = [v[:, g * Dv : (g + 1) * Dv] for g in range(Hkv)]  # Hkv x (B, Dv, Nk): row blocks, views
        k_scored, v_read = self._scored_kv_heads(rec, k_rotated, v_heads)  # after rotary; the values' norm
        q_normed = self._normed_slices(q, H, "q")  # H x (B, Dk, Nq): row-block views without qk_norm
        for h in range(H):
            g = h // G
            q_h = q[:, h * Dk : (h + 1) * Dk]  # (B, Dk, Nq): row block h, a view
            k_g = k[:, g * Dk : (g + 1) * Dk]  # (B, Dk, Nk)
            q_rotated = self._rotate(q_normed[h], "q", head_axis=False)  # (B, Dk, Nq)
            note = "row-block slice of the merged projection"
            normed = (q_normed[h], k_normed[g])
            self._record_head(rec, h, (q_h, k_g, v_heads[g]), normed, (q_rotated, k_rotated[g]), note, "view")
            q_scored = self._after_rotary(rec, q_rotated, "q", h)  # (B, Dk, Nq)
            merged[:, h * Dv : (h + 1) * Dv] = self._attend_one_head(h, q_scored, k_scored[g], v_read[g], rec)
        self._record_k_normed(rec, k_normed)
        if rec is not None:
            note = "each head's context written into its row block"
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), note, "copy", "context")
        return self._finish(merged, rec)

    def per_head(self, rec: StageRecorder | None = None) -> np.ndarray:
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        # Each kv head's keys and values once, then each query head's queries with the head's own matrix.
        # Hkv x (B, Dk, Nk), Hkv x (B, Dv, Nk), H x (B, Dk, Nq) = W_h^T @ X
        k_heads = [self._project(self.w_k_heads[g], self.b_k_heads[g], self.x_k) for g in range(Hkv)]
        v_heads = [self._project(self.w_v_heads[g], self.b_v_heads[g], self.x_v) for g in range(Hkv)]
        q_heads = [self._project(self.w_q_heads[h], self.b_q_heads[h], self.x_q) for h in range(H)]
        k_normed = self._norm_blocks(k_heads, "k")  # Hkv x (B, Dk, Nk): the heads themselves without qk_norm
        q_normed = self._norm_blocks(q_heads, "q")  # H x (B, Dk, Nq)
        k_rotated = [self._rotate(k_g, "k", head_axis=False) for k_g in k_normed]  # Hkv x (B, Dk, Nk)
        k_scored, v_read = self._scored_kv_heads(rec, k_rotated, v_heads)  # after rotary; the values' norm
        head_note = "W_h^T @ X with the head's own matrix"
        contexts = []
        for h in range(H):
            g = h // G
            q_rotated = self._rotate(q_normed[h], "q", head_axis=False)  # (B, Dk, Nq)
            raw, normed = (q_heads[h], k_heads[g], v_heads[g]), (q_normed[h], k_normed[g])
            self._record_head(rec, h, raw, normed, (q_rotated, k_rotated[g]), head_note)
            q_scored = self._after_rotary(rec, q_rotated, "q", h)  # (B, Dk, Nq)
            contexts.append(self._attend_one_head(h, q_scored, k_scored[g], v_read[g], rec))
        self._record_k_normed(rec, k_normed)
        merged = np.concatenate(contexts, axis=1)  # (B, H*Dv, Nq): [C_0; C_1; ...] as row blocks
        if rec is not None:
            note = "the per-head projections stacked as row blocks, for inspection (the strategy never builds it)"
            self._record_joined_projections(rec, functools.partial(np.concatenate, axis=1), note)
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), "concatenation of the heads' contexts", "copy", "context")
        return self._finish(merged, rec)
