"""The score steps of the row-sample torch layer (`RowScoreSteps`, a part of `layer.RowSampleMHA`): scores by
``baddbmm`` with the scale fused, the score steps (`frameworks.ops.score_steps` on torch's ops object) and the
weighted sum by ``bmm``, for every head at once (each kv head's G queries folded into the token axis) or one
head at a time.
"""

from __future__ import annotations

from ..frameworks.ops import STEP_HOW, score_steps
from ..frameworks.score_parts import score_parts


def _step_note(stage: str, in_place: bool, parent: str, masked: bool, joined: bool) -> str:
    """How this adapter makes a score stage (`RowSampleMHA._mask_and_softmax`), as its recording says."""
    if stage == "capped_scores":
        return STEP_HOW[stage] + (", in place" if in_place else "")
    if stage == "biased_scores":
        return STEP_HOW[stage] + ", the tables from NumPy"
    if stage == "masked_scores":
        return "masked_fill_(blocked, -inf), in place" if masked else f"no mask: {parent} itself"
    if joined:  # a score part in the softmax's denominator (`frameworks.score_parts`)
        return "torch.softmax over keys with the sink as one more column, dropped after; empty rows zeros"
    return "torch.softmax over keys; empty rows set to zeros"


class RowScoreSteps:
    """Scores, mask, softmax and weighted sum of `layer.RowSampleMHA` (a mixin: ``self`` is the layer, its
    `MHAConfig`, ops object, mask tensors, score bias, score parts' parameters and buffers included)."""

    def _mask_and_softmax(self, scores, blocked, empty_rows, rec, head: int | None, out=None):
        """The score steps after the product (`frameworks.ops.score_steps` on torch's ops object), in place
        where autograd allows; the weights into ``out`` where given.

        Rows with no allowed key get zeros, never NaN. ``head`` None: all heads (B, H, Nq, Nk);
        else query head ``head``'s (B, Nq, Nk).
        """
        axes = ("B", "H", "Nq", "Nk") if head is None else ("B", "Nq", "Nk")
        self._record(
            rec, "scores", head, scores, axes, "baddbmm(q, k^T, alpha=scale): the scale fused into the product"
        )
        # The score parts (`frameworks.score_parts`) against the scores: (H, 1, 1), or head h's (1, 1).
        lay_out = (lambda t: t.view(-1, 1, 1)) if head is None else (lambda t: t[head].view(1, 1))
        parts = score_parts(self.cfg, self, lay_out)
        on_stage = None
        if rec is not None:

            def on_stage(name, value, parent, before):
                note = _step_note(name, value is before, parent, blocked is not None, bool(parts))
                relation = "view" if value is before and name != "weights" else "new"
                self._record(rec, name, head, value, axes, note, relation, parent)

        bias = None if self.score_bias is None else self.score_bias(self.rel_bias, head=head)
        masks = {"bias": bias, "blocked": blocked, "empty_rows": empty_rows}
        return score_steps(self.ops, self.cfg, scores, **masks, **parts, out=out, on_stage=on_stage)

    def _attend_batched(self, q_heads, k_heads, v_heads, rec):
        """Scores, mask, softmax, weighted sum for all heads -> context (B, H, Nq, Dv)."""
        torch = self.torch
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes
        # Fold the G query heads of each kv head into the token axis (see the module docstring).
        q_groups = q_heads.reshape(B * Hkv, G * Nq, Dk)  # (B*Hkv, G*Nq, Dk), copy (a view of contiguous rotated heads)
        k_groups = k_heads.reshape(B * Hkv, Nk, Dk)  # (B*Hkv, Nk, Dk), copy
        v_groups = v_heads.reshape(B * Hkv, Nk, Dv)  # (B*Hkv, Nk, Dv), copy
        scores = torch.baddbmm(
            self.zero, q_groups, k_groups.transpose(1, 2), beta=0.0, alpha=self.cfg.scale, out=self.scores_buffer
        )  # (B*Hkv, G*Nq, Nk)
        scores = scores.view(B, H, Nq, Nk)  # (B, H, Nq, Nk)
        out = None if self.weights_buffer is None else self.weights_buffer.view(B, H, Nq, Nk)  # None: autograd
        weights = self._mask_and_softmax(scores, self.blocked, self.empty_rows, rec, head=None, out=out)
        context = torch.bmm(weights.view(B * Hkv, G * Nq, Nk), v_groups)  # (B*Hkv, G*Nq, Dv)
        context = context.view(B, H, Nq, Dv)  # (B, H, Nq, Dv)
        if rec is not None:
            rec.record(
                "context", context, ("B", "H", "Nq", "Dv"), "bmm(weights, v) with each group's queries folded together"
            )
        return context

    def _attend_one_head(self, h: int, q_h, k_g, v_g, rec):
        """Attention of query head h: (B, Nq, Dk), (B, Nk, Dk), (B, Nk, Dv) -> (B, Nq, Dv)."""
        torch = self.torch
        scores = torch.baddbmm(self.zero, q_h, k_g.transpose(1, 2), beta=0.0, alpha=self.cfg.scale)  # (B, Nq, Nk)

        def head_slice(mask):  # (1|B, 1|H, Nq, n) -> (1|B, Nq, n)
            return None if mask is None else mask[:, 0 if mask.shape[1] == 1 else h]

        weights = self._mask_and_softmax(scores, head_slice(self.blocked), head_slice(self.empty_rows), rec, head=h)
        context = torch.bmm(weights, v_g)  # (B, Nq, Dv)
        self._record(rec, "context", h, context, ("B", "Nq", "Dv"), "bmm(weights_h, v_g)")
        return context
