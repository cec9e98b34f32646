"""The check JSON's agreement matrices read back for the report: one cell per pair, with its story.

A matrix cell says only the pair's worst status and error; the page's tooltip needs more,
and the check JSON has it: the worst ``pairs`` entry of the two implementations in that
dtype names the case, and each implementation's ``runs`` entry for that case its first
divergent stage against the float64 oracle (null when it agreed at every stage).
"""

from __future__ import annotations

import math

from .runs import Run


def number(value) -> float | None:
    """A JSON number, or the strings the check writes for non-finite ones ("nan", "inf")."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _worse(a: dict | None, b: dict) -> bool:
    if a is None:
        return True
    x, y = number(a.get("max_rel")), number(b.get("max_rel"))
    return (y is not None and math.isnan(y)) or (x is not None and y is not None and y > x)


def _stage(run: dict | None) -> str:
    if run is None:
        return "not run"
    divergence = run.get("first_divergence")
    if not divergence:
        return "none (every stage within tolerance)" if run.get("status") == "agree" else str(run.get("status"))
    return f"{divergence.get('stage')} ({divergence.get('step')})"


def matrix_cells(run: Run, matrix: dict) -> list[dict]:
    """Every off-diagonal cell of one matrix: row, col, a, b, status, errors, worst case, stages, tolerance."""
    dtype = matrix.get("dtype")
    worst: dict[frozenset, dict] = {}
    for pair in run.data.get("pairs", []):
        if pair.get("dtype") != dtype or (matrix.get("case") and pair.get("case") != matrix["case"]):
            continue
        key = frozenset((pair.get("a"), pair.get("b")))
        if _worse(worst.get(key), pair):
            worst[key] = pair
    runs = {(r.get("case"), r.get("implementation")): r for r in run.data.get("runs", []) if r.get("dtype") == dtype}
    tolerance = (run.data.get("tolerances") or {}).get(dtype, {})
    labels = matrix.get("labels", [])
    cells = []
    for i, a in enumerate(labels):
        for j, b in enumerate(labels):
            status = matrix["status"][i][j]
            if i == j or status is None:
                continue
            pair = worst.get(frozenset((a, b))) or {}
            case = pair.get("case") or matrix.get("case")
            cells.append(
                {
                    "row": i,
                    "col": j,
                    "a": a,
                    "b": b,
                    "status": status,
                    "max_abs": number(matrix["max_abs"][i][j]),
                    "max_rel": number(matrix["max_rel"][i][j]),
                    "case": case,
                    "stage_a": _stage(runs.get((case, a))),
                    "stage_b": _stage(runs.get((case, b))),
                    "atol": tolerance.get("atol"),
                    "rtol": tolerance.get("rtol"),
                }
            )
    return cells


def status_counts(run: Run) -> dict[str, dict[str, int]]:
    """``{dtype: {status: pairs}}`` over the check's pairs, dtypes in the matrices' order."""
    out: dict[str, dict[str, int]] = {str(m.get("dtype")): {} for m in run.data.get("matrices", [])}
    for pair in run.data.get("pairs", []):
        counts = out.setdefault(str(pair.get("dtype")), {})
        counts[str(pair.get("status"))] = counts.get(str(pair.get("status")), 0) + 1
    return out
