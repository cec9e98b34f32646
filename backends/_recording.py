"""Collecting stage tensors during an untimed forward pass, for any array library.

A forward function takes an optional `StageRecorder`. The timed pass gives None and
records nothing; `native_stages()` runs the same function with a recorder. Recorded
values are copies taken at the moment of recording (later in-place steps cannot change
them) that keep the original's axis order and strides where the original is dense, so
the explainer still sees the layout the adapter really had. Whether the live tensor was
a view of its parent or a fresh copy is measured on the live tensors (`relation_to`) and
recorded in `StageTensor.relation` and `.parent`.
"""

from __future__ import annotations

from collections.abc import Callable

from mha_rosetta.backends.base import StageTensor
from mha_rosetta.backends.frameworks import shares_memory, snapshot

QKV = ("q", "k", "v")
# Stages with one slice per kv head (the others have one per query head).
KV_HEAD_STAGES = ("k_heads", "v_heads", "k_rotated")


def relation_to(child, parent, otherwise: str = "copy") -> str:
    """``"view"`` when the live ``child`` uses ``parent``'s memory, else ``otherwise``.

    ``otherwise`` is "copy" for a reshape or rearrange that had to move the numbers, "new"
    for a step that may work in place (mask, softmax) but wrote a fresh buffer instead.
    """
    return "view" if shares_memory(child, parent) else otherwise


class StageRecorder:
    """Stage tensors by canonical name, plus per-head pieces stacked at the end."""

    def __init__(self) -> None:
        self._stages: dict[str, StageTensor] = {}
        self._heads: dict[str, dict[int, object]] = {}
        self._head_meta: dict[str, tuple] = {}

    def record(
        self, name: str, value, axes: tuple[str, ...], note: str = "", relation: str = "new", parent: str | None = None
    ) -> None:
        self._stages[name] = StageTensor(snapshot(value), tuple(axes), note, relation, parent)

    def record_head(
        self,
        name: str,
        head: int,
        value,
        axes: tuple[str, ...],
        note: str,
        stack,
        relation: str = "new",
        parent: str | None = None,
    ) -> None:
        """One head's slice of a stage; ``axes`` are the slice's axes (without the head axis).

        ``stack(list_of_arrays, axis)`` joins the heads (np.stack or torch.stack); the
        head axis goes right after the batch axis.
        """
        self._heads.setdefault(name, {})[head] = snapshot(value)
        self._head_meta[name] = (tuple(axes), note, stack, relation, parent)

    def head_pieces(self, name: str) -> list:
        """The slices `record_head` took of a stage (snapshots), in head order."""
        pieces = self._heads[name]
        return [pieces[h] for h in sorted(pieces)]

    def stages(self) -> dict[str, StageTensor]:
        result = dict(self._stages)
        for name, pieces in self._heads.items():
            axes, note, stack, relation, parent = self._head_meta[name]
            head_axis = "Hkv" if name in KV_HEAD_STAGES else "H"
            value = stack([pieces[h] for h in sorted(pieces)], 1)
            result[name] = StageTensor(value, (axes[0], head_axis, *axes[1:]), note, relation, parent)
        return result


def record_stages(run: Callable) -> dict[str, StageTensor]:
    """``run(recorder)`` once, untimed, and what it recorded: an adapter's ``native_stages``."""
    recorder = StageRecorder()
    run(recorder)
    return recorder.stages()


def record_projections(
    rec: StageRecorder, projections: tuple, axes: dict, note: str, relation: str = "new", parents: tuple = (None,) * 3
) -> None:
    """q, k and v (in that order) with the axes ``axes`` gives each, under one note."""
    for name, value, parent in zip(QKV, projections, parents, strict=True):
        rec.record(name, value, axes[name], note, relation, parent)


def record_split_heads(rec: StageRecorder, projections: tuple, heads: tuple, axes: dict, how: str) -> None:
    """q_heads, k_heads and v_heads, each a view or copy (measured) of the projection it was split from."""
    for name, parent, child in zip(QKV, projections, heads, strict=True):
        rec.record(f"{name}_heads", child, axes[f"{name}_heads"], how, relation_to(child, parent), name)


NO_ROPE_NOTE = "no rotary embedding (cfg.rope is None), the heads themselves"


def rotation_provenance(rotated, heads, how: str) -> tuple[str, str]:
    """(note, relation) of a rotated stage: the heads themselves without rope, else a new buffer made by ``how``."""
    return (NO_ROPE_NOTE, "view") if rotated is heads else (how, "new")


def record_rotated(rec: StageRecorder, heads: tuple, rotated: tuple, axes: dict, how: str) -> None:
    """q_rotated and k_rotated, each made from the heads stage of its name."""
    for name, parent, child in zip(("q", "k"), heads, rotated, strict=True):
        note, relation = rotation_provenance(child, parent, how)
        rec.record(f"{name}_rotated", child, axes[f"{name}_rotated"], note, relation, f"{name}_heads")


class LayerRecording:
    """The recording steps that the NumPy (column-sample) and torch (row-sample) layers share.

    A layer class names its convention's axes and notes as class attributes and joins the
    heads with its library's ``_stack``; ``self.cfg`` is its `MHAConfig`.
    """

    PROJECTION_AXES: dict  # q, k, v
    SPLIT_AXES: dict  # the batched heads stages (q_heads ... k_rotated)
    HEAD_SLICE_AXES: dict  # one head's slice of them
    PROJECTION_NOTE: str
    ROTATE_HOW: str

    def _stack(self, arrays: list, axis: int):
        raise NotImplementedError

    def _record(self, rec, name: str, head: int | None, value, axes, note: str, relation="new", parent=None) -> None:
        """A whole stage (``head`` None) or one head's slice of it; nothing when ``rec`` is None."""
        if rec is None:
            return
        if head is None:
            rec.record(name, value, axes, note, relation, parent)
        else:
            note += " (one head at a time, stacked for inspection)"
            rec.record_head(name, head, value, axes, note, self._stack, relation, parent)

    def _record_projections(self, rec: StageRecorder, q, k, v, note: str | None = None, *provenance) -> None:
        record_projections(rec, (q, k, v), self.PROJECTION_AXES, note or self.PROJECTION_NOTE, *provenance)

    def _record_split(self, rec: StageRecorder, projections: tuple, heads: tuple, how: str) -> None:
        self._record_projections(rec, *projections)
        record_split_heads(rec, projections, heads, self.SPLIT_AXES, how)

    def _record_query_head(self, rec, h: int, q_h, k_g, v_g, q_rotated, k_rotated, note: str, relation="new") -> None:
        """Query head h's (q_h, k_g, v_g), its rotated queries and its kv head's rotated keys, in a loop over heads;
        nothing when ``rec`` is None. ``relation`` "view": q_h, k_g, v_g are views of the projections q, k and v;
        ``q_rotated is q_h``: no rope."""
        if rec is None:
            return
        g, axes = self.cfg.kv_head_of(h), self.HEAD_SLICE_AXES
        for name, head, value in zip(QKV, (h, g, g), (q_h, k_g, v_g), strict=True):
            parent = name if relation != "new" else None
            rec.record_head(f"{name}_heads", head, value, axes[f"{name}_heads"], note, self._stack, relation, parent)
        note, relation = rotation_provenance(q_rotated, q_h, self.ROTATE_HOW)
        self._record(rec, "q_rotated", h, q_rotated, axes["q_rotated"], note, relation, "q_heads")
        self._record(rec, "k_rotated", g, k_rotated, axes["k_rotated"], note, relation, "k_heads")

    def _record_joined_projections(self, rec: StageRecorder, join, note: str) -> None:
        """q, k and v as the recorded heads joined by ``join`` (copies: a per-head strategy never builds them)."""
        parents = tuple(f"{name}_heads" for name in QKV)
        projections = [join(rec.head_pieces(parent)) for parent in parents]
        self._record_projections(rec, *projections, note, "copy", parents)
