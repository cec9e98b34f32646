"""The merged report as one self-contained HTML page: CSS, JS and SVG inline, nothing fetched.

Design rules:
- No network: no CDN, no web font, no external script or image; the page works from a file.
- The figures (heatmaps of the agreement matrices, one per check run and dtype, and one plot
  per benchmark table) are drawn in ``report/svg.py``; this module lays out the sections.
- Every benchmark plot has an absolute view and a relative-to-fastest view (buttons).
"""

from __future__ import annotations

import json

from .agreement import is_decode_check, oracle_rows, status_counts
from .compare import Comparison, overlaps, ratio
from .markdown import (
    DECODE_ORACLE_HEADER,
    PROVENANCE_HEADER,
    cases_text,
    limit_text,
    ms,
    number_text,
    provenance_rows,
    tolerance_text,
)
from .runs import Run
from .svg import (
    FAILING_COLOUR,
    STATUS_COLOURS,
    dot_plot,
    esc,
    heatmap_svg,
    legend_html,
    oracle_grid_svg,
    scaling_legend,
    scaling_plot,
    scaling_series,
    size_axis,
)


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
        if is_decode_check(run):
            out.append(decode_oracle_html(run, r))
    out.append("</section>")
    return "".join(out)


def decode_oracle_html(run: Run, r: int) -> str:
    """The decode check against its oracle: per dtype, a grid (implementation x case) and the worst case of each."""
    out = [
        '<div class="decode-oracle"><p>Decode against the full causal forward (the oracle): a row per implementation '
        "and cache kind, a column per decode case; hover a cell for where the run first parts from the oracle "
        "(the step, its position and the first divergent stage).</p>"
    ]
    for d, (dtype, rows) in enumerate(oracle_rows(run).items()):
        tolerance = tolerance_text((run.data.get("tolerances") or {}).get(dtype) or {})
        out.append(
            f'<div class="bench-group"><figure><figcaption><b>decode · {esc(dtype)}</b> '
            f'<span class="small">vs the oracle, {esc(tolerance)}</span></figcaption>'
            f"{oracle_grid_svg(run, dtype, f'oracle-{r}-{d}')}</figure>"
        )
        out.append('<table class="decode-oracle-table"><thead><tr>')
        out += [f"<th>{esc(h)}</th>" for h in DECODE_ORACLE_HEADER]
        out.append("</tr></thead><tbody>")
        for row in rows:
            cells = [row["implementation"], row["status"], cases_text(row), row["case"]]
            cells += [number_text(row["max_abs"]), number_text(row["max_rel"]), row["where"]]
            out.append("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in cells) + "</tr>")
        out.append("</tbody></table></div>")
    out.append("</div>")
    return "".join(out)


# -- benchmarks ------------------------------------------------------------------------------------


def bench_section(comparison: Comparison) -> str:
    if not comparison.columns:
        return ""
    out = [
        '<section id="bench"><h2>Benchmarks</h2>',
        f"<p>{esc(comparison.reading_rules())}</p>",
        f"<p>{esc(comparison.bandwidth_text())}</p>" if comparison.bandwidth_text() else "",
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
        axis = size_axis(family)
        out.append(scaling_plot(lines, f"scaling-{f}-abs", relative=False, axis_name=axis))
        out.append(scaling_plot(lines, f"scaling-{f}-rel", relative=True, axis_name=axis))
        out.append(scaling_legend(lines, comparison) + "</div>")
    out.append("</section>")
    return "".join(out)


def _bench_cell(comparison: Comparison, index: int, group, name: str) -> str:
    figure = comparison.cells[index].get((group, name))
    if figure is None:
        return "-"
    text = f'{ms(figure.seconds)} <span class="small">[{ms(figure.lo)}–{ms(figure.hi)}]</span>'
    if figure.limit_fraction is not None:
        text += f' <span class="small limit">{esc(limit_text(figure).lstrip(" ·"))}</span>'
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
