"""The merged report as one self-contained HTML page: CSS, JS and SVG inline, nothing fetched.

Design rules:
- No network: no CDN, no web font, no external script or image; the page works from a file.
- Every figure is inline SVG drawn here (no plotting library in the page): heatmaps of the
  agreement matrices, one per check run and dtype, and one plot per benchmark table.
- Plots stay readable with 20+ series: each series has its own colour *and* marker (10
  colours × 6 markers, so no two of the first 30 series look the same) and a legend; every
  benchmark plot has an absolute view and a relative-to-fastest view (buttons).
- The data behind a tooltip is in the element's ``data-*`` attributes, so the browser test
  reads what a reader sees.
"""

from __future__ import annotations

import html
import json
import math

from .agreement import matrix_cells, status_counts
from .compare import Comparison, overlaps, ratio
from .markdown import PROVENANCE_HEADER, ms, provenance_rows
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


def heatmap_svg(run: Run, matrix: dict, ident: str) -> str:
    labels = matrix.get("labels", [])
    n, size, left, top = len(labels), 16, 170, 170
    width, height = left + n * size + 70, top + n * size + 10  # room for the last rotated labels
    parts = [
        f'<svg class="heatmap" id="{ident}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="agreement matrix {esc(matrix.get("dtype"))}">'
    ]
    for i, label in enumerate(labels):
        y = top + i * size + size * 0.7
        parts.append(f'<text x="{left - 4}" y="{y:.1f}" text-anchor="end" class="axis">{esc(label)}</text>')
        x = left + i * size + size * 0.7
        parts.append(
            f'<text x="{x:.1f}" y="{top - 4}" transform="rotate(-60 {x:.1f} {top - 4})" class="axis">{esc(label)}</text>'
        )
    for i in range(n):
        parts.append(
            f'<rect x="{left + i * size}" y="{top + i * size}" width="{size - 1}" height="{size - 1}" fill="#f4f4f4"/>'
        )
    for cell in matrix_cells(run, matrix):
        colour, opacity = _cell_colour(cell)
        data = {
            "pair": f"{cell['a']} × {cell['b']}",
            "status": cell["status"],
            "case": cell["case"] or "-",
            "max-abs": _num(cell["max_abs"]),
            "max-rel": _num(cell["max_rel"]),
            "stage": f"{cell['a']}: {cell['stage_a']}; {cell['b']}: {cell['stage_b']}",
            "tolerance": f"atol {_num(cell['atol'])}, rtol {_num(cell['rtol'])} ({matrix.get('dtype')})",
        }
        attrs = " ".join(f'data-{key}="{esc(value)}"' for key, value in data.items())
        parts.append(
            f'<rect class="hm-cell" x="{left + cell["col"] * size}" y="{top + cell["row"] * size}" '
            f'width="{size - 1}" height="{size - 1}" fill="{colour}" fill-opacity="{opacity:.2f}" {attrs}/>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def check_section(runs: list[Run]) -> str:
    checks = [run for run in runs if run.kind == "check"]
    if not checks:
        return ""
    legend = " ".join(
        f'<span class="swatch" style="background:{colour}"></span>{esc(name)}'
        for name, colour in [*STATUS_COLOURS.items(), ("DISAGREE / MISSED / error", FAILING_COLOUR)]
    )
    out = [
        '<section id="agreement"><h2>Agreement matrices</h2>',
        "<p>One heatmap per check run and dtype: each cell is the worst status of a pair over the cases "
        "(green: agree, darker as the error nears the tolerance). Hover a cell for the pair, its worst case, "
        "the first divergent stage against the float64 oracle and the tolerance; click to pin it.</p>",
        f'<p class="legend">{legend}</p>',
        '<div id="pair-info" class="pinned">Click a heatmap cell to pin its details here.</div>',
    ]
    for r, run in enumerate(checks):
        out.append(f"<h3>{esc(run.label)}: {esc(run.data.get('verdict', ''))}</h3>")
        counts = status_counts(run)
        out.append('<div class="heatmaps">')
        for m, matrix in enumerate(run.data.get("matrices", [])):
            dtype = matrix.get("dtype")
            summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.get(str(dtype), {}).items()))
            title = f"{dtype}" + (f" · {matrix['case']}" if matrix.get("case") else "")
            out.append(
                f'<figure><figcaption><b>{esc(title)}</b> <span class="small">{esc(summary)}</span></figcaption>'
                f"{heatmap_svg(run, matrix, f'hm-{r}-{m}')}</figure>"
            )
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


# -- benchmarks ------------------------------------------------------------------------------------


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


def scaling_series(comparison: Comparison) -> dict[tuple, dict[tuple[str, int], dict[int, float]]]:
    """``{(mode, dtype, shape without N): {(implementation, column): {tokens: seconds}}}`` for families of 2+ sizes."""
    families: dict[tuple, dict[tuple[str, int], dict[int, float]]] = {}
    for i, cells in enumerate(comparison.cells):
        for (group, name), figure in cells.items():
            parts = group[2].split()
            tokens = [int(part[1:]) for part in parts if part.startswith("N") and part[1:].isdigit()]
            if len(tokens) != 1:
                continue
            family = (group[0], group[1], " ".join(part for part in parts if part != f"N{tokens[0]}"))
            families.setdefault(family, {}).setdefault((name, i), {})[tokens[0]] = figure.seconds
    return {key: lines for key, lines in families.items() if len({n for line in lines.values() for n in line}) > 1}


def scaling_plot(lines: dict[tuple[str, int], dict[int, float]], ident: str, relative: bool) -> str:
    """Seconds (or × the fastest at that size) against tokens, log-log; one line per implementation and column."""
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
        f'<text x="{left + plot_w / 2}" y="{height - 4}" text-anchor="middle" class="axis">tokens (log2) · {axis}</text>'
    )
    for s, (key, line) in enumerate(sorted(lines.items())):
        colour, marker = series_style(s)
        points = [(x_of(n), y_of(value(key, n)), n) for n in sorted(line)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for x, y, n in points:
            tip = f' class="pt" data-tip="{esc(key[0])} · N={n}: {value(key, n):.3g}{"×" if relative else " ms"}"'
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


def bench_section(comparison: Comparison) -> str:
    if not comparison.columns:
        return ""
    used = sorted({figure.used for cells in comparison.cells for figure in cells.values()})
    out = [
        '<section id="bench"><h2>Benchmarks</h2>',
        f"<p>Milliseconds per call with the cell's range; figure used: <b>{esc(', '.join(used))}</b> "
        "(corrected_median_s when a cell has it, else median_s). Range: min–max of the round medians, else median ± IQR/2. "
        "Ratios ×r are to the first column; <i>within noise</i>: the two ranges overlap.</p>",
        '<p><label>Filter implementations: <input id="filter" type="search" placeholder="e.g. torch"></label> '
        '<button type="button" id="view-absolute" class="view on">milliseconds</button>'
        '<button type="button" id="view-relative" class="view">relative to fastest</button></p>',
        legend_html(comparison),
    ]
    for g, group in enumerate(comparison.groups()):
        names = comparison.implementations(group)
        out.append(f'<h3>{esc(" · ".join(group))}</h3><div class="bench-group">')
        out.append('<table class="bench-table"><thead><tr><th>implementation</th>')
        out += [f"<th>{esc(column.label)}</th>" for column in comparison.columns]
        out.append("</tr></thead><tbody>")
        for name in names:
            out.append(f'<tr data-impl="{esc(name)}"><td>{esc(name)}</td>')
            for i in range(len(comparison.columns)):
                out.append(f"<td>{_bench_cell(comparison, i, group, name)}</td>")
            out.append("</tr>")
        out.append("</tbody></table><div>")
        out.append(dot_plot(comparison, group, names, f"plot-{g}-abs", relative=False))
        out.append(dot_plot(comparison, group, names, f"plot-{g}-rel", relative=True))
        out.append("</div></div>")
    for f, (family, lines) in enumerate(scaling_series(comparison).items()):
        out.append(f'<h3>Scaling: {esc(" · ".join(family))}</h3><div class="bench-group">')
        out.append(scaling_plot(lines, f"scaling-{f}-abs", relative=False))
        out.append(scaling_plot(lines, f"scaling-{f}-rel", relative=True))
        out.append(scaling_legend(lines, comparison) + "</div>")
    out.append("</section>")
    return "".join(out)


def _bench_cell(comparison: Comparison, index: int, group, name: str) -> str:
    figure = comparison.cells[index].get((group, name))
    if figure is None:
        return "-"
    text = f'{ms(figure.seconds)} <span class="small">[{ms(figure.lo)}–{ms(figure.hi)}]</span>'
    fastest = comparison.fastest(index, group)
    if fastest:
        text += f' <span class="small">×{figure.seconds / fastest:.2f} of fastest</span>'
    reference = comparison.cells[0].get((group, name)) if index else None
    if reference is not None:
        r, lo, hi = ratio(figure, reference)
        noise = ' <span class="noise">within noise</span>' if overlaps(figure, reference) else ""
        text += f'<br><span class="ratio">×{r:.2f} [{lo:.2f}–{hi:.2f}]</span>{noise}'
    return text


# -- claims, provenance, gate -------------------------------------------------------------------


def claims_section(runs: list[Run]) -> str:
    rows = [(run, claim) for run in runs for claim in run.data.get("claims", []) if isinstance(claim, dict)]
    if not rows:
        return ""
    out = ['<section id="claims"><h2>Claims</h2><table class="claims"><thead><tr>']
    out += [f"<th>{h}</th>" for h in ("run", "claim", "title", "verdict", "evidence")]
    out.append("</tr></thead><tbody>")
    for run, claim in rows:
        verdict = str(claim.get("verdict"))
        out.append(
            f"<tr><td>{esc(run.label)}</td><td>{esc(claim.get('claim'))}</td><td>{esc(claim.get('title'))}</td>"
            f'<td class="verdict {esc(verdict.split()[0] if verdict else "")}">{esc(verdict)}</td>'
            f"<td><details><summary>evidence</summary><pre>{esc(claim.get('evidence', ''))}</pre></details></td></tr>"
        )
    out.append("</tbody></table></section>")
    return "".join(out)


def provenance_section(runs: list[Run]) -> str:
    out = ['<section id="runs"><h2>Runs and their provenance</h2><table class="provenance"><thead><tr>']
    out += [f"<th>{esc(h)}</th>" for h in PROVENANCE_HEADER]
    out.append("</tr></thead><tbody>")
    for run, row in zip(runs, provenance_rows(runs), strict=True):
        out.append("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>")
        if run.provenance:
            body = esc(json.dumps(run.provenance, indent=1))
            out.append(
                f'<tr class="raw"><td colspan="{len(row)}"><details><summary>full provenance of {esc(run.label)}</summary>'
                f"<pre>{body}</pre></details></td></tr>"
            )
    out.append("</tbody></table></section>")
    return "".join(out)


def gate_section(gate: dict | None) -> str:
    if gate is None:
        return ""
    found = gate["regressions"]
    head = (
        f'<section id="gate"><h2>Regression gate</h2><p>{gate["compared"]} cells compared with the baseline, threshold '
        f"{gate['threshold_pct']:g} %: <b>{len(found)}</b> slower beyond noise and beyond the threshold.</p>"
    )
    rows = "".join(
        f"<tr><td>{esc(g['cell'])}</td><td>{ms(g['baseline_s'])}</td><td>{ms(g['seconds'])}</td>"
        f"<td>{g['change_pct']:+.1f} %</td></tr>"
        for g in found
    )
    table = f"<table><tr><th>cell</th><th>baseline ms</th><th>ms</th><th>change</th></tr>{rows}</table>" if rows else ""
    return head + table + "</section>"


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.small{color:#666;font-size:12px}.ratio{font-size:12px}.noise{color:#2a7d2a;font-size:12px}
.heatmaps{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0}.axis{font-size:10px;fill:#333}
.hm-cell{cursor:pointer}.hm-cell:hover{stroke:#000;stroke-width:1.5}.grid{stroke:#e6e6e6}
#tooltip{position:fixed;pointer-events:none;background:#fffbe6;border:1px solid #c9b458;padding:6px 8px;
font-size:12px;max-width:420px;display:none;z-index:10;box-shadow:0 2px 6px rgba(0,0,0,.2)}
.pinned{background:#f7f7fb;border:1px solid #ccd;padding:6px 10px;font-size:13px;min-height:1.5em}
.legend{font-size:12px}.legend-item{margin-right:12px;white-space:nowrap}
.swatch{display:inline-block;width:11px;height:11px;margin:0 4px 0 10px;vertical-align:middle}
.scaling-legend{font-size:12px;columns:2;max-width:520px}.scaling-legend .legend-item{display:block}
.bench-group{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}svg.relative{display:none}
body.rel svg.relative{display:inline}body.rel svg.absolute{display:none}
button.view{margin-left:6px}button.view.on{font-weight:bold}pre{white-space:pre-wrap;font-size:12px;margin:2px 0}
.verdict.confirmed{color:#2a7d2a}.verdict.refuted{color:#b22}tr.hidden{display:none}
"""

JS = """
(function(){
  var tip=document.getElementById('tooltip'), info=document.getElementById('pair-info');
  function describe(el){
    var d=el.dataset;
    return '<b>'+esc(d.pair)+'</b>: '+esc(d.status)+'<br>worst case: '+esc(d.case)+
      ' (max abs '+esc(d.maxAbs)+', max rel '+esc(d.maxRel)+')<br>first divergent stage: '+esc(d.stage)+
      '<br>tolerance: '+esc(d.tolerance);
  }
  function esc(s){return String(s).replace(/[&<>"]/g,function(c){return {'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c];});}
  function place(e){tip.style.left=(e.clientX+14)+'px';tip.style.top=(e.clientY+14)+'px';}
  document.querySelectorAll('.hm-cell').forEach(function(el){
    el.addEventListener('mouseenter',function(e){tip.innerHTML=describe(el);tip.style.display='block';place(e);});
    el.addEventListener('mousemove',place);
    el.addEventListener('mouseleave',function(){tip.style.display='none';});
    el.addEventListener('click',function(){if(info){info.innerHTML=describe(el);}});
  });
  document.querySelectorAll('.pt').forEach(function(el){
    el.addEventListener('mouseenter',function(e){tip.textContent=el.getAttribute('data-tip');tip.style.display='block';place(e);});
    el.addEventListener('mousemove',place);
    el.addEventListener('mouseleave',function(){tip.style.display='none';});
  });
  var filter=document.getElementById('filter');
  if(filter){filter.addEventListener('input',function(){
    var q=filter.value.trim().toLowerCase();
    document.querySelectorAll('tr[data-impl]').forEach(function(tr){
      tr.classList.toggle('hidden', q!=='' && tr.dataset.impl.toLowerCase().indexOf(q)<0);});
  });}
  function view(rel){document.body.classList.toggle('rel',rel);
    document.getElementById('view-relative').classList.toggle('on',rel);
    document.getElementById('view-absolute').classList.toggle('on',!rel);}
  var a=document.getElementById('view-absolute'), r=document.getElementById('view-relative');
  if(a&&r){a.addEventListener('click',function(){view(false);});r.addEventListener('click',function(){view(true);});}
})();
"""


def render_html(runs: list[Run], comparison: Comparison, gate: dict | None = None) -> str:
    body = "".join(
        [
            provenance_section(runs),
            gate_section(gate),
            check_section(runs),
            bench_section(comparison),
            claims_section(runs),
        ]
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>mha-rosetta report</title><style>{CSS}</style></head><body>"
        f'<h1>mha-rosetta report</h1><p class="small">{len(runs)} file(s): '
        f"{esc(', '.join(run.name for run in runs))}. Self-contained: no network needed.</p>"
        f'{body}<div id="tooltip" role="tooltip"></div><script>{JS}</script></body></html>\n'
    )
