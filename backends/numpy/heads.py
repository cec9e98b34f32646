"""The column-sample heads of the NumPy layer: their axes, the splits and the merge, rotary on feature rows,
and the norm before rotary between the split and the scores (`ColumnHeadSteps`, a part of `layer.ColumnSampleMHA`):
QK-norm, whose place (over each head's rows, or over the merged projection before the split) and weights the layer
reads from the registry (`core.variants.norm_step`), never from the variant's name.

Every token is a column and head h owns the row block ``h*Dk:(h+1)*Dk``: the standard split is a reshape of the
row axis (a view, no transpose), the direct-reshape mistake reads the rows as row samples, and the rotary
embedding turns pairs of feature *rows*. The backward (`vjp`) undoes each of them with the same functions.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core.variants import NormStep

from .._layouts import head_slice_axes, heads_axes
from .._recording import QKV, rotation_provenance
from ..base import tensor_to_numpy
from .common import NumpyPrecision
from .variants import rms_norm_rows

# Features before tokens: every token a column, every head a block of rows.
COLUMN_SAMPLE_AXES = {
    "q": ("B", "H*Dk", "Nq"),
    "k": ("B", "Hkv*Dk", "Nk"),
    "v": ("B", "Hkv*Dv", "Nk"),
    **heads_axes(("B", "H", "Dk", "Nq"), ("B", "Hkv", "Dk", "Nk"), ("B", "Hkv", "Dv", "Nk")),
    "q_normed": ("B", "H", "Dk", "Nq"),
    "k_normed": ("B", "Hkv", "Dk", "Nk"),
}
# q_heads: (B, Dk, Nq), the head axis stacked back in later
HEAD_SLICE_AXES = {**head_slice_axes(COLUMN_SAMPLE_AXES), "q_normed": ("B", "Dk", "Nq"), "k_normed": ("B", "Dk", "Nk")}
ROTATE_HOW = "pairs of feature rows turned by each token's angle (rotary)"
# What the normed stages hold, by the norm's place (`NormStep.place`), in column samples' words.
NORM_HOW = {
    "head": "RMSNorm down each token's column, over the Dk feature rows of each head's block",
    "projection": "RMSNorm down each token's column, over every row of the merged projection, before the split",
}


def columns_to_rows(output: np.ndarray) -> np.ndarray:
    """Native output (B, D, Nq) -> exchange layout (B, Nq, D); untimed."""
    return tensor_to_numpy(np.ascontiguousarray(output.transpose(0, 2, 1)))  # (B, Nq, D)


class ColumnHeadSteps:
    """The norm steps before rotary of `layer.ColumnSampleMHA` (`norm_step`: QK-norm) and their recording, batched
    or one head at a time (a mixin: ``self`` is the layer, its `MHAConfig`, precision, variants and `_rotate`
    included)."""

    @property
    def norm_step(self) -> NormStep | None:
        """The norm of the queries and keys before rotary (the registry's step, `ColumnVariants.norm_step`), or None."""
        return self.variants.norm_step

    @property
    def _norms_heads(self) -> bool:
        """Whether the norm takes each head's block over its own rows (after the split)."""
        return self.norm_step is not None and self.norm_step.per_head

    @property
    def _norms_projection(self) -> bool:
        """Whether the norm takes every row of the merged projection (before the split)."""
        return self.norm_step is not None and not self.norm_step.per_head

    def _norm_parent(self, which: str) -> str:
        """The stage the normed ``which`` ("q" or "k") is computed from: the heads, or the merged projection."""
        return f"{which}_heads" if self._norms_heads else which

    def _norm(self, x: np.ndarray, which: str) -> np.ndarray:
        """QK-norm of ``which`` ("q" or "k") over the feature rows of ``x`` (..., d, N): one head's block, a batch
        of head blocks (B, heads, Dk, N) or the merged projection (B, heads*Dk, N); a new array."""
        return rms_norm_rows([x], [self.variants.norms[which]], self.cfg.norm_eps, self.precision)[0]

    def _normed_heads(self, projections: tuple, heads: tuple, split) -> tuple:
        """(q_normed, k_normed), batched: the projections normed over every row and then split by ``split``
        (the norm's place "projection"), or the split heads normed over their own rows ("head"); the heads
        without a norm before rotary."""
        (q, k, _), (q_heads, k_heads, _) = projections, heads
        if self._norms_projection:
            return split(self._norm(q, "q"), self.cfg.n_heads), split(self._norm(k, "k"), self.cfg.n_kv_heads)
        if self._norms_heads:
            return self._norm(q_heads, "q"), self._norm(k_heads, "k")
        return q_heads, k_heads

    def _rotate_split(
        self, rec, projections: tuple, heads: tuple, how: str, split, tokens: slice | None = None
    ) -> tuple:
        """(q_rotated, k_rotated) of the batched heads (B, H, Dk, Nq), (B, Hkv, Dk, Nk): QK-normed (`_normed_heads`,
        the same ``split`` the heads were made with) and rotated (``tokens``: `_rotate`'s); the split (made as
        ``how`` says), the norm and the rotation recorded when ``rec`` is given."""
        normed = self._normed_heads(projections, heads, split)
        rotated = tuple(self._rotate(x, name, True, tokens) for x, name in zip(normed, ("q", "k"), strict=True))
        if rec is not None:
            self._record_split(rec, projections, heads, how)
            parents = ("q_heads", "k_heads")
            if self.norm_step is not None:
                for name, value in zip(("q", "k"), normed, strict=True):
                    axes = COLUMN_SAMPLE_AXES[f"{name}_normed"]
                    rec.record(f"{name}_normed", value, axes, self._norm_how, "new", self._norm_parent(name))
                parents = ("q_normed", "k_normed")
            for name, parent, before, after in zip(("q", "k"), parents, normed, rotated, strict=True):
                note, relation = rotation_provenance(after, before, ROTATE_HOW)
                rec.record(f"{name}_rotated", after, COLUMN_SAMPLE_AXES[f"{name}_rotated"], note, relation, parent)
        return rotated

    @property
    def _norm_how(self) -> str:
        return "" if self.norm_step is None else NORM_HOW[self.norm_step.place]

    def _normed_slices(self, merged: np.ndarray, n_heads: int, which: str) -> list:
        """The normed heads of a merged projection (B, n*Dk, N) as row blocks (B, Dk, N), one per head: the
        projection normed over every row before it is sliced, or each slice over its own rows; views without a norm."""
        Dk = self.cfg.d_k
        if self._norms_projection:
            merged = self._norm(merged, which)  # (B, n*Dk, N), a new array sliced below
        blocks = [merged[:, i * Dk : (i + 1) * Dk] for i in range(n_heads)]  # (B, Dk, N) views of row block i
        return self._norm_each_head(blocks, which)

    def _norm_blocks(self, blocks: list, which: str) -> list:
        """The normed heads of projections held apart (PER_HEAD, one (B, Dk, N) per head): over the projection
        the heads share one statistic per token, summed over their row blocks; the blocks themselves without."""
        V, eps, P = self.variants, self.cfg.norm_eps, self.precision
        if self._norms_projection:
            return rms_norm_rows(blocks, V.norm_weight_blocks(which, len(blocks)), eps, P)
        return self._norm_each_head(blocks, which)

    def _norm_each_head(self, blocks: list, which: str) -> list:
        """Each head's block (B, Dk, N) normed over its own rows where the norm is over the head; else the blocks."""
        return [self._norm(b, which) for b in blocks] if self._norms_heads else blocks

    def _record_head(self, rec, h: int, raw: tuple, normed: tuple, rotated: tuple, note: str, relation="new") -> None:
        """Query head h's q/k/v slices ``raw``, its QK-normed and rotated queries and its kv head's keys, in a loop
        over heads; nothing when ``rec`` is None (the kv heads' k_normed: `_record_k_normed`, after the loop)."""
        if rec is None:
            return
        if self.norm_step is None:
            self._record_query_head(rec, h, *raw, *rotated, note, relation)
            return
        g, axes = self.cfg.kv_head_of(h), self.HEAD_SLICE_AXES
        for name, head, value in zip(QKV, (h, g, g), raw, strict=True):
            parent = name if relation != "new" else None
            rec.record_head(f"{name}_heads", head, value, axes[f"{name}_heads"], note, self._stack, relation, parent)
        self._record(rec, "q_normed", h, normed[0], axes["q_normed"], self._norm_how, "new", self._norm_parent("q"))
        for name, head, before, after in zip(("q", "k"), (h, g), normed, rotated, strict=True):
            how, rel = rotation_provenance(after, before, ROTATE_HOW)
            self._record(rec, f"{name}_rotated", head, after, axes[f"{name}_rotated"], how, rel, f"{name}_normed")

    def _record_k_normed(self, rec, k_normed: list) -> None:
        """The kv heads' normed keys (a list of (B, Dk, Nk)), stacked whole: one slice per kv head."""
        if rec is not None and self.norm_step is not None:
            note = self._norm_how + " (one kv head at a time, stacked for inspection)"
            axes, parent = COLUMN_SAMPLE_AXES["k_normed"], self._norm_parent("k")
            rec.record("k_normed", self._stack(k_normed, 1), axes, note, "new", parent)


def _split_reshape(x: np.ndarray, n_heads: int) -> np.ndarray:
    """(B, heads*d, N) -> (B, heads, d, N): head h owns row block h; a view (of a contiguous x)."""
    B, width, N = x.shape
    return x.reshape(B, n_heads, width // n_heads, N)


def _merge_reshape(x: np.ndarray) -> np.ndarray:
    """(B, heads, d, N) -> (B, heads*d, N), the inverse of `_split_reshape` (view or copy)."""
    B, heads, d, N = x.shape
    return x.reshape(B, heads * d, N)


def rotate_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str, precision: NumpyPrecision) -> np.ndarray:
    """The rotary embedding in column samples: x (..., Dk, N), cos/sin (..., r/2, N) -> a new (..., Dk, N).

    Each feature pair is two *rows* of the head: rows i and i + r/2 ("half") or rows 2i
    and 2i + 1 ("interleaved", step-2 slices, views); rows past r pass through. Half
    precision computes in float32 and rounds once, like every other stage here.
    """
    P = precision
    h = cos.shape[-2]  # r/2 pairs
    r = 2 * h
    x = P.operand(x)  # the compute dtype (no copy at full precision)
    out = np.empty(x.shape, dtype=P.compute)  # (..., Dk, N)
    out[..., r:, :] = x[..., r:, :]  # partial rotary: the rest passes through
    rows_a, rows_b = (slice(0, h), slice(h, r)) if style == "half" else (slice(0, r, 2), slice(1, r, 2))
    a, b = x[..., rows_a, :], x[..., rows_b, :]  # (..., r/2, N) each, views
    first, second = out[..., rows_a, :], out[..., rows_b, :]  # views into out
    np.multiply(a, cos, out=first)
    first -= b * sin  # a cos - b sin
    np.multiply(b, cos, out=second)
    second += a * sin  # b cos + a sin
    return P.store(out)


def _split_direct(x: np.ndarray, n_heads: int) -> np.ndarray:
    """The direct-reshape mistake in column form: (B, H*d, N) -> (B, H, d, N), wrong cells.

    Seen as row samples the data is (B, N, H*d); reshaping that straight to (B, H, N, d)
    hands head h the tokens h*N/H ... with all their features, instead of every token
    with features h*d:(h+1)*d. Transposing back to columns keeps the wrong cells.
    """
    B, width, N = x.shape
    rows = x.transpose(0, 2, 1)  # (B, N, H*d): the same numbers as row samples, a view
    wrong = rows.reshape(B, n_heads, N, width // n_heads)  # (B, H, N, d): the mistake (a copy)
    return wrong.transpose(0, 1, 3, 2)  # (B, H, d, N): column samples again, a view
