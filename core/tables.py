"""One small table model and its three renderers (plain text, Markdown, rich), for every report.

The check (`checks.report`), the explainer (`explain.render`) and the benchmark
(`benchmarks.report`) build `Table` values and render them here, so a table looks the
same wherever it is printed and a change of format is made once. Plain text and rich fit
a width (the terminal's, or ``COLUMNS``): a table of numbers too wide for it is split into
several tables that repeat its first ``key_columns`` columns (an agreement matrix keeps
its row labels on every part); in other tables the long text cells wrap. Markdown and JSON keep every column.

Pure Python: rich is imported only by `rich_tables`, when it is asked for.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from dataclasses import dataclass, field, replace

GAP = "  "  # between plain-text columns
RICH_CELL_OVERHEAD = 3  # a rich column's border and padding, in characters
MIN_WRAP_WIDTH = 12  # narrowest a wrapped text column is made


@dataclass
class Table:
    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    styles: list[list[str | None]] = field(default_factory=list)  # per cell, rich style names (rich only)
    notes: list[str] = field(default_factory=list)  # lines printed under the table
    # Too wide for the width: 0 wraps the text cells; n > 0 splits the table into parts that
    # each repeat the first n columns (a matrix of numbers, whose cells must not wrap).
    key_columns: int = 0
    no_wrap: tuple[str, ...] = ()  # columns rich keeps on one line (numbers); the rest fold


def output_width(stream=None) -> int | None:
    """The width to fit: ``COLUMNS`` when set, else the terminal's; None (no limit) when piped without ``COLUMNS``."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = stream or sys.stdout
    if hasattr(stream, "isatty") and stream.isatty():
        return shutil.get_terminal_size().columns
    return None


def _widths(table: Table) -> list[int]:
    return [
        max(len(line) for cell in column for line in str(cell).splitlines() or [""])
        for column in zip(table.columns, *table.rows, strict=True)
    ]


def _part(table: Table, indices: list[int], part: int, parts: int) -> Table:
    pick = lambda row: [row[i] for i in indices]  # noqa: E731
    title = table.title if parts == 1 else f"{table.title} (part {part} of {parts})"
    return replace(
        table,
        title=title,
        columns=pick(table.columns),
        rows=[pick(row) for row in table.rows],
        styles=[pick(row) for row in table.styles],
        notes=table.notes if part == parts else [],
    )


def split_to_fit(table: Table, width: int | None, overhead: int = len(GAP)) -> list[Table]:
    """``table`` as parts no wider than ``width``, each repeating the key columns (one part when it fits).

    ``overhead`` is what each column costs beyond its text (the gap in plain text, borders in rich).
    """
    if width is None or not table.columns or not table.key_columns:
        return [table]
    widths = [w + overhead for w in _widths(table)]
    if sum(widths) <= width:
        return [table]
    keys = list(range(min(table.key_columns, len(widths))))
    room = width - sum(widths[i] for i in keys)
    groups: list[list[int]] = [[]]
    used = 0
    for i in range(len(keys), len(widths)):
        if groups[-1] and used + widths[i] > room:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += widths[i]
    if len(groups) == 1:
        return [table]  # one column too wide on its own: its cells wrap instead
    return [_part(table, keys + group, n + 1, len(groups)) for n, group in enumerate(groups)]


def _wrap_rows(table: Table, width: int) -> list[list[list[str]]]:
    """Each row as a list of cells, each cell a list of lines, the widest text columns wrapped to fit ``width``."""
    widths = _widths(table)
    budget = width - len(GAP) * (len(widths) - 1)
    limits = list(widths)
    # A header stays on one line, so its column is never made narrower than it.
    floors = [max(MIN_WRAP_WIDTH, len(str(column))) for column in table.columns]
    while sum(limits) > budget:
        reducible = [i for i, limit in enumerate(limits) if limit > floors[i]]
        if not reducible:
            break
        widest = max(reducible, key=limits.__getitem__)
        limits[widest] = max(floors[widest], limits[widest] - (sum(limits) - budget))
    wrap = lambda text, limit: textwrap.wrap(str(text), limit, break_on_hyphens=False) or [""]  # noqa: E731
    return [[wrap(cell, limit) for cell, limit in zip(row, limits, strict=True)] for row in table.rows]


def plain_lines(table: Table, width: int | None = None) -> list[str]:
    """Header, rule and rows of one table (no title, no notes), the text cells wrapped to ``width``."""
    rows = _wrap_rows(table, width) if width else [[str(c).splitlines() or [""] for c in row] for row in table.rows]
    widths = [len(c) for c in table.columns]
    for row in rows:
        widths = [max(w, *(len(line) for line in cell)) for w, cell in zip(widths, row, strict=True)]
    out = [_line(table.columns, widths), GAP.join("-" * w for w in widths)]
    for row in rows:
        height = max(len(cell) for cell in row)
        out += [_line([cell[k] if k < len(cell) else "" for cell in row], widths) for k in range(height)]
    return out


def render_plain(tables: list[Table], width: int | None = None, footer: list[str] | None = None) -> str:
    """Plain text: title, header, a rule, the rows, the notes; fitted to ``width`` (None: no limit)."""
    out: list[str] = []
    for whole in tables:
        for table in split_to_fit(whole, width):
            out += fill_lines(table.title, width)
            if table.columns:
                out += plain_lines(table, width)
            for note in table.notes:
                out += fill_lines(note, width)
            out.append("")
    for line in footer or []:
        out += fill_lines(line, width)
    return "\n".join(out) + "\n"


def _line(cells: list, widths: list[int]) -> str:
    return GAP.join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def fill_lines(text: str, width: int | None, indent: str = "") -> list[str]:  # continuation lines: indent + 2
    if width is None or len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_on_hyphens=False, subsequent_indent=indent + "  ")


def md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table (every column, cells escaped)."""
    lines = ["| " + " | ".join(md_cell(c) for c in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    return lines + ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]


def render_markdown(table: Table, heading: str = "##") -> list[str]:
    """A titled Markdown table with its notes (lines ending in two spaces break in Markdown)."""
    out = [f"{heading} {table.title}", ""]
    if table.columns:
        out += [*markdown_table(table.columns, table.rows), ""]
    out += [f"{note}  " for note in table.notes]
    return out


def rich_escape(text) -> str:
    from rich.markup import escape

    return escape(str(text))


def rich_tables(table: Table, width: int | None = None, **options) -> list:
    """``table`` as rich Tables fitted to ``width``; ``options`` go to `rich.table.Table` (show_lines, expand)."""
    from rich.table import Table as RichTable

    parts = []
    for part in split_to_fit(table, width, RICH_CELL_OVERHEAD):
        rich = RichTable(
            title=rich_escape(part.title),
            title_justify="left",
            caption="\n".join(rich_escape(note) for note in part.notes) or None,
            caption_justify="left",
            **options,
        )
        for column in part.columns:
            rich.add_column(rich_escape(column), no_wrap=column in part.no_wrap, overflow="fold")
        for i, row in enumerate(part.rows):
            styles = part.styles[i] if i < len(part.styles) else [None] * len(row)
            rich.add_row(
                *(f"[{s}]{rich_escape(c)}[/{s}]" if s else rich_escape(c) for c, s in zip(row, styles, strict=True))
            )
        parts.append(rich)
    return parts


def rich_console(file=None, piped_width: int = 160):
    """A rich Console for ``file`` at `output_width`; piped without ``COLUMNS``: ``piped_width`` wide."""
    from rich.console import Console

    file = file or sys.stdout
    return Console(file=file, highlight=False, width=output_width(file) or piped_width)
