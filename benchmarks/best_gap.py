"""Each cell over its framework's best path in the same run (issue 43): the gap a table names "x its best".

Our convention adapters are never a framework's speed: a figure that compares frameworks compares their
best paths (`backends.best`), and every other cell is shown beside its framework's best one at the same
size, as a ratio. Plain data in, fields added; `backends.best.best_path_for` names which best path a cell
is compared with (none for a runtime that has no best path here). `paged_over_contiguous` is the same kind of
ratio within one implementation: its paged decode step over its contiguous one, and `ragged_over_rectangular` its
ragged batch's step over the rectangular batch of the same tokens (issue 47).

Under the tables, each gap with its cause named (`gap_lines`): the causes are declared by each backend class
(`Backend.gap_causes`), the limits that keep a best path from its peers by each best path's (`BestPath.peer_limits`),
and the ranges come from the run's JSON, so a rerun renders its own figures with nothing typed by hand; a gap no class
explains says so (`NOT_MEASURED`), and the pairs of best paths over issue 43's 1.3x apart are named (`peer_lines`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def mark_over_best(cells: list[dict], same: Sequence[str], time_of: Callable[[dict], float | None]) -> None:
    """Add ``best_path`` and ``over_best`` (its time over the best path's) to each measured cell whose
    framework's best path was measured in ``cells`` with the same values of the fields ``same`` (the size,
    the device, the dtype); ``time_of(cell)`` is the time the table shows. Cells without one are left alone."""
    from mha_rosetta.backends.best import best_path_for

    def key(cell: dict) -> tuple:  # the mode too: a forward+backward cell is never read against a forward one
        return (mode_name(cell), *(_hashable(cell.get(name)) for name in same))

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


# -- the causes, under the tables (issue 43: "every gap shown with its cause named") ---------------------------------
NOISE_BELOW = 1.10  # a gap under it gets no line: two runs of one cell moved by up to 11% (README)
CAUSE_EXPECTED_FROM = 1.15  # over it, a gap without a declared cause is flagged as such
PEER_TARGET = 1.3  # issue 43's target: the best paths within 1.3x of each other, unless a measured limit explains it
NOT_MEASURED = "cause not measured yet"
# A cell's ``mode`` (forward cells from before training cells have none) as `Backend.gap_causes` keys it.
MODE_NAMES = {"fwd": "forward", "fwdbwd": "forward+backward", "decode": "decode"}
# What makes two decode cells the same workload, for "x its best" (`decode_sweep.best_of_framework`): the cache kind
# too (a paged cell against its best path's paged cell) and the batch and its rows (the ragged row's cells).
DECODE_SIZE = ("device", "dtype", "batch", "lengths", "context", "window", "step", "cache")


def mode_name(cell: dict) -> str:
    """``"forward"``, ``"forward+backward"`` or ``"decode"``: the cell's mode as the causes are keyed."""
    return MODE_NAMES.get(cell.get("mode") or "fwd", str(cell.get("mode")))


def declared(causes: dict[str, str], mode: str, strategy: str | None, library: str | None, batch) -> str | None:
    """The most specific of ``causes`` (`Backend.gap_causes`, `BestPath.peer_limits`) for ``mode`` and ``strategy``
    (None or "standard": the mode alone) on ``library`` at ``batch`` (None where the cells hold several): the key with
    `` on <library>`` and `` at B=<batch>``, with one of them, then the mode alone; None where none is declared."""
    base = mode if strategy in (None, "standard") else f"{mode}:{strategy}"
    on = [f" on {library}"] if library else []
    at = [f" at B={batch}"] if batch is not None else []
    for suffix in [a + b for a in [*on, ""] for b in [*at, ""]]:
        if base + suffix in causes:
            return causes[base + suffix]
    return None


def _class_attribute(implementation: str, attribute: str) -> dict[str, str]:
    """``implementation``'s backend class's ``attribute`` (its registry entry's class, loaded without its framework:
    adapters import theirs lazily), or {} for a name the registry does not know or a class that does not load."""
    from mha_rosetta.backends.registry import REGISTRY, load_class

    entry = REGISTRY.get(implementation.split(":")[0])
    if entry is None:
        return {}
    try:
        return dict(getattr(load_class(entry), attribute, {}) or {})
    except (ImportError, TypeError):
        return {}


def _range(values: list[float]) -> str:
    """``"3.70-4.51x"``, or ``"1.87x"`` where the figures agree to two decimals (the table's "x its best" digits)."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _one_batch(cells: list[dict]):
    batches = {cell.get("batch") for cell in cells}
    return batches.pop() if len(batches) == 1 else None


def _strategy(implementation: str) -> str | None:
    return implementation.split(":", 1)[1] if ":" in implementation else None


def gap_lines(cells: list[dict], row_of: Callable[[dict], str]) -> list[str]:
    """One line per implementation (and row, ``row_of(cell)``: "" for the main row) whose cells have ``over_best``
    (`mark_over_best`) of `NOISE_BELOW` or more at some size: the range of its gaps over the run's sizes and the
    cause its class declares (`Backend.gap_causes`), or `NOT_MEASURED`; a row other than the main one (paged, a
    window, a variant) is not the case its class measured, so it is never given the main row's cause."""
    from mha_rosetta.backends.best import BEST_BY_LIBRARY

    library_of = {path: library for library, path in BEST_BY_LIBRARY.items()}
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        if cell.get("status") == "ok" and cell.get("over_best") is not None and cell.get("best_path"):
            if cell["implementation"] != cell["best_path"]:
                groups.setdefault((cell["implementation"], mode_name(cell), row_of(cell)), []).append(cell)
    lines = []
    for (implementation, mode, row), group in groups.items():
        gaps = [cell["over_best"] for cell in group]
        if max(gaps) < NOISE_BELOW:
            continue
        path = group[0]["best_path"]
        cause = None
        if not row:
            causes = _class_attribute(implementation, "gap_causes")
            cause = declared(causes, mode, _strategy(implementation), library_of.get(path), _one_batch(group))
        if cause is None:
            cause = NOT_MEASURED + ("" if max(gaps) > CAUSE_EXPECTED_FROM else f" (under {CAUSE_EXPECTED_FROM}x)")
        lines.append(f"- `{implementation}`{row} {mode} is {_range(gaps)} its best (`{path}`): {cause}")
    return lines


def peer_lines(cells: list[dict], same: Sequence[str], time_of: Callable[[dict], float | None], row_of) -> list[str]:
    """One line per best path (and row) that takes over `PEER_TARGET` x another best path's time at some size of the
    run (the same values of ``same``): the range of each such ratio over the sizes both timed, and the limitation its
    class declares (`BestPath.peer_limits`), or `NOT_MEASURED`."""
    from mha_rosetta.backends.best import BEST_BY_LIBRARY

    paths = list(BEST_BY_LIBRARY.values())
    timed: dict[tuple, dict[tuple, dict]] = {}  # (path, mode, row) -> size -> cell
    for cell in cells:
        if cell.get("status") == "ok" and cell["implementation"] in paths and time_of(cell):
            size = tuple(_hashable(cell.get(name)) for name in same)
            timed.setdefault((cell["implementation"], mode_name(cell), row_of(cell)), {})[size] = cell
    lines = []
    for (path, mode, row), sizes in timed.items():
        slower = []
        for peer in paths:
            theirs = timed.get((peer, mode, row), {})
            ratios = [time_of(cell) / time_of(theirs[size]) for size, cell in sizes.items() if size in theirs]
            if peer != path and ratios and max(ratios) > PEER_TARGET:
                slower.append(f"{_range(ratios)} `{peer}`'s")
        if slower:
            limit = None
            if not row:  # a row other than the main one is not the case the limits were measured in
                limits = _class_attribute(path, "peer_limits")
                limit = declared(limits, mode, None, None, _one_batch(list(sizes.values())))
            lines.append(f"- `{path}`{row} {mode} takes {', '.join(slower)} time: {limit or NOT_MEASURED}")
    return lines
