"""The report of a set of files: loaded runs, the bench comparison, the gate, and its three renderings."""

from __future__ import annotations

from dataclasses import dataclass

from .compare import Comparison, compare, regressions
from .runs import Run, load_runs

REPORT_SCHEMA = 1


@dataclass
class Report:
    runs: list[Run]
    comparison: Comparison
    gate: dict | None

    def markdown(self) -> str:
        from .markdown import render_markdown

        return render_markdown(self.runs, self.comparison, self.gate)

    def html(self) -> str:
        from .html import render_html

        return render_html(self.runs, self.comparison, self.gate)

    def to_json(self) -> dict:
        from mha_rosetta.benchmarks.provenance import provenance

        comparison = self.comparison
        return {
            "schema": REPORT_SCHEMA,
            "tool": "mha-rosetta report",
            "provenance": provenance(),
            "runs": [
                {
                    "label": run.label,
                    "file": run.path,
                    "kind": run.kind,
                    "provenance": run.provenance,
                    "notes": run.notes,
                }
                for run in self.runs
            ],
            "columns": [column.label for column in comparison.columns],
            "bench": [
                {
                    "mode": group[0],
                    "dtype": group[1],
                    "shape": group[2],
                    "implementation": name,
                    "cells": [
                        None
                        if (figure := cells.get((group, name))) is None
                        else {
                            "seconds": figure.seconds,
                            "range": [figure.lo, figure.hi],
                            "used": figure.used,
                            "range_rule": figure.range_rule,
                            **({} if figure.limit_fraction is None else {"limit_fraction": figure.limit_fraction}),
                        }
                        for cells in comparison.cells
                    ],
                }
                for group in comparison.groups()
                for name in comparison.implementations(group)
            ],
            "gate": self.gate,
        }


def build_report(files, *, baseline=None, threshold_pct: float | None = None) -> Report:
    """Load ``files`` (and ``baseline`` files, which come first as the reference columns) and compare them.

    With ``baseline`` the gate runs (threshold 0 % when none is given: regressions are listed, the
    caller decides the exit status).
    """
    if not files:
        raise ValueError("report: expected at least one JSON file, got none")
    baseline = list(baseline or [])
    runs = load_runs([*baseline, *files])  # one labelling over all files, the baseline first
    base, rest = runs[: len(baseline)], runs[len(baseline) :]
    for run in base:
        if run.kind != "bench":
            raise ValueError(f"--baseline: expected a bench JSON, got a {run.kind} file ({run.path})")
    gate = regressions(base, rest, threshold_pct or 0.0) if base else None
    return Report(runs, compare(runs), gate)
