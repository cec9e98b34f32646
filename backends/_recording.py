"""Collecting stage tensors during an untimed forward pass, for any array library.

A forward function takes an optional `StageRecorder`. The timed pass gives None and
records nothing; `native_stages()` runs the same function with a recorder. Recorded
values are copies taken at the moment of recording (later in-place steps cannot change
them) that keep the original's axis order and strides where the original is dense, so
the explainer still sees the layout the adapter really had; the note says whether the
live tensor was a view of its parent or a fresh copy.
"""

from __future__ import annotations

from collections.abc import Callable

from mha_rosetta.backends.base import StageTensor

QKV = ("q", "k", "v")
# Stages with one slice per kv head (the others have one per query head).
KV_HEAD_STAGES = ("k_heads", "v_heads", "k_rotated")


def snapshot(value):
    """A copy of a NumPy array or torch tensor that keeps its memory order."""
    if hasattr(value, "clone"):  # torch: clone() preserves strides of dense tensors
        return value.detach().clone()
    import numpy as np

    return np.array(value, copy=True, order="K")


def shares_memory(child, parent) -> bool:
    """Whether ``child`` is a view into ``parent``'s memory (NumPy or torch)."""
    if hasattr(child, "untyped_storage"):
        return child.untyped_storage().data_ptr() == parent.untyped_storage().data_ptr()
    import numpy as np

    return bool(np.shares_memory(child, parent))


def view_note(child, parent, parent_name: str, how: str) -> str:
    """E.g. "view of q: reshape" or "copy of q: reshape", from the real tensors."""
    kind = "view" if shares_memory(child, parent) else "copy"
    return f"{kind} of {parent_name}: {how}"


class StageRecorder:
    """Stage tensors by canonical name, plus per-head pieces stacked at the end."""

    def __init__(self) -> None:
        self._stages: dict[str, StageTensor] = {}
        self._heads: dict[str, dict[int, object]] = {}
        self._head_meta: dict[str, tuple[tuple[str, ...], str, object]] = {}

    def record(self, name: str, value, axes: tuple[str, ...], note: str = "") -> None:
        self._stages[name] = StageTensor(snapshot(value), tuple(axes), note)

    def record_head(self, name: str, head: int, value, axes: tuple[str, ...], note: str, stack) -> None:
        """One head's slice of a stage; ``axes`` are the slice's axes (without the head axis).

        ``stack(list_of_arrays, axis)`` joins the heads (np.stack or torch.stack); the
        head axis goes right after the batch axis.
        """
        self._heads.setdefault(name, {})[head] = snapshot(value)
        self._head_meta[name] = (tuple(axes), note, stack)

    def stages(self) -> dict[str, StageTensor]:
        result = dict(self._stages)
        for name, pieces in self._heads.items():
            axes, note, stack = self._head_meta[name]
            head_axis = "Hkv" if name in KV_HEAD_STAGES else "H"
            value = stack([pieces[h] for h in sorted(pieces)], 1)
            result[name] = StageTensor(value, (axes[0], head_axis, *axes[1:]), note)
        return result


def record_stages(run: Callable) -> dict[str, StageTensor]:
    """``run(recorder)`` once, untimed, and what it recorded: an adapter's ``native_stages``."""
    recorder = StageRecorder()
    run(recorder)
    return recorder.stages()


def record_stage(rec: StageRecorder | None, name: str, head: int | None, value, axes, note: str, stack) -> None:
    """A whole stage (``head`` None) or one head's slice of it; nothing when ``rec`` is None."""
    if rec is None:
        return
    if head is None:
        rec.record(name, value, axes, note)
    else:
        rec.record_head(name, head, value, axes, note + " (one head at a time, stacked for inspection)", stack)


def record_projections(rec: StageRecorder, projections: tuple, axes: dict, note: str) -> None:
    """q, k and v (in that order) with the axes ``axes`` gives each, under one note."""
    for name, value in zip(QKV, projections, strict=True):
        rec.record(name, value, axes[name], note)


def record_split_heads(rec: StageRecorder, projections: tuple, heads: tuple, axes: dict, how: str) -> None:
    """q_heads, k_heads and v_heads, each noted as a view or copy of the projection it was split from."""
    for name, parent, child in zip(QKV, projections, heads, strict=True):
        rec.record(f"{name}_heads", child, axes[f"{name}_heads"], view_note(child, parent, name, how))


def record_head_inputs(rec: StageRecorder, h: int, g: int, slices: tuple, axes: dict, note: str, stack) -> None:
    """Query head h's (q_h, k_g, v_g), ``axes`` being each slice's axes without the head axis."""
    for name, head, value in zip(QKV, (h, g, g), slices, strict=True):
        rec.record_head(f"{name}_heads", head, value, axes[f"{name}_heads"], note, stack)


def rotation_note(rotated, heads, heads_name: str, how: str) -> str:
    """The note of a rotated stage: the heads themselves without rope, else a new buffer made by ``how``."""
    if rotated is heads:
        return f"view of {heads_name}: no rotary embedding (cfg.rope is None), the heads themselves"
    return f"new buffer: {how}"


def record_rotated(rec: StageRecorder, heads: tuple, rotated: tuple, axes: dict, how: str) -> None:
    """q_rotated and k_rotated, each noted against the heads stage it was made from."""
    for name, parent, child in zip(("q", "k"), heads, rotated, strict=True):
        note = rotation_note(child, parent, f"{name}_heads", how)
        rec.record(f"{name}_rotated", child, axes[f"{name}_rotated"], note)


def record_head_rotated(rec: StageRecorder, h: int, g: int, q_h, rotated: tuple, axes: dict, how: str, stack) -> None:
    """Query head h's rotated queries and its kv head g's rotated keys, in a loop over heads.

    ``rotated`` is ``(q_rotated, k_rotated)``; ``q_rotated is q_h`` means no rope.
    """
    q_rotated, k_rotated = rotated
    note = rotation_note(q_rotated, q_h, "q_heads", how)
    record_stage(rec, "q_rotated", h, q_rotated, axes["q_rotated"], note, stack)
    k_note = f"new buffer: {how}" if q_rotated is not q_h else "no rotary embedding: the key heads themselves"
    record_stage(rec, "k_rotated", g, k_rotated, axes["k_rotated"], k_note, stack)
