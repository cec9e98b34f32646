"""The agreement matrices: runs and pairs folded into cells (worst value, most severe status) per dtype.

Aggregation only, shared by the text renderers (`checks.report`) and the JSON (`checks.json_report`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from mha_rosetta.core import DTYPE_NAMES, TOLERANCES

from .results import CheckResult, GradCheckResult, Pair, Run, Status, worst_status


@dataclass
class Cell:
    """Worst values and most severe status over the comparisons folded into one cell."""

    statuses: set = field(default_factory=set)
    max_abs: float | None = None
    max_rel: float | None = None

    def add(self, status: Status, max_abs: float | None, max_rel: float | None) -> None:
        self.statuses.add(status)
        self.max_abs = _worse(self.max_abs, max_abs)
        self.max_rel = _worse(self.max_rel, max_rel)

    @property
    def status(self) -> Status | None:
        return worst_status(self.statuses)


def _worse(current: float | None, new: float | None) -> float | None:
    if new is None:
        return current
    if current is None or math.isnan(new) or new > current:
        return new
    return current


@dataclass
class Matrix:
    """The agreement matrix of one dtype (and one case, or every case aggregated)."""

    dtype: str
    case: str | None
    labels: list[str]
    oracle: dict[str, Cell]
    cells: dict[tuple[str, str], Cell]  # both orders of every pair point at one Cell


def build_matrices(result: CheckResult, per_case: bool = False) -> list[Matrix]:
    """One matrix per dtype (aggregated over cases), or per (case, dtype) with ``per_case``."""
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in result.runs:
        if run.compared:
            groups[(run.case if per_case else None, run.dtype)].append(run)
    pair_groups: dict[tuple, list[Pair]] = defaultdict(list)
    for pair in result.pairs:
        pair_groups[(pair.case if per_case else None, pair.a.dtype)].append(pair)
    # Every case walks backends, strategies and devices in the same order, so the order in
    # which labels first appear (unsupported runs included) is the same in every matrix.
    order = {label: i for i, label in enumerate(dict.fromkeys(run.label for run in result.runs))}
    matrices = []
    for (case, dtype), runs in groups.items():
        labels = sorted({run.label for run in runs}, key=order.__getitem__)
        oracle: dict[str, Cell] = defaultdict(Cell)
        for run in runs:
            oracle[run.label].add(run.status, run.max_abs, run.max_rel)
        cells: dict[tuple[str, str], Cell] = {}
        for pair in pair_groups[(case, dtype)]:
            key = (pair.a.label, pair.b.label)
            cell = cells.get(key) or cells.setdefault(key[::-1], Cell())
            cells[key] = cell
            cell.add(pair.status, pair.max_abs, pair.max_rel)
        matrices.append(Matrix(dtype, case, labels, dict(oracle), cells))
    case_order = [case.name for case in result.cases]
    # Cases in the order they ran, dtypes from the most to the least precise.
    return sorted(matrices, key=lambda m: (case_order.index(m.case) if m.case else 0, DTYPE_NAMES.index(m.dtype)))


def worst_cases(result: CheckResult) -> list[dict]:
    """Per dtype: the largest error among agreeing comparisons with the oracle and between pairs."""
    rows = []
    for dtype in [d for d in DTYPE_NAMES if any(run.dtype == d for run in result.runs)]:
        runs = [r for r in result.runs if r.dtype == dtype and r.status is Status.AGREE]
        pairs = [p for p in result.pairs if p.a.dtype == dtype and p.status is Status.AGREE]
        worst_run = max(runs, key=lambda r: r.max_abs, default=None)
        worst_pair = max(pairs, key=lambda p: p.max_abs, default=None)
        rows.append(
            {
                "dtype": dtype,
                "tolerance": {"atol": TOLERANCES[dtype].atol, "rtol": TOLERANCES[dtype].rtol},
                "vs_oracle": None
                if worst_run is None
                else {
                    "implementation": worst_run.label,
                    "case": worst_run.case,
                    "max_abs": worst_run.max_abs,
                    "max_rel": worst_run.max_rel,
                },
                "pair": None
                if worst_pair is None
                else {
                    "implementations": [worst_pair.a.label, worst_pair.b.label],
                    "case": worst_pair.case,
                    "max_abs": worst_pair.max_abs,
                    "max_rel": worst_pair.max_rel,
                },
            }
        )
    return rows


def worst_by_dtype(result: GradCheckResult) -> dict[str, dict[str, dict]]:
    """dtype -> implementation -> worst (tensor, case, max abs, atol, status) against the oracle."""
    table: dict[str, dict[str, dict]] = {}
    for run in result.runs:
        if not run.compared:
            continue
        name, error = run.worst()
        entry = table.setdefault(run.dtype, {}).get(run.label)
        ratio = error.max_abs / max(error.atol, 1e-300)
        status = worst_status([run.status] + ([entry["status"]] if entry else []))
        if entry is None or ratio > entry["ratio"]:
            entry = {"tensor": name, "case": run.case, "max_abs": error.max_abs, "atol": error.atol, "ratio": ratio}
        entry["status"] = status
        table[run.dtype][run.label] = entry
    return table
