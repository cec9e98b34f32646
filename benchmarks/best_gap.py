"""Each cell over its framework's best path in the same run (issue 43): the gap a table names "x its best".

Our convention adapters are never a framework's speed: a figure that compares frameworks compares their
best paths (`backends.best`), and every other cell is shown beside its framework's best one at the same
size, as a ratio. Plain data in, fields added; `backends.best.best_path_for` names which best path a cell
is compared with (none for a runtime that has no best path here). `paged_over_contiguous` is the same kind of
ratio within one implementation: its paged decode step over its contiguous one, and `ragged_over_rectangular` its
ragged batch's step over the rectangular batch of the same tokens (issue 47).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def mark_over_best(cells: list[dict], same: Sequence[str], time_of: Callable[[dict], float | None]) -> None:
    """Add ``best_path`` and ``over_best`` (its time over the best path's) to each measured cell whose
    framework's best path was measured in ``cells`` with the same values of the fields ``same`` (the size,
    the device, the dtype); ``time_of(cell)`` is the time the table shows. Cells without one are left alone."""
    from mha_rosetta.backends.best import best_path_for

    def key(cell: dict) -> tuple:
        return tuple(_hashable(cell.get(name)) for name in same)

    best = {(cell["implementation"], *key(cell)): cell for cell in cells if cell.get("status") == "ok"}
    for cell in cells:
        path = best_path_for(cell["implementation"])
        reference = best.get((path, *key(cell)))
        if cell.get("status") != "ok" or reference is None or not time_of(reference):
            continue
        cell.update(best_path=path, over_best=time_of(cell) / time_of(reference))


def _hashable(value):
    """A cell's field as part of a key: a list (a ragged cell's ``lengths``, as JSON gives it back) as a tuple."""
    return tuple(value) if isinstance(value, list) else value


def paged_over_contiguous(cells: list[dict]) -> None:
    """Each measured paged cell's step over the same implementation's contiguous one (its default cache) at the same
    batch, rows, context, window, device, dtype and step (``paged_over_contiguous``): what reading K and V through the block
    table costs (the gather of the held pages), where the run timed both."""
    from mha_rosetta.backends._paged import PAGED

    same = ("implementation", "device", "dtype", "batch", "lengths", "context", "window", "step")
    contiguous = {
        tuple(_hashable(cell.get(name)) for name in same): cell
        for cell in cells
        if cell.get("status") == "ok" and cell.get("cache") is None
    }
    for cell in cells:
        reference = contiguous.get(tuple(_hashable(cell.get(name)) for name in same))
        if cell.get("cache") != PAGED or cell.get("status") != "ok" or reference is None:
            continue
        if cell.get("step_s") and reference.get("step_s"):
            cell["paged_over_contiguous"] = cell["step_s"] / reference["step_s"]


def ragged_over_rectangular(cells: list[dict]) -> None:
    """Each measured ragged cell's step over the same implementation's rectangular cell holding the same tokens (the
    same batch, context, cache kind, window, device, dtype and step): ``ragged_over_rectangular``, what decoding the
    rows at different lengths costs (a contiguous cache reads every row to the longest: its pads are slots)."""
    same = ("implementation", "device", "dtype", "batch", "context", "window", "step", "cache")
    rectangular = {
        tuple(cell.get(name) for name in same): cell
        for cell in cells
        if cell.get("status") == "ok" and not cell.get("lengths") and cell.get("step_s")
    }
    for cell in cells:
        reference = rectangular.get(tuple(cell.get(name) for name in same))
        if cell.get("lengths") and cell.get("status") == "ok" and cell.get("step_s") and reference is not None:
            cell["ragged_over_rectangular"] = cell["step_s"] / reference["step_s"]
