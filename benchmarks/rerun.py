"""Do two runs of the same sweep agree? The repeatability figures of issue 28, from two JSON files.

``bench --compare A.json B.json`` (or `compare_runs`) reports, for two reports of the same
preset taken one after the other on one machine (cells matched and read by `benchmarks.verdict`'s rule,
as ``--baseline`` and ``report --fail-on-regression`` match and read them):

- **run agreement**: for every cell measured in both, max / min - 1 of the two figures
  (`rounds.cell_time`: drift-corrected where the cells have it, raw otherwise); the target is
  every cell within `RUN_TARGET` (5%);
- **round agreement**: for every cell-run (each cell of each report), max / min - 1 of its
  round figures (the corrected round medians where it has them, else the raw ones); the
  target is at least `ROUND_TARGET_SHARE` of the cell-runs (36 of 38) within `ROUND_TARGET`
  (10%).

For paired reports the host's own speed between the runs is read off the reference product: the
run median of its time in B over A (``reference_shift``). Within a run the correction takes the
host's drift out, but each run's corrected figures are in that run's milliseconds (its samples are
put at its own median reference), so a host that is a few percent faster for the whole of run B
moves every corrected figure of B with it (measured, Intel Xeon 2026-12-04: the reference ran
4.2% faster in the second of two back-to-back runs, 1.889 and 1.810 ms, and the cells 3.4%).
So each cell is also compared **at one host speed**: B's figure x (A's median reference / B's),
the two runs in the same unit, the reference product's time (``host_difference``,
``host_runs_agreeing``). Both are printed; the targets are judged on both, each said.

The raw figures are given beside the corrected ones, and, for paired reports, those of the
plain paired ratio (beta = 1: ``ratio_median`` and ``round_ratio_medians`` x the run's median
reference), so that what the correction buys can be read off the same output; the round
agreement is also counted per report (A, B). Nothing is measured here.
"""

from __future__ import annotations

import math

from .baseline import cell_where
from .report import cell_label
from .rounds import cell_time, is_corrected, relative_range
from .verdict import check_same_kind, comparison_key, host_scale, is_decode_cell, run_reference_s

RUN_TARGET = 0.05  # two back-to-back runs agree within this on every cell
ROUND_TARGET = 0.10  # a cell's round figures agree within this ...
ROUND_TARGET_SHARE = 36 / 38  # ... on at least this share of the cell-runs


def _round_figures(cell: dict, raw: bool) -> list[float]:
    corrected = None if raw else cell.get("corrected_round_medians_s")
    values = cell.get("round_medians_s") if corrected is None else corrected
    return [value for value in values or [] if value is not None]


def _plain_ratio(cell: dict, report: dict) -> tuple[float | None, list[float]]:
    """The plain paired ratio's figure and round figures (beta = 1), or (None, []) for a cell without pairs."""
    reference_s = run_reference_s(cell, report)
    if cell.get("ratio_median") is None or not reference_s:
        return None, []
    rounds = [value * reference_s for value in cell.get("round_ratio_medians") or [] if value is not None]
    return cell["ratio_median"] * reference_s, rounds


def _ok(report: dict) -> dict[tuple, dict]:
    return {comparison_key(cell): cell for cell in report.get("cells", []) if cell.get("status") == "ok"}


def compare_runs(first: dict, second: dict) -> dict:
    """The run and round agreement of two reports (see the module docstring), raw and corrected."""
    check_same_kind(second, first, "--compare", ("B", "A"))  # decode with decode, forward with forward
    a, b = _ok(first), _ok(second)
    shared = [key for key in a if key in b]
    cells = []
    for key in shared:
        pair = (a[key], b[key])
        plain = [_plain_ratio(cell, report) for cell, report in zip(pair, (first, second), strict=True)]
        references = [run_reference_s(cell, report) for cell, report in zip(pair, (first, second), strict=True)]
        # B at A's host speed: B's figure x (A's median reference / B's); None unless both are corrected and
        # paired with one reference product (`verdict.host_scale`, the rule `--baseline` reads too).
        scale = host_scale(pair[1], second, pair[0], first)
        host = None if scale is None else [cell_time(pair[0]), cell_time(pair[1]) * scale]
        cells.append(
            {
                "label": pair[0]["implementation"] if is_decode_cell(pair[0]) else cell_label(pair[0]),
                "tokens": pair[0].get("tokens"),  # None for a decode cell: its size is its context
                "size": cell_where(pair[0]),
                "corrected": all(is_corrected(cell) for cell in pair),
                "figures_s": [cell_time(cell) for cell in pair],
                "difference": relative_range([cell_time(cell) for cell in pair]),
                "raw_figures_s": [cell["median_s"] for cell in pair],
                "raw_difference": relative_range([cell["median_s"] for cell in pair]),
                "round_spreads": [relative_range(_round_figures(cell, raw=False)) for cell in pair],
                "raw_round_spreads": [relative_range(_round_figures(cell, raw=True)) for cell in pair],
                "ratio_difference": relative_range([figure for figure, _ in plain])
                if all(f for f, _ in plain)
                else None,
                "ratio_round_spreads": [relative_range(rounds) for _, rounds in plain],
                "reference_s": references,
                "host_figures_s": host,
                "host_difference": None if host is None else relative_range(host),
            }
        )

    def within(values: list, limit: float) -> int:
        return sum(value is not None and value <= limit for value in values)

    def spreads(name: str, run: int | None = None) -> list[float]:
        return [
            value
            for cell in cells
            for index, value in enumerate(cell[name])
            if value is not None and run in (None, index)
        ]

    runs, raw_runs = spreads("round_spreads"), spreads("raw_round_spreads")
    agreeing = within([cell["difference"] for cell in cells], RUN_TARGET)
    rounds_ok = within(runs, ROUND_TARGET)
    needed = math.ceil(ROUND_TARGET_SHARE * len(runs) - 1e-9)  # 36 of the 38; 38 of 40 with 20 cells
    paired = any(cell["ratio_difference"] is not None for cell in cells)
    hosted = [cell for cell in cells if cell["host_difference"] is not None]
    shifts = sorted({reference[1] / reference[0] - 1 for cell in hosted for reference in [cell["reference_s"]]})
    host_agreeing = within([cell["host_difference"] for cell in hosted], RUN_TARGET) if hosted else None
    return {
        "cells": cells,
        "compared": len(cells),
        "only_in_one": len(set(a) ^ set(b)),
        "run_target": RUN_TARGET,
        "runs_agreeing": agreeing,
        "raw_runs_agreeing": within([cell["raw_difference"] for cell in cells], RUN_TARGET),
        "round_target": ROUND_TARGET,
        "cell_runs": len(runs),
        "cell_runs_within": rounds_ok,
        "cell_runs_needed": needed,
        "raw_cell_runs_within": within(raw_runs, ROUND_TARGET),
        "cell_runs_within_by_run": [within(spreads("round_spreads", run), ROUND_TARGET) for run in (0, 1)],
        "raw_cell_runs_within_by_run": [within(spreads("raw_round_spreads", run), ROUND_TARGET) for run in (0, 1)],
        # The plain paired ratio (beta = 1), for paired reports: what the control-variate rule changed.
        "ratio_runs_agreeing": within([cell["ratio_difference"] for cell in cells], RUN_TARGET) if paired else None,
        "ratio_cell_runs_within": within(spreads("ratio_round_spreads"), ROUND_TARGET) if paired else None,
        "ratio_cell_runs_within_by_run": [within(spreads("ratio_round_spreads", run), ROUND_TARGET) for run in (0, 1)]
        if paired
        else None,
        "targets_met": bool(cells) and agreeing == len(cells) and rounds_ok >= needed,
        # The host's speed between the runs, and the cells at one host speed (paired, corrected reports).
        "reference_shift": shifts[0] if len(shifts) == 1 else None,
        "reference_shifts": shifts,
        "host_compared": len(hosted),
        "host_runs_agreeing": host_agreeing,
        "host_targets_met": bool(hosted) and host_agreeing == len(cells) and rounds_ok >= needed,
    }


def compare_markdown(comparison: dict) -> str:
    """The two agreement figures first, then one row per cell (the worst first)."""
    from mha_rosetta.core.tables import markdown_table

    c = comparison
    by_run = " (A {}, B {})".format
    plain_runs = (
        f"; plain paired ratio: {c['ratio_runs_agreeing']} of {c['compared']}"
        if c["ratio_runs_agreeing"] is not None
        else ""
    )
    plain_rounds = (
        f"; plain paired ratio: {c['ratio_cell_runs_within']}{by_run(*c['ratio_cell_runs_within_by_run'])}"
        if c["ratio_cell_runs_within"] is not None
        else ""
    )
    lines = [
        f"Run agreement: {c['runs_agreeing']} of {c['compared']} cells within {c['run_target']:.0%} "
        f"(raw medians: {c['raw_runs_agreeing']} of {c['compared']}{plain_runs})  ",
        f"Round agreement: {c['cell_runs_within']} of {c['cell_runs']} cell-runs with round figures within "
        f"{c['round_target']:.0%}{by_run(*c['cell_runs_within_by_run'])} (raw: {c['raw_cell_runs_within']}"
        f"{by_run(*c['raw_cell_runs_within_by_run'])}{plain_rounds})  ",
        f"Targets (every cell within {c['run_target']:.0%}; {ROUND_TARGET_SHARE:.0%} of the cell-runs, "
        f"{c['cell_runs_needed']} of {c['cell_runs']}, within {c['round_target']:.0%}): "
        f"{'met' if c['targets_met'] else 'NOT met'}" + ("  " if c.get("host_compared") else ""),
    ]
    if c.get("host_compared"):
        shifts = c["reference_shifts"]
        moved = (
            f"the reference product's run median moved by {shifts[0]:+.1%} from A to B"
            if len(shifts) == 1
            else f"the reference products' run medians moved by {', '.join(f'{s:+.1%}' for s in shifts)} from A to B"
        )
        lines += [
            f"The host: {moved} (each run's corrected figures are in its own milliseconds, so a host that ran "
            "faster or slower for a whole run moves them all)  ",
            f"At one host speed (B x A's median reference / B's): {c['host_runs_agreeing']} of {c['compared']} "
            f"cells within {c['run_target']:.0%}; targets {'met' if c['host_targets_met'] else 'NOT met'}",
        ]
    lines.append("")

    def pct(value) -> str:
        return "" if value is None else f"{100 * value:.1f}%"

    def row(cell: dict) -> list:
        spreads, raw_spreads = (
            ", ".join(pct(v) for v in cell[name]) for name in ("round_spreads", "raw_round_spreads")
        )
        figures = " / ".join(f"{value * 1e3:.3f}" for value in cell["figures_s"])
        kind = "corrected" if cell["corrected"] else "raw"
        return [f"`{cell['label']}`", cell["size"], kind, figures, pct(cell["difference"]),
                pct(cell.get("host_difference")), pct(cell["raw_difference"]), spreads, raw_spreads]  # fmt: skip

    rows = [row(cell) for cell in sorted(c["cells"], key=lambda cell: -(cell["difference"] or 0.0))]
    header = ["cell", "size", "figure", "ms (A / B)", "A vs B", "at one host speed", "raw A vs B", "round spread A, B",
              "raw round spread"]  # fmt: skip
    return "\n".join(lines + markdown_table(header, rows)) + "\n"
