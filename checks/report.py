"""The agreement report: matrices, named differences, problems and a summary; text, Markdown, JSON.

The report is built once as a list of neutral `Block`s (a title, a table, notes) and then
rendered three ways (this module): rich tables when rich is installed and colour helps, plain text
otherwise, and Markdown for documents. The JSON form (`checks.json_report.to_json`) is separate and
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

import math
import sys
from collections import Counter, defaultdict

from mha_rosetta.core import TOLERANCES
from mha_rosetta.core.tables import (
    Table,
    output_width,
    rich_console,
    rich_escape,
    rich_tables,
)
from mha_rosetta.core.tables import render_markdown as markdown_lines
from mha_rosetta.core.tables import render_plain as render_tables

from .json_report import json_number
from .matrices import Matrix, build_matrices, worst_cases
from .results import SEVERITY, CheckResult, Run, Status

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
    return problem_blocks(
        result,
        ("Problems against the oracle", "Problems between implementations"),
        "first divergent stage",
        lambda item: item.divergence.summary() if item.divergence else "-",
        lambda item: item.reason,
    )


def problem_blocks(result, titles: tuple[str, str], where: str, where_of, details_of) -> list[Block]:
    """The runs, then the pairs, that disagree, were missed or failed: one block each, at most `MAX_LISTED` rows.

    ``titles``: the two blocks' titles; ``where``: the header of the column that says where an item parts
    (``where_of(item)``); ``details_of(item)``: the last column. Used by the forward and the decode check.
    """
    bad_runs = [r for r in result.runs if r.status in (Status.DISAGREE, Status.MISSED, Status.ERROR)]
    bad_pairs = [p for p in result.pairs if p.status in (Status.DISAGREE, Status.MISSED)]
    blocks = []
    for title, what, bad in (
        (titles[0], "implementation", [(r, r.label) for r in bad_runs]),
        (titles[1], "pair", [(p, f"{p.a.label} vs {p.b.label}") for p in bad_pairs]),
    ):
        if not bad:
            continue
        block = Block(title, ["case", "dtype", what, "status", where, "details"])
        for item, label in bad[:MAX_LISTED]:
            block.rows.append([item.case, item.dtype, label, str(item.status), where_of(item), details_of(item)])
            block.styles.append([None, None, None, RICH_STYLES[item.status], None, None])
        if len(bad) > MAX_LISTED:
            block.notes.append(f"... and {len(bad) - MAX_LISTED} more (see --json)")
        blocks.append(block)
    return blocks


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
    from mha_rosetta.backends import installed

    return installed("rich")


def timing_blocks(result: CheckResult, grad=None, title: str = "forward check") -> list[Block]:
    """``check --timings``: per backend, seconds importing its libraries, compiling and running, per check.

    ``title`` names ``result``'s check ("decode check" for ``check --decode``).
    """
    blocks = []
    for heading, timings in ((title, result.timings), ("gradient check", grad.timings if grad else {})):
        if not timings or not timings.get("backends"):
            continue
        rows = sorted(
            timings["backends"].items(), key=lambda item: -sum(item[1][k] for k in ("import", "compile", "run"))
        )
        block = Block(
            f"Timings, {heading}: {format_seconds(timings['wall'])} wall with "
            + (f"{timings['jobs']} worker process(es)" if timings["jobs"] else "every run in this process"),
            ["backend", "runs", "import", "compile", "run", "total", "programs"],
        )
        for name, entry in rows:
            total = entry["import"] + entry["compile"] + entry["run"]
            cells = [entry["import"], entry["compile"], entry["run"], total]
            loaded, stored = entry.get("loaded", 0), entry.get("stored", 0)
            programs = f"{loaded} read, {stored} new" if loaded or stored else ""
            block.rows.append([name, str(entry["runs"]), *(f"{x:.2f} s" for x in cells), programs])
        block.notes.append(
            "seconds summed over the runs (in parallel workers they overlap): import = the backend's libraries in "
            "each worker that ran it; compile = JAX's compile events (tracing, lowering, XLA); run = the rest; "
            "programs = compiled JAX programs read from the executable cache, and compiled and stored in it"
        )
        flags = timings.get("xla_flags")
        block.notes.append(
            f"XLA_FLAGS: {flags}" + (" (--no-fast-compile: XLA's defaults)" if timings.get("jobs") else "")
            if flags
            else "XLA_FLAGS: none (XLA's default compile settings)"
        )
        blocks.append(block)
    return blocks
