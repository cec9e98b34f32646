"""The gradient check's report: per dtype, each implementation's worst gradient error, the pairs, the named runs.

Renders a `results.GradCheckResult` as neutral blocks (`checks.report.Block`) and summary lines;
its JSON form is `checks.json_report.grad_to_json`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from mha_rosetta.core import DTYPE_NAMES

from .matrices import worst_by_dtype
from .report import MARKERS, Block
from .results import GradCheckResult, Status, worst_status


def _fmt(value: float) -> str:
    return "inf" if not np.isfinite(value) else ("0" if value == 0 else f"{value:.0e}")


def _runs_block(title: str, runs) -> Block:
    """One row per run: its status, implementation, case, dtype and reason."""
    rows = [[str(r.status), r.label, r.case, r.dtype, r.reason] for r in runs]
    return Block(title, ["status", "implementation", "case", "dtype", "reason"], rows)


def grad_report_blocks(result: GradCheckResult, quiet: bool = False) -> list:
    """One block per dtype: each implementation's worst gradient error against the oracle, and the pairs;
    ``quiet`` (``check --grad --quiet``): only the runs that disagree, were missed or failed, as for the forward."""
    if quiet:
        problems = [run for run in result.runs if run.status in (Status.DISAGREE, Status.MISSED, Status.ERROR)]
        if not problems:
            return []
        return [_runs_block("Problems: gradients", problems)]
    blocks = []
    pair_worst: dict[tuple[str, str, str], tuple[float, Status]] = {}
    for pair in result.pairs:
        key = (pair.dtype, pair.a.label, pair.b.label)
        old = pair_worst.get(key, (0.0, Status.AGREE))
        pair_worst[key] = (max(old[0], pair.max_abs), worst_status([old[1], pair.status]))
    for dtype, rows in sorted(worst_by_dtype(result).items(), key=lambda item: DTYPE_NAMES.index(item[0])):
        labels = list(rows)
        rule = "half rule: 2x the rounded spec path + 1 ulp" if dtype in ("float16", "bfloat16") else "GRAD_TOLERANCES"
        block = Block(
            f"{dtype} gradients: worst over all cases and gradient tensors ({rule})",
            ["#", "implementation", "oracle abs", "allowed", "tensor", "case"]
            + [str(i + 1) for i in range(len(labels))],
        )
        for i, label in enumerate(labels):
            entry = rows[label]
            row = [
                str(i + 1),
                label,
                _fmt(entry["max_abs"]) + MARKERS.get(entry["status"], ""),
                _fmt(entry["atol"]),
                entry["tensor"],
                entry["case"],
            ]
            for j, other in enumerate(labels):
                if i == j:
                    row.append("·")
                    continue
                found = pair_worst.get((dtype, label, other)) or pair_worst.get((dtype, other, label))
                row.append("" if found is None or j > i else _fmt(found[0]) + MARKERS.get(found[1], ""))
            block.rows.append(row)
        block.notes.append(
            "oracle abs: the largest max abs error of any gradient tensor, relative to its allowance; lower triangle: "
            "max abs difference between two implementations; ~ known difference, * caught (known mistake), "
            "! DISAGREE, ? MISSED"
        )
        blocks.append(block)
    named = [
        run
        for run in result.runs
        if run.status in (Status.KNOWN_DIFFERENCE, Status.DISAGREE, Status.MISSED, Status.ERROR)
    ]
    named += [run for run in result.runs if run.status is Status.CAUGHT and "happen to agree" in run.reason]
    if named:
        blocks.append(_runs_block("Gradients: named differences, problems and mistakes caught only at a stage", named))
    unsupported = sorted(
        {(r.label, r.reason) for r in result.runs if r.status is Status.UNSUPPORTED and "backward" in r.reason}
    )
    if unsupported:
        block = Block("Gradients: implementations without a backward pass", ["implementation", "reason"])
        block.rows = [[label, reason] for label, reason in unsupported]
        blocks.append(block)
    return blocks


def grad_summary_lines(result: GradCheckResult) -> list[str]:
    runs = Counter(str(run.status) for run in result.runs)
    pairs = Counter(str(pair.status) for pair in result.pairs)
    return [
        f"gradients: {len(result.cases)} case(s), {len(result.runs)} run(s) in {result.seconds:.1f} s",
        "gradients against the oracle: " + ", ".join(f"{k} {v}" for k, v in sorted(runs.items())),
        "gradients between implementations: " + ", ".join(f"{k} {v}" for k, v in sorted(pairs.items())),
        result.verdict() + f" (exit status {result.exit_status})",
    ]
