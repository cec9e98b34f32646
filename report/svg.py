"""The report's inline SVG: series colours and markers, the agreement heatmap, the benchmark plots.

Design rules (the page that holds these is ``report/html.py``):
- Every figure is drawn here as inline SVG, no plotting library: the page works from a file.
- Plots stay readable with 20+ series: each series has its own colour *and* marker (10
  colours × 6 markers, so no two of the first 30 series look the same) and a legend.
- The data behind a tooltip is in the element's ``data-*`` attributes, so the browser test
  reads what a reader sees.
"""

from __future__ import annotations

import html
import math

from .agreement import matrix_cells, oracle_cells
from .compare import DECODE, Comparison
from .runs import Run

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MARKERS = ("circle", "square", "triangle", "diamond", "cross", "triangle-down")
STATUS_COLOURS = {
    "agree": "#2ca02c",
    "caught": "#9467bd",
    "known difference": "#ff7f0e",
    "unsupported": "#c7c7c7",
    "skipped": "#e0e0e0",
}
FAILING_COLOUR = "#d62728"  # DISAGREE, MISSED, error


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def series_style(index: int) -> tuple[str, str]:
    return COLOURS[index % len(COLOURS)], MARKERS[index % len(MARKERS)]


def marker_svg(kind: str, x: float, y: float, colour: str, size: float = 4.5, extra: str = "") -> str:
    s = size
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{s:.1f}" fill="{colour}"{extra}/>'
    if kind == "square":
        return (
            f'<rect x="{x - s:.1f}" y="{y - s:.1f}" width="{2 * s:.1f}" height="{2 * s:.1f}" fill="{colour}"{extra}/>'
        )
    if kind == "cross":
        d = f"M{x - s:.1f},{y - s:.1f}L{x + s:.1f},{y + s:.1f}M{x - s:.1f},{y + s:.1f}L{x + s:.1f},{y - s:.1f}"
        return f'<path d="{d}" stroke="{colour}" stroke-width="2.2" fill="none"{extra}/>'
    points = {
        "triangle": [(x, y - s * 1.2), (x + s, y + s * 0.8), (x - s, y + s * 0.8)],
        "triangle-down": [(x, y + s * 1.2), (x + s, y - s * 0.8), (x - s, y - s * 0.8)],
        "diamond": [(x, y - s * 1.3), (x + s, y), (x, y + s * 1.3), (x - s, y)],
    }[kind]
    text = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    return f'<polygon points="{text}" fill="{colour}"{extra}/>'


# -- heatmaps ----------------------------------------------------------------------------------


def _cell_colour(cell: dict) -> tuple[str, float]:
    """Colour by status; within 'agree', darker the closer the error comes to the tolerance (log scale)."""
    status = cell["status"]
    if status == "agree":
        rel, rtol = cell.get("max_rel"), cell.get("rtol")
        if rel is None or not rtol or rel <= 0:
            return STATUS_COLOURS["agree"], 0.35
        share = min(1.0, max(0.0, 1 + math.log10(max(rel / rtol, 1e-6)) / 6))  # 1e-6 × tol → 0, tol → 1
        return STATUS_COLOURS["agree"], 0.25 + 0.75 * share
    return STATUS_COLOURS.get(status, FAILING_COLOUR), 0.9


def _axis_labels(rows: list[str], cols: list[str], left: int, top: int, size: int) -> list[str]:
    """A grid's labels as SVG text: each row's right-aligned left of the grid, each column's rotated above it
    (row i, then column i)."""
    parts = []
    for i in range(max(len(rows), len(cols))):
        if i < len(rows):
            y = top + i * size + size * 0.7
            parts.append(f'<text x="{left - 4}" y="{y:.1f}" text-anchor="end" class="axis">{esc(rows[i])}</text>')
        if i < len(cols):
            x = left + i * size + size * 0.7
            parts.append(
                f'<text x="{x:.1f}" y="{top - 4}" transform="rotate(-60 {x:.1f} {top - 4})" class="axis">'
                f"{esc(cols[i])}</text>"
            )
    return parts


def _hover_cell(x: int, y: int, size: int, cell: dict, data: dict) -> str:
    """One grid cell at (x, y), coloured by its status (`_cell_colour`), with ``data`` for the hover text."""
    colour, opacity = _cell_colour(cell)
    attrs = " ".join(f'data-{key}="{esc(value)}"' for key, value in data.items())
    return (
        f'<rect class="hm-cell" x="{x}" y="{y}" width="{size - 1}" height="{size - 1}" fill="{colour}" '
        f'fill-opacity="{opacity:.2f}" {attrs}/>'
    )


def heatmap_svg(run: Run, matrix: dict, ident: str) -> str:
    labels = matrix.get("labels", [])
    n, size, left, top = len(labels), 16, 170, 170
    width, height = left + n * size + 70, top + n * size + 10  # room for the last rotated labels
    parts = [
        f'<svg class="heatmap" id="{ident}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="agreement matrix {esc(matrix.get("dtype"))}">'
    ]
    parts += _axis_labels(labels, labels, left, top, size)
    for i in range(n):
        parts.append(
            f'<rect x="{left + i * size}" y="{top + i * size}" width="{size - 1}" height="{size - 1}" fill="#f4f4f4"/>'
        )
    for cell in matrix_cells(run, matrix):
        data = {
            "pair": f"{cell['a']} × {cell['b']}",
            "status": cell["status"],
            "case": cell["case"] or "-",
            "max-abs": _num(cell["max_abs"]),
            "max-rel": _num(cell["max_rel"]),
            "stage": f"{cell['a']}: {cell['stage_a']}; {cell['b']}: {cell['stage_b']}",
            "tolerance": f"atol {_num(cell['atol'])}, rtol {_num(cell['rtol'])} ({matrix.get('dtype')})",
        }
        parts.append(_hover_cell(left + cell["col"] * size, top + cell["row"] * size, size, cell, data))
    parts.append("</svg>")
    return "".join(parts)


def oracle_grid_svg(run: Run, dtype: str, ident: str) -> str:
    """The decode check's runs against the oracle as a grid: a row per implementation and cache kind, a column per
    case; hover or click a cell for its status, errors, where it first parts from the oracle and the tolerance."""
    cells = oracle_cells(run, dtype)
    rows = list(dict.fromkeys(str(cell["implementation"]) for cell in cells))
    named = [str(case.get("name")) for case in run.data.get("cases", []) if isinstance(case, dict)]
    cols = [name for name in dict.fromkeys([*named, *(str(cell["case"]) for cell in cells)]) if name in
            {str(cell["case"]) for cell in cells}]  # fmt: skip
    size, left, top = 16, 170, 130
    width, height = left + len(cols) * size + 90, top + len(rows) * size + 10
    parts = [
        f'<svg class="heatmap oracle-grid" id="{ident}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="decode against the oracle {esc(dtype)}">'
    ]
    parts += _axis_labels(rows, cols, left, top, size)
    for cell in cells:
        data = {
            "pair": f"{cell['implementation']} vs the full causal forward",
            "status": cell["status"],
            "case": cell["case"],
            "max-abs": _num(cell["max_abs"]),
            "max-rel": _num(cell["max_rel"]),
            "stage": cell["where"],
            "tolerance": f"atol {_num(cell['atol'])}, rtol {_num(cell['rtol'])} ({dtype})",
        }
        i, j = rows.index(str(cell["implementation"])), cols.index(str(cell["case"]))
        parts.append(_hover_cell(left + j * size, top + i * size, size, cell, data))
    parts.append("</svg>")
    return "".join(parts)


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def dot_plot(comparison: Comparison, group, names: list[str], ident: str, relative: bool) -> str:
    """One row per implementation, one marker per column (with its range as a whisker); x: ms or × fastest."""
    cols = comparison.columns
    row_h, left, right, top = 18, 150, 30, 24
    plot_w = 520
    height = top + row_h * len(names) + 44
    values = []
    for i in range(len(cols)):
        fastest = comparison.fastest(i, group) or 1.0
        for name in names:
            figure = comparison.cells[i].get((group, name))
            if figure is not None:
                scale = 1 / fastest if relative else 1e3
                values.append((i, name, figure.seconds * scale, figure.lo * scale, figure.hi * scale))
    if not values:
        return ""
    lo = min(v[3] for v in values) if not relative else 1.0
    hi = max(v[4] for v in values)
    lo = min(lo, hi)
    span = (hi - lo) or 1.0
    lo_axis, hi_axis = (lo - 0.03 * span, hi + 0.05 * span) if not relative else (0.98, hi + 0.05 * span)

    def x_of(v: float) -> float:
        return left + (v - lo_axis) / (hi_axis - lo_axis) * plot_w

    width = left + plot_w + right
    parts = [
        f'<svg class="plot {"relative" if relative else "absolute"}" id="{ident}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
    ]
    for k in range(6):  # grid and ticks
        v = lo_axis + (hi_axis - lo_axis) * k / 5
        x = x_of(v)
        parts.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 36}" class="grid"/>')
        tick = f"×{v:.2f}" if relative else f"{v:.3g}"
        parts.append(f'<text x="{x:.1f}" y="{height - 22}" text-anchor="middle" class="axis">{tick}</text>')
    axis = "relative to the fastest of its column (×)" if relative else "milliseconds per call"
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle" class="axis">{axis}</text>')
    rows = {name: top + row_h * k + row_h / 2 for k, name in enumerate(names)}
    for name, y in rows.items():
        parts.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis" data-impl="{esc(name)}">{esc(name)}</text>'
        )
    offsets = len(cols)
    for i, name, v, v_lo, v_hi in values:
        colour, marker = series_style(i)
        y = rows[name] + (i - (offsets - 1) / 2) * min(4.0, 12 / max(offsets, 1))
        parts.append(f'<line x1="{x_of(v_lo):.1f}" y1="{y:.1f}" x2="{x_of(v_hi):.1f}" y2="{y:.1f}" stroke="{colour}"/>')
        tip = f' class="pt" data-tip="{esc(name)} · {esc(cols[i].label)}: {v:.3g}{"×" if relative else " ms"}"'
        parts.append(marker_svg(marker, x_of(v), y, colour, extra=tip))
    parts.append("</svg>")
    return "".join(parts)


SIZE_PREFIXES = ("N", "context=")  # a forward shape's tokens (``N512``), a decode shape's context (``context=1024``)


def _size(part: str) -> int | None:
    for prefix in SIZE_PREFIXES:
        if part.startswith(prefix) and part[len(prefix) :].isdigit():
            return int(part[len(prefix) :])
    return None


def size_axis(family: tuple) -> str:
    """What a family's x axis counts: a decode step's cached tokens, else the tokens of a forward."""
    return "context" if family[0] == DECODE else "tokens"


def scaling_series(comparison: Comparison) -> dict[tuple, dict[tuple[str, int], dict[int, float]]]:
    """``{(mode, dtype, shape without its size): {(implementation, column): {size: seconds}}}`` for families of
    2+ sizes; the size is the forward's tokens N, or the decode step's context (a window is its own family)."""
    families: dict[tuple, dict[tuple[str, int], dict[int, float]]] = {}
    for i, cells in enumerate(comparison.cells):
        for (group, name), figure in cells.items():
            parts = group[2].split()
            sizes = [(part, size) for part in parts if (size := _size(part)) is not None]
            if len(sizes) != 1:
                continue
            family = (group[0], group[1], " ".join(part for part in parts if part != sizes[0][0]))
            families.setdefault(family, {}).setdefault((name, i), {})[sizes[0][1]] = figure.seconds
    return {key: lines for key, lines in families.items() if len({n for line in lines.values() for n in line}) > 1}


def scaling_plot(
    lines: dict[tuple[str, int], dict[int, float]], ident: str, relative: bool, axis_name: str = "tokens"
) -> str:
    """Seconds (or × the fastest at that size) against tokens (``axis_name``: `size_axis`), log-log; one line per
    implementation and column."""
    sizes = sorted({n for line in lines.values() for n in line})
    fastest = {
        (n, col): min(line[n] for (_, c), line in lines.items() if c == col and n in line)
        for n in sizes
        for col in {c for _, c in lines}
        if any(c == col and n in line for (_, c), line in lines.items())
    }

    def value(name_col, n):
        seconds = lines[name_col][n]
        return seconds / fastest[(n, name_col[1])] if relative else seconds * 1e3

    values = [value(key, n) for key, line in lines.items() for n in line]
    lo, hi = math.log10(min(values)), math.log10(max(values))
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    left, top, plot_w, plot_h = 60, 14, 560, 360
    width, height = left + plot_w + 20, top + plot_h + 44
    x_lo, x_hi = math.log2(sizes[0]), math.log2(sizes[-1])

    def x_of(n):
        return left + (math.log2(n) - x_lo) / ((x_hi - x_lo) or 1) * plot_w

    def y_of(v):
        return top + (hi - math.log10(v)) / (hi - lo) * plot_h

    parts = [
        f'<svg class="plot scaling {"relative" if relative else "absolute"}" id="{ident}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img">'
    ]
    for n in sizes:
        parts.append(f'<line x1="{x_of(n):.1f}" y1="{top}" x2="{x_of(n):.1f}" y2="{top + plot_h}" class="grid"/>')
        parts.append(f'<text x="{x_of(n):.1f}" y="{top + plot_h + 16}" text-anchor="middle" class="axis">{n}</text>')
    for k in range(5):
        v = 10 ** (lo + (hi - lo) * k / 4)
        parts.append(f'<line x1="{left}" y1="{y_of(v):.1f}" x2="{left + plot_w}" y2="{y_of(v):.1f}" class="grid"/>')
        label = f"×{v:.2f}" if relative else f"{v:.3g}"
        parts.append(f'<text x="{left - 4}" y="{y_of(v) + 3:.1f}" text-anchor="end" class="axis">{label}</text>')
    axis = "× the fastest at that size (log)" if relative else "ms per call (log)"
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{height - 4}" text-anchor="middle" class="axis">{axis_name} (log2) · {axis}</text>'
    )
    for s, (key, line) in enumerate(sorted(lines.items())):
        colour, marker = series_style(s)
        points = [(x_of(n), y_of(value(key, n)), n) for n in sorted(line)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for x, y, n in points:
            where = "N" if axis_name == "tokens" else axis_name
            tip = f' class="pt" data-tip="{esc(key[0])} · {where}={n}: {value(key, n):.3g}{"×" if relative else " ms"}"'
            parts.append(marker_svg(marker, x, y, colour, 3.5, extra=tip))
    parts.append("</svg>")
    return "".join(parts)


def scaling_legend(lines, comparison: Comparison) -> str:
    items = []
    for s, (name, col) in enumerate(sorted(lines)):
        colour, marker = series_style(s)
        icon = f'<svg width="14" height="14" viewBox="0 0 14 14">{marker_svg(marker, 7, 7, colour, 4.5)}</svg>'
        column = f" ({esc(comparison.columns[col].label)})" if len(comparison.columns) > 1 else ""
        items.append(f'<span class="legend-item">{icon} {esc(name)}{column}</span>')
    return '<div class="scaling-legend">' + "".join(items) + "</div>"


def legend_html(comparison: Comparison) -> str:
    items = []
    for i, column in enumerate(comparison.columns):
        colour, marker = series_style(i)
        icon = f'<svg width="14" height="14" viewBox="0 0 14 14">{marker_svg(marker, 7, 7, colour, 4.5)}</svg>'
        items.append(f'<span class="legend-item">{icon} {esc(column.label)}</span>')
    return '<p class="legend">' + " ".join(items) + "</p>"
