"""The check JSON's agreement matrices read back for the report: one cell per pair, with its story.

A matrix cell says only the pair's worst status and error; the page's tooltip needs more,
and the check JSON has it: the worst ``pairs`` entry of the two implementations in that
dtype names the case, and each implementation's ``runs`` entry for that case its first
divergent stage against the float64 oracle (null when it agreed at every stage).

The decode check's JSON (``check --decode --json``, `is_decode_check`) has the same matrices
(implementation x cache kind, e.g. ``torch[static]``, against each other) and, per run, ``where``:
the first chunk, its position and the first divergent stage ("step 1 (position 4) diverges at
q_rotated"). `oracle_rows` and `oracle_cells` read each implementation against the oracle (the
full causal float64 forward) per dtype: its worst case, worst error and where it first parts.
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
    if run.get("where"):  # the decode check: the chunk, its position and the first divergent stage
        return str(run["where"])
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


# -- the decode check: each implementation against the oracle -----------------------------------------
# The order in which a row takes its status: the worst first (failing, then the named outcomes, then agree).
SEVERITY = ("error", "MISSED", "DISAGREE", "known difference", "caught", "unsupported", "skipped", "agree")


def is_decode_check(run: Run) -> bool:
    """A ``check --decode --json`` file (its ``tool`` says so; the matrices alone look like the forward check's)."""
    return run.kind == "check" and str(run.data.get("tool", "")).endswith("--decode")


def _rank(entry: dict) -> tuple[int, float]:
    status = str(entry.get("status"))
    severity = SEVERITY.index(status) if status in SEVERITY else 0  # an unknown status counts as failing
    rel = number(entry.get("max_rel"))
    return (-severity, math.inf if rel is not None and math.isnan(rel) else (rel if rel is not None else -1.0))


def _oracle_entry(run: dict) -> dict:
    tolerance = run.get("tolerance") or {}
    return {
        "implementation": run.get("implementation"),
        "case": run.get("case"),
        "status": str(run.get("status")),
        "max_abs": number(run.get("max_abs")),
        "max_rel": number(run.get("max_rel")),
        "where": _stage(run) if run.get("status") not in ("unsupported", "skipped") else run.get("reason") or "-",
        "atol": tolerance.get("atol"),
        "rtol": tolerance.get("rtol"),
    }


def oracle_cells(run: Run, dtype: str) -> list[dict]:
    """Every decode run of ``dtype`` against the oracle: implementation, case, status, errors, where, tolerance."""
    return [_oracle_entry(r) for r in run.data.get("runs", []) if r.get("dtype") == dtype]


def oracle_rows(run: Run) -> dict[str, list[dict]]:
    """``{dtype: [row per implementation]}``: each implementation's worst run against the oracle over the cases
    (the worst status by `SEVERITY`, then the largest relative error, NaN the largest), with ``cases``: how many
    of its cases had each status. Dtypes in the matrices' order, implementations in the runs' order."""
    out: dict[str, list[dict]] = {}
    dtypes = [str(m.get("dtype")) for m in run.data.get("matrices", [])]
    for dtype in dict.fromkeys([*dtypes, *(str(r.get("dtype")) for r in run.data.get("runs", []))]):
        worst: dict[str, dict] = {}
        counts: dict[str, dict[str, int]] = {}
        for entry in oracle_cells(run, dtype):
            name = str(entry["implementation"])
            tally = counts.setdefault(name, {})
            tally[entry["status"]] = tally.get(entry["status"], 0) + 1
            if name not in worst or _rank(entry) > _rank(worst[name]):
                worst[name] = entry
        if worst:
            out[dtype] = [{**entry, "cases": counts[name]} for name, entry in worst.items()]
    return out
