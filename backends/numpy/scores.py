"""The score steps of the NumPy layer, in column samples: scores ``scale * K_g^T @ Q_h`` (Nk, Nq), the score
steps over keys (axis -2) and the weighted sum ``V_g @ A_h``, for every head at once or one head at a time
(`ColumnScoreSteps`, a part of `layer.ColumnSampleMHA`; the decode layer runs the same steps on its cache).
"""

from __future__ import annotations

import numpy as np

from .._recording import relation_to
from ..frameworks.ops import STEP_HOW, score_steps
from .common import MaskArrays

SCORE_AXES = ("B", "H", "Nk", "Nq")  # one column per query, as everywhere in this adapter
# How each score step's stage is made here (`_mask_and_softmax`), as the recording says.
SCORE_STEP_NOTES = {
    **{stage: f"{how}, in place" for stage, how in STEP_HOW.items()},
    "weights": "softmax over keys (each query's column), in place; empty columns are zeros",
}


class ColumnScoreSteps:
    """Scores, mask, softmax and weighted sum of `layer.ColumnSampleMHA` (a mixin: ``self`` is the layer, its
    `MHAConfig`, precision, ops object, mask, variants and score workspace included)."""

    def _attend_batched(self, q_heads, k_heads, v_heads, rec, keys: tuple | None = None) -> np.ndarray:
        """Scores, mask, softmax and weighted sum for all heads at once -> (B, H, Dv, Nq).

        ``keys``: a decode chunk's ``(mask, bias)`` over its keys (the cache's slots, `decode`), whose sizes the
        arrays give; None: the layer's own mask, bias and score workspace, at the layer's sizes."""
        B, H, Dk, Nq = q_heads.shape
        Hkv, Dv, Nk = v_heads.shape[1:]
        G = H // Hkv
        mask, bias, workspace = (self.mask, None, self.workspace) if keys is None else (*keys, None)
        P = self.precision
        # Scaling the queries costs Dk*Nq multiplies per head instead of Nk*Nq on the
        # scores. In place (unless half precision makes a float32 copy): q is done.
        queries = P.operand(q_heads)
        queries *= self.cfg.scale
        # GQA: query head h reads kv head h // G. Splitting the head axis into (Hkv, G)
        # lets one broadcast product serve a whole group; G = 1 is plain MHA.
        q_groups = queries.reshape(B, Hkv, G, Dk, Nq)  # (B, Hkv, G, Dk, Nq), view
        keys_t = k_heads[:, :, None].swapaxes(-1, -2)  # (B, Hkv, 1, Nk, Dk), view: K_g^T
        scores = P.matmul(keys_t, q_groups, out=workspace)  # (B, Hkv, G, Nk, Nq)
        scores = P.store(scores).reshape(B, H, Nk, Nq)  # (B, H, Nk, Nq), view
        weights = self._mask_and_softmax(scores, mask, rec, head=None, bias=bias)
        weight_groups = weights.reshape(B, Hkv, G, Nk, Nq)  # (B, Hkv, G, Nk, Nq), view
        # context_h = V_g @ A_h: (Dv, Nk) @ (Nk, Nq) = (Dv, Nq), column samples again.
        context = P.matmul(v_heads[:, :, None], weight_groups)  # (B, Hkv, G, Dv, Nq)
        context = P.store(context).reshape(B, H, Dv, Nq)  # (B, H, Dv, Nq), view
        if rec is not None:
            rec.record("context", context, ("B", "H", "Dv", "Nq"), "V_g @ A_h per head: one column per query")
        return context

    def _mask_and_softmax(self, scores, mask: MaskArrays | None, rec, head: int | None, bias=None) -> np.ndarray:
        """The score steps (`frameworks.ops.score_steps`) over keys (axis -2), in place unless half precision;
        outside a recording one cache-sized block at a time (`NumpyOps.in_blocks`).

        ``head`` None: the scores of every head (B, H, Nk, Nq); else query head ``head``'s (B, Nk, Nq).
        ``bias``: these scores' own score bias (a decode chunk's, laid out like them); None: the layer's.
        """
        bias = self.variants.head_bias(head) if bias is None else bias
        axes = SCORE_AXES if head is None else ("B", "Nk", "Nq")
        on_stage = None
        if rec is not None:
            self._record(rec, "scores", head, scores, axes, "scale * K_g^T @ Q_h (scale folded into the queries)")

            def on_stage(name, value, parent, before):
                relation = "view" if name == "masked_scores" else relation_to(value, before, "new")
                self._record(rec, name, head, value, axes, self._step_note(name), relation, parent)

        empty_rows = None if mask is None else mask.empty_rows
        blocked = None if mask is None else mask.blocked
        parts = self.variants.head_parts(head)
        return score_steps(
            self.ops, self.cfg, scores, bias=bias, blocked=blocked, empty_rows=empty_rows, **parts, on_stage=on_stage
        )

    def _step_note(self, stage: str) -> str:
        """How this adapter makes a score stage, as its recording says."""
        if stage == "weights" and self.variants.parts:
            return SCORE_STEP_NOTES[stage] + "; each head's sink in every denominator"
        return SCORE_STEP_NOTES[stage]

    def _attend_one_head(self, h: int, q_h, k_g, v_g, rec) -> np.ndarray:
        """Attention of query head h: (B, Dk, Nq), (B, Dk, Nk), (B, Dv, Nk) -> (B, Dv, Nq)."""
        P = self.precision
        queries = P.operand(q_h) * self.cfg.scale  # (B, Dk, Nq), a fresh array: q_h may be a view of q
        scores = P.store(P.matmul(k_g.swapaxes(-1, -2), queries))  # (B, Nk, Nq)
        mask = None if self.mask is None else self.mask.for_head(h)
        weights = self._mask_and_softmax(scores, mask, rec, head=h)  # (B, Nk, Nq)
        context = P.store(P.matmul(v_g, weights))  # (B, Dv, Nq)
        self._record(rec, "context", h, context, ("B", "Dv", "Nq"), "V_g @ A_h")
        return context
