"""The agreement report: matrices, named differences, problems and a summary; text, Markdown, JSON.

The report is built once as a list of neutral `Block`s (a title, a table, notes) and then
rendered three ways: rich tables when rich is installed and colour helps, plain text
otherwise, and Markdown for documents. The JSON form (`to_json`) is separate and
versioned by `SCHEMA_VERSION`; non-finite numbers appear in it as the strings "inf",
"-inf" and "nan", because JSON has no literal for them.

The agreement matrix has one row and one column per implementation (backend, strategy
and, when not the CPU, device). To fit a terminal, each cell holds one number: the lower
triangle holds the max abs error between the two, the upper triangle the max rel error.
Two columns in front compare each row with the float64 oracle. Aggregated over cases,
a cell shows the worst value and the most severe status; a marker after the number
says which status that is.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from mha_rosetta.backends.versions import library_versions
from mha_rosetta.core import DTYPE_NAMES, TOLERANCES
from mha_rosetta.core.tables import (
    Table,
    output_width,
    rich_console,
    rich_escape,
    rich_tables,
)
from mha_rosetta.core.tables import render_markdown as markdown_lines
from mha_rosetta.core.tables import render_plain as render_tables
from mha_rosetta.report.provenance import provenance

from .agreement import SEVERITY, STATUS_MEANING, CheckResult, Pair, Run, Status, worst_status

SCHEMA_VERSION = 1
MARKERS = {
    Status.AGREE: "",
    Status.KNOWN_DIFFERENCE: "~",
    Status.CAUGHT: "*",
    Status.DISAGREE: "!",
    Status.MISSED: "?",
    Status.ERROR: "E",
}
RICH_STYLES = {
    Status.AGREE: "green",
    Status.KNOWN_DIFFERENCE: "yellow",
    Status.CAUGHT: "cyan",
    Status.DISAGREE: "bold red",
    Status.MISSED: "bold red",
    Status.ERROR: "bold magenta",
    Status.UNSUPPORTED: "dim",
    Status.SKIPPED: "dim",
}
LEGEND = "markers: ~ known difference, * caught (known mistake), ! DISAGREE, ? MISSED (mistake not caught), E error"
MAX_LISTED = 25  # longer lists are cut in the text report (the JSON has everything)


# -- aggregation ------------------------------------------------------------------------
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


# -- neutral blocks (`core.tables.Table`), rendered three ways ---------------------------
Block = Table  # a report block is a table; blocks without columns are headings
NUMBER_COLUMNS = ("#", "oracle abs", "oracle rel")  # kept on one line by rich, like the matrix's numbered columns


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return json_number(value)  # "nan", "inf" or "-inf", as in the JSON
    return "0" if value == 0 else f"{value:.0e}"


def _cell_text(status: Status | None, value: float | None) -> str:
    if status is None:
        return ""
    return fmt(value) + MARKERS.get(status, "")


def matrix_block(matrix: Matrix) -> Block:
    where = f"case {matrix.case}" if matrix.case else "worst over all cases"
    tol = TOLERANCES[matrix.dtype]
    numbers = [str(i + 1) for i in range(len(matrix.labels))]
    block = Block(
        f"{matrix.dtype}: agreement matrix, {where} (tolerance atol {tol.atol:g}, rtol {tol.rtol:g})",
        ["#", "implementation", "oracle abs", "oracle rel", *numbers],
        key_columns=2,  # split to fit a terminal, every part keeps the row numbers and labels
        no_wrap=(*NUMBER_COLUMNS, *numbers),
    )
    for i, row_label in enumerate(matrix.labels):
        own = matrix.oracle[row_label]
        row = [str(i + 1), row_label, _cell_text(own.status, own.max_abs), _cell_text(own.status, own.max_rel)]
        styles: list[str | None] = [None, None, RICH_STYLES.get(own.status), RICH_STYLES.get(own.status)]
        for j, column_label in enumerate(matrix.labels):
            if i == j:
                row.append("·")
                styles.append("dim")
                continue
            cell = matrix.cells.get((row_label, column_label))
            value = None if cell is None else (cell.max_abs if i > j else cell.max_rel)
            status = None if cell is None else cell.status
            row.append(_cell_text(status, value))
            styles.append(RICH_STYLES.get(status))
        block.rows.append(row)
        block.styles.append(styles)
    block.notes.append(
        "lower triangle: max abs error between the two; upper triangle: max rel error (over elements larger than atol; "
        "two arrays agree where |a - b| <= atol + rtol * |b|); " + LEGEND
    )
    return block


def _grouped(runs: list[Run], status: Status) -> dict[tuple[str, str], list[str]]:
    """(label, reason) -> ["case/dtype", ...] for runs with ``status``."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for run in runs:
        if run.status is status:
            groups[(run.label, run.reason)].append(f"{run.case}/{run.dtype}")
    return groups


def _where(items: list[str]) -> str:
    shown = ", ".join(items[:8])
    return shown + (f" and {len(items) - 8} more" if len(items) > 8 else "")


def explanation_blocks(result: CheckResult) -> list[Block]:
    """Skipped, unsupported, known differences, caught mistakes, problems, worst cases."""
    blocks = []
    error_style = RICH_STYLES[Status.ERROR]
    named = (  # (title, columns, {name: text}, style of the text)
        ("Problems: backends that failed to load", ["backend", "error"], result.broken_backends, error_style),
        (
            "Problems: frameworks that see no GPU (--devices gpu)",
            ["framework", "why"],
            result.frameworks_without_gpu,
            error_style,
        ),
        ("Skipped (library not installed)", ["backend", "reason and install command"], result.skipped_backends, None),
    )
    for title, columns, texts, style in named:
        if texts:
            rows = [[name, text] for name, text in texts.items()]
            blocks.append(Block(title, columns, rows, [[None, style] for _ in rows] if style else []))
    grouped = (
        ("Unsupported (the backend cannot express the case)", "reason", Status.UNSUPPORTED),
        ("Known differences (a library convention, named here, not hidden)", "difference", Status.KNOWN_DIFFERENCE),
    )
    for title, last, status in grouped:
        runs = _grouped(result.runs, status)
        if runs:
            rows = [[label, _where(where), reason] for (label, reason), where in runs.items()]
            blocks.append(Block(title, ["implementation", "where", last], rows))
    if result.declared_differences:
        block = Block("Conventions that differ from the spec, as each adapter declares them", ["backend", "difference"])
        for name, notes in result.declared_differences.items():
            block.rows += [[name if i == 0 else "", note] for i, note in enumerate(notes)]
        blocks.append(block)
    blocks += _mistake_blocks(result)
    blocks += _problem_blocks(result)
    blocks.append(_worst_block(result))
    return blocks


def _mistake_blocks(result: CheckResult) -> list[Block]:
    mistakes: dict[str, list[Run]] = defaultdict(list)
    for run in result.runs:
        if run.impl.known_mistake and run.status in (Status.CAUGHT, Status.MISSED):
            mistakes[run.label].append(run)
    if not mistakes:
        return []
    block = Block(
        "Known mistakes (must disagree with the oracle)",
        ["implementation", "caught", "first divergent stage", "max abs there"],
    )
    for label, runs in mistakes.items():
        caught = [r for r in runs if r.status is Status.CAUGHT]
        stages = Counter(r.divergence.stage for r in caught if r.divergence)
        stage_text = ", ".join(f"{stage} ({n}x)" for stage, n in stages.most_common()) or "-"
        worst = max((r.divergence.max_abs for r in caught if r.divergence), default=None)
        block.rows.append([label, f"{len(caught)}/{len(runs)}", stage_text, fmt(worst)])
        block.styles.append(
            [None, RICH_STYLES[Status.CAUGHT if len(caught) == len(runs) else Status.MISSED], None, None]
        )
    return [block]


def _problem_blocks(result: CheckResult) -> list[Block]:
    bad_runs = [r for r in result.runs if r.status in (Status.DISAGREE, Status.MISSED, Status.ERROR)]
    bad_pairs = [p for p in result.pairs if p.status in (Status.DISAGREE, Status.MISSED)]
    blocks = []
    for title, what, bad in (
        ("Problems against the oracle", "implementation", [(r, r.label) for r in bad_runs]),
        ("Problems between implementations", "pair", [(p, f"{p.a.label} vs {p.b.label}") for p in bad_pairs]),
    ):
        if not bad:
            continue
        block = Block(title, ["case", "dtype", what, "status", "first divergent stage", "details"])
        for item, label in bad[:MAX_LISTED]:
            stage = item.divergence.summary() if item.divergence else "-"
            block.rows.append([item.case, item.dtype, label, str(item.status), stage, item.reason])
            block.styles.append([None, None, None, RICH_STYLES[item.status], None, None])
        if len(bad) > MAX_LISTED:
            block.notes.append(f"... and {len(bad) - MAX_LISTED} more (see --json)")
        blocks.append(block)
    return blocks


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


def _worst_block(result: CheckResult) -> Block:
    block = Block(
        "Worst agreeing errors (how close to the tolerance the passing comparisons came)",
        ["dtype", "atol", "vs oracle: max abs", "where", "between two: max abs", "where"],
    )
    for row in worst_cases(result):
        oracle, pair = row["vs_oracle"], row["pair"]
        block.rows.append(
            [
                row["dtype"],
                f"{row['tolerance']['atol']:g}",
                fmt(oracle["max_abs"]) if oracle else "-",
                f"{oracle['implementation']} on {oracle['case']}" if oracle else "-",
                fmt(pair["max_abs"]) if pair else "-",
                f"{' vs '.join(pair['implementations'])} on {pair['case']}" if pair else "-",
            ]
        )
    return block


def format_seconds(seconds: float) -> str:
    """Elapsed time with three significant digits: 0.0412 s, 3.07 s, 73.3 s, 1234 s (never "0.0 s" for work done)."""
    return f"{seconds:.0f} s" if seconds >= 99.95 else f"{seconds:#.3g} s"


def summary_lines(result: CheckResult) -> list[str]:
    runs, pairs = result.run_counts(), result.pair_counts()
    order = [s for s in SEVERITY[::-1] if s in runs or s in pairs]

    def counts(counter: Counter) -> str:
        return ", ".join(f"{status} {counter[status]}" for status in order if counter[status]) or "none"

    implementations = len({run.label for run in result.runs})
    return [
        f"{len(result.cases)} case(s), {implementations} implementation(s), {len(result.runs)} run(s) in {format_seconds(result.seconds)}",
        f"against the oracle: {counts(runs)}",
        f"between implementations: {counts(pairs)}",
        f"{result.verdict()} (exit status {result.exit_code})",
    ]


def report_blocks(result: CheckResult, per_case: bool = False, quiet: bool = False) -> list[Block]:
    if quiet:
        return [b for b in explanation_blocks(result) if b.title.startswith(("Problems", "Skipped"))]
    return [matrix_block(m) for m in build_matrices(result, per_case)] + explanation_blocks(result)


# -- renderers --------------------------------------------------------------------------
def render_plain(blocks: list[Block], summary: list[str], width: int | None = None) -> str:
    """Plain text fitted to ``width`` (None: every line as long as it needs; the CLI passes the terminal's)."""
    return render_tables(blocks, width, summary)


def render_markdown(blocks: list[Block], summary: list[str]) -> str:
    out: list[str] = ["# mha-rosetta check", ""]
    for block in blocks:
        out += [*markdown_lines(block), ""]
    out += ["## Summary", ""] + [f"- {line}" for line in summary]
    return "\n".join(out) + "\n"


def _text_width(block: Block) -> int:
    """Characters a table needs on one line (cell widths plus rich's borders and padding)."""
    if not block.columns:
        return len(block.title)
    return sum(max(len(str(x)) for x in column) + 3 for column in zip(block.columns, *block.rows, strict=True))


def print_rich(blocks: list[Block], summary: list[str], file=None) -> None:
    """rich tables fitted to the terminal (or ``COLUMNS``); piped, as wide as the widest table."""
    file = file or sys.stdout
    width = output_width(file)
    wanted = max([100, *(_text_width(b) for b in blocks), *(len(line) for line in summary)]) + 4
    console = rich_console(file, piped_width=wanted)
    for block in blocks:
        if not block.columns:
            console.print(f"[bold]{rich_escape(block.title)}[/bold]")
        else:
            for table in rich_tables(block, width, title_style="bold"):
                console.print(table)
        console.print()
    for line in summary:
        console.print(rich_escape(line))


def rich_available() -> bool:
    from mha_rosetta.backends._probe import importable

    return importable("rich")


# -- JSON -------------------------------------------------------------------------------
def json_number(value: float | None):
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def run_identity_json(run) -> dict:
    """The keys that say which run a JSON entry is, shared by the forward and the gradient check (`checks.grad`)."""
    return {
        "case": run.case,
        "implementation": run.label,
        "backend": run.impl.backend,
        "strategy": run.impl.strategy,
        "device": run.impl.device,
        "dtype": run.dtype,
        "kind": run.kind,
    }


def _run_json(run: Run) -> dict:
    return {
        **run_identity_json(run),
        "known_mistake": run.impl.known_mistake,
        "status": str(run.status),
        "reason": run.reason,
        "max_abs": json_number(run.max_abs),
        "max_rel": json_number(run.max_rel),
        "tolerance": None if run.tolerance is None else {"atol": run.tolerance.atol, "rtol": run.tolerance.rtol},
        "first_divergence": None if run.divergence is None else _divergence_json(run.divergence),
        "info": run.info,
        "seconds": run.seconds,
    }


def _divergence_json(divergence) -> dict:
    data = divergence.as_dict()
    data["max_abs"], data["max_rel"] = json_number(data["max_abs"]), json_number(data["max_rel"])
    return data


def _pair_json(pair: Pair) -> dict:
    data = {
        "case": pair.case,
        "dtype": pair.dtype,
        "a": pair.a.label,
        "b": pair.b.label,
        "status": str(pair.status),
        "max_abs": json_number(pair.max_abs),
        "max_rel": json_number(pair.max_rel),
    }
    if pair.reason:
        data["reason"] = pair.reason
    if pair.divergence:
        data["first_divergence"] = _divergence_json(pair.divergence)
    return data


def _cell_json(cell: Cell | None, attribute: str):
    if cell is None:
        return None
    return str(cell.status) if attribute == "status" else json_number(getattr(cell, attribute))


def _matrix_json(matrix: Matrix) -> dict:
    labels = matrix.labels

    def grid(attribute: str) -> list[list]:
        # Row a, column b: the comparison of a with b (symmetric; None on the diagonal).
        return [[_cell_json(matrix.cells.get((a, b)) if a != b else None, attribute) for b in labels] for a in labels]

    return {
        "dtype": matrix.dtype,
        "case": matrix.case,
        "labels": labels,
        "oracle": [
            {
                "implementation": label,
                "status": _cell_json(matrix.oracle[label], "status"),
                "max_abs": _cell_json(matrix.oracle[label], "max_abs"),
                "max_rel": _cell_json(matrix.oracle[label], "max_rel"),
            }
            for label in labels
        ],
        "max_abs": grid("max_abs"),
        "max_rel": grid("max_rel"),
        "status": grid("status"),
    }


def to_json(result: CheckResult) -> dict:
    """The whole result as plain JSON data (schema `SCHEMA_VERSION`)."""
    return {
        "schema": SCHEMA_VERSION,
        "tool": "mha-rosetta check",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exit_status": result.exit_code,
        "verdict": result.verdict(),
        "interrupted": result.interrupted,
        "seconds": result.seconds,
        "settings": result.settings,
        "versions": library_versions(),
        "provenance": provenance(),  # mha_rosetta.report.provenance: commit, host, CPU, command line
        "tolerances": {name: {"atol": t.atol, "rtol": t.rtol} for name, t in TOLERANCES.items()},
        "statuses": {str(status): meaning for status, meaning in STATUS_MEANING.items()},
        "summary": {
            "runs": {str(s): n for s, n in result.run_counts().items()},
            "pairs": {str(s): n for s, n in result.pair_counts().items()},
            "worst": [
                {**row, "vs_oracle": _nums(row["vs_oracle"]), "pair": _nums(row["pair"])} for row in worst_cases(result)
            ],
        },
        "skipped_backends": [{"backend": name, "reason": reason} for name, reason in result.skipped_backends.items()],
        "broken_backends": [{"backend": name, "error": error} for name, error in result.broken_backends.items()],
        "frameworks_without_gpu": [
            {"framework": name, "error": error} for name, error in result.frameworks_without_gpu.items()
        ],
        "declared_differences": {name: list(notes) for name, notes in result.declared_differences.items()},
        "cases": [case.as_dict() for case in result.cases],
        "runs": [_run_json(run) for run in result.runs],
        "pairs": [_pair_json(pair) for pair in result.pairs],
        "matrices": [_matrix_json(m) for m in build_matrices(result)],
    }


def _nums(entry: dict | None) -> dict | None:
    if entry is None:
        return None
    return {k: json_number(v) if k in ("max_abs", "max_rel") else v for k, v in entry.items()}


def write_json(result: CheckResult, path: str, grad=None) -> None:
    """Write the JSON report to ``path`` atomically, or to stdout for "-"; ``grad``: a gradient check too."""
    from mha_rosetta.core.files import write_output

    data = to_json(result)
    if grad is not None:
        from .grad import grad_to_json

        data["grad"] = grad_to_json(grad)
    write_output(path, json.dumps(data, indent=1, default=str) + "\n")
