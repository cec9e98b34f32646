"""QK-norm and the recording of rotary in the row-sample torch layer (`RowHeadSteps`, a part of
`layer.RowSampleMHA`): ``F.rms_norm`` over the merged projection before the split ("projection") or over each
head's features after it ("head"), for the batched heads and one head at a time; a rank of torch-tp all-reduces
the projection-wide sum of squares. Where and with which weights is the registry's `NormStep` (the layer's
``norm_step``, `core.variants.norm_step`): no variant is named here.
"""

from __future__ import annotations

from .._layouts import HEADS_FIRST_SPLIT_AXES
from .._recording import record_rotated
from .variants import rms_norm, rms_norm_of_sum

ROTATE_HOW = "pairs of the last (feature) axis turned by each token's angle (rotary)"


class RowHeadSteps:
    """The QK-norm steps of `layer.RowSampleMHA` and the recording of its rotation (a mixin: ``self`` is the layer,
    its `MHAConfig`, ``norm_step``, norm weights, ``norm_sum``, rotary tables and `_rotate` included)."""

    def _norm_weight(self, which: str):
        """The norm's weight of ``which`` ("q" or "k"): the layer's tensor named by the step's `MHAParams` field."""
        return getattr(self, self.norm_step.weight(which))

    def _rms(self, x, which: str):
        """``F.rms_norm`` of ``x`` over its last axis with the norm's weight of ``which``."""
        return rms_norm(x, self._norm_weight(which), self.cfg.norm_eps)

    def _whole_squares(self, squares, which: str):
        """(sum of squares, width) of a projection-wide norm: ``squares`` (B, N, 1), the sum over this layer's
        features, all-reduced over the ranks on a rank of torch-tp (``norm_sum``), and the whole layer's width."""
        if self.norm_sum is not None:
            squares = self.norm_sum(squares, which)
        return squares, self.norm_widths[0 if which == "q" else 1]

    def _norm_projection(self, x, which: str):
        """A projection-wide QK-norm of the merged q or k (B, N, width): over every head's features at once.

        A rank of torch-tp holds some heads' features only: the sum of squares is all-reduced
        (``norm_sum``) and divided by the whole layer's width.
        """
        if self.norm_sum is None:
            return self._rms(x, which)  # F.rms_norm over the whole projection
        squares, width = self._whole_squares((x * x).sum(dim=-1, keepdim=True), which)  # (B, N, 1), over the ranks
        return rms_norm_of_sum(x, self._norm_weight(which), self.cfg.norm_eps, squares, width)

    def _normed_split(self, rec, projections: tuple, heads: tuple, split):
        """(q_normed, k_normed): the heads after QK-norm, recorded; the heads themselves without it.

        ``split(x, n_heads)`` is the strategy's own head split (B, N, n*Dk) -> (B, n, N, Dk):
        a projection-wide norm is taken before it, a per-head one after it.
        """
        cfg, step = self.cfg, self.norm_step
        if step is None:
            return heads
        (q, k, _), (q_heads, k_heads) = projections, heads
        if step.per_head:
            normed = self._rms(q_heads, "q"), self._rms(k_heads, "k")
            how, parents = "F.rms_norm over each head's Dk features (one weight for every head)", ("q_heads", "k_heads")
        else:
            normed = (
                split(self._norm_projection(q, "q"), cfg.n_heads),
                split(self._norm_projection(k, "k"), cfg.n_kv_heads),
            )
            how, parents = "F.rms_norm over the whole projection, then the same head split", (None, None)
        if rec is not None:
            for name, value, parent in zip(("q_normed", "k_normed"), normed, parents, strict=True):
                rec.record(name, value, HEADS_FIRST_SPLIT_AXES[name.replace("normed", "heads")], how, "new", parent)
        return normed

    def _rotate_split(self, rec, q_heads, k_heads):
        """(q_rotated, k_rotated) of the batched heads (B, H, N, Dk) (normed, with QK-norm), recorded when
        ``rec`` is given."""
        rotated = self._rotate(q_heads, "q", head_axis=True), self._rotate(k_heads, "k", head_axis=True)
        if rec is not None:
            record_rotated(rec, (q_heads, k_heads), rotated, HEADS_FIRST_SPLIT_AXES, ROTATE_HOW)
            if self.norm_step is not None:  # turned from the normed heads, not the split ones
                for name, value, parent in zip(("q_rotated", "k_rotated"), rotated, (q_heads, k_heads), strict=True):
                    note, relation = (
                        (ROTATE_HOW, "new") if value is not parent else ("the normed heads, no rope", "view")
                    )
                    rec.record(name, value, HEADS_FIRST_SPLIT_AXES[name], note, relation, name[0] + "_normed")
        return rotated

    def _normed_heads(self, rec, which: str, heads: list, merged=None) -> list:
        """One head at a time: the heads (B, N, Dk) after QK-norm (the heads themselves without it), recorded whole.

        A projection-wide norm needs every head's features: ``merged`` (SLICING: the merged
        projection, normed before it is sliced) or, without it (PER_HEAD: the strategy never
        builds the projection), the heads' sums of squares added up, one weight slice per head.
        """
        cfg, step = self.cfg, self.norm_step
        if step is None:
            return heads
        Dk = cfg.d_k
        if step.per_head:
            normed = [self._rms(x, which) for x in heads]
            how = "F.rms_norm of each head's Dk features"
        elif merged is not None:
            whole = self._norm_projection(merged, which)  # (B, N, n*Dk)
            normed = [whole[:, :, i * Dk : (i + 1) * Dk] for i in range(len(heads))]  # column slices, views
            how = "F.rms_norm over the whole projection, then column slices"
        else:
            # (B, N, 1): over every head's features (and every rank's, on torch-tp)
            squares, width = self._whole_squares(sum((x * x).sum(dim=-1, keepdim=True) for x in heads), which)
            weight = self._norm_weight(which)  # (n*Dk,): head i reads its slice
            normed = [
                rms_norm_of_sum(x, weight[i * Dk : (i + 1) * Dk], cfg.norm_eps, squares, width)
                for i, x in enumerate(heads)
            ]
            how = "RMSNorm over the whole projection: the heads' sums of squares added up, each head its weight slice"
        if rec is not None:
            name, head_axis = f"{which}_normed", "H" if which == "q" else "Hkv"
            note = how + " (one head at a time, stacked for inspection)"
            rec.record(name, self.torch.stack(normed, 1), ("B", head_axis, "N" + which, "Dk"), note)
        return normed

    def _record_normed_rotation(self, rec, h: int, q_rotated, k_rotated) -> None:
        """With QK-norm, q_rotated and k_rotated are turned from the normed heads: say so (per head)."""
        if rec is None or self.norm_step is None:
            return
        note, relation = (ROTATE_HOW, "new") if self.rotary is not None else ("the normed heads, no rope", "new")
        axes = self.HEAD_SLICE_AXES
        self._record(rec, "q_rotated", h, q_rotated, axes["q_rotated"], note, relation, "q_normed")
        self._record(rec, "k_rotated", self.cfg.kv_head_of(h), k_rotated, axes["k_rotated"], note, relation, "k_normed")
