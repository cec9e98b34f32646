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
from mha_rosetta.backends.frameworks.ops import HEAD_STEP_HOW, after_rotary, read_values

QKV = ("q", "k", "v")
# Stages with one slice per kv head (the others have one per query head).
KV_HEAD_STAGES = ("k_heads", "v_heads", "k_rotated", "k_rotated_normed", "v_normed")


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


def head_step_recorder(rec: StageRecorder | None, axes: dict):
    """``on_stage`` for `frameworks.ops.after_rotary` and `read_values` that records each step whole, in ``axes``
    (the convention's heads layout); None without a recorder."""
    if rec is None:
        return None

    def on_stage(name, value, parent):
        rec.record(name, value, axes[name], HEAD_STEP_HOW[name], "new", parent)

    return on_stage


def score_recorder(rec: StageRecorder | None, scores, axes: tuple[str, ...], note: str):
    """Records ``scores`` (in the convention's score ``axes``) and returns the ``on_stage`` of
    `frameworks.ops.score_steps` that records each step after it (a view where the step wrote in place,
    measured); None without a recorder."""
    if rec is None:
        return None
    rec.record("scores", scores, axes, note)

    def on_stage(name, value, parent, before):
        rec.record(name, value, axes, f"{name}: the ops object's step", relation_to(value, before, "new"), parent)

    return on_stage


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

    FEATURE_AXIS = -1  # where a head's features lie (row samples; column samples: -2)

    def _stack(self, arrays: list, axis: int):
        raise NotImplementedError

    def _laid_out_factors(self, batched: bool):
        """The temperature's factors ``self.factors`` (1|B, Nq) laid out against the batched query heads or one
        head's slice (each convention its own)."""
        raise NotImplementedError

    def _head_recorder(self, rec, head: int | None):
        """``on_stage`` for `after_rotary` and `read_values`: each step recorded whole or as ``head``'s slice."""
        if rec is None or head is None:
            return head_step_recorder(rec, self.SPLIT_AXES)
        axes = self.HEAD_SLICE_AXES

        def on_stage(name, value, parent):
            self._record(rec, name, head, value, axes[name], HEAD_STEP_HOW[name], "new", parent)

        return on_stage

    def _after_rotary(self, rec, heads, which: str, head: int | None = None):
        """Rotated query ("q") or key ("k") heads -> what the scores read (`frameworks.ops.after_rotary` on this
        layer's ops object): the batched heads with ``head`` None, else the slice of query or kv head ``head``."""
        factors = None if which == "k" or self.factors is None else self._laid_out_factors(head is None)
        return after_rotary(
            self.ops, self.cfg, heads, which, factors, self.FEATURE_AXIS, self._head_recorder(rec, head)
        )

    def _read_values(self, rec, v_heads, head: int | None = None):
        """The values the weighted sum reads (`frameworks.ops.read_values`): normed with value_norm, else themselves."""
        return read_values(self.ops, self.cfg, v_heads, self.FEATURE_AXIS, self._head_recorder(rec, head))

    def _scored_heads(self, rec, q_rotated, k_rotated, v_heads) -> tuple:
        """The batched heads the scores and the weighted sum read: Llama 4's steps after rotary on the rotated
        queries and keys, Gemma 4's value norm on the values (the heads themselves without them)."""
        q, k = self._after_rotary(rec, q_rotated, "q"), self._after_rotary(rec, k_rotated, "k")
        return q, k, self._read_values(rec, v_heads)

    def _scored_kv_heads(self, rec, k_rotated: list, v_heads: list) -> tuple[list, list]:
        """One kv head at a time: (the keys the scores read, the values the weighted sum reads), each a list of
        the Hkv heads (`_scored_heads`' steps, once per kv head before a loop over the query heads)."""
        keys = [self._after_rotary(rec, k_g, "k", g) for g, k_g in enumerate(k_rotated)]
        return keys, [self._read_values(rec, v_g, g) for g, v_g in enumerate(v_heads)]

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
