"""Each cell over its framework's best path in the same run (issue 43): the gap a table names "x its best".

Our convention adapters are never a framework's speed: a figure that compares frameworks compares their
best paths (`backends.best`), and every other cell is shown beside its framework's best one at the same
size, as a ratio. Plain data in, fields added; `backends.best.best_path_for` names which best path a cell
is compared with (none for a runtime that has no best path here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def mark_over_best(cells: list[dict], same: Sequence[str], time_of: Callable[[dict], float | None]) -> None:
    """Add ``best_path`` and ``over_best`` (its time over the best path's) to each measured cell whose
    framework's best path was measured in ``cells`` with the same values of the fields ``same`` (the size,
    the device, the dtype); ``time_of(cell)`` is the time the table shows. Cells without one are left alone."""
    from mha_rosetta.backends.best import best_path_for

    def key(cell: dict) -> tuple:
        return tuple(cell.get(name) for name in same)

    best = {(cell["implementation"], *key(cell)): cell for cell in cells if cell.get("status") == "ok"}
    for cell in cells:
        path = best_path_for(cell["implementation"])
        reference = best.get((path, *key(cell)))
        if cell.get("status") != "ok" or reference is None or not time_of(reference):
            continue
        cell.update(best_path=path, over_best=time_of(cell) / time_of(reference))
