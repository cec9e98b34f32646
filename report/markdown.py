"""The merged report as Markdown: provenance, bench tables (ratios, spread, noise), checks, claims, the gate."""

from __future__ import annotations

from .agreement import is_decode_check, oracle_rows, status_counts
from .compare import Comparison, overlaps, ratio
from .runs import Run


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def provenance_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for run in runs:
        p = run.provenance or {}
        machine = run.data.get("machine") or {}
        git = p.get("git") or {}
        rows.append(
            [
                run.label,
                run.kind,
                run.name,
                str(p.get("created_utc") or run.data.get("created") or "?"),
                str(p.get("cpu_model") or machine.get("cpu_model") or "?"),
                str(p.get("allowed_cores") or p.get("cpu_count") or machine.get("cores") or "?"),
                (git.get("commit", "")[:12] + (" dirty" if git.get("dirty") else "")) if git else "?",
                ", ".join(run.devices()) or "-",
                "; ".join(run.notes) or "-",
            ]
        )
    return rows


PROVENANCE_HEADER = ["run", "kind", "file", "created (UTC)", "CPU", "cores", "commit", "devices", "notes"]


def limit_text(figure) -> str:
    """A decode figure's share of the K/V read limit, as the decode table prints it (``5.3% of KV limit``)."""
    return "" if figure.limit_fraction is None else f" · {100 * figure.limit_fraction:.1f}% of KV limit"


def cell_text(comparison: Comparison, index: int, group, name: str) -> str:
    figure = comparison.cells[index].get((group, name))
    if figure is None:
        return "-"
    text = f"{ms(figure.seconds)} [{ms(figure.lo)}–{ms(figure.hi)}]" + limit_text(figure)
    reference = comparison.cells[0].get((group, name)) if index else None
    if reference is not None:
        r, lo, hi = ratio(figure, reference)
        text += f" ×{r:.2f} [{lo:.2f}–{hi:.2f}]" + (" within noise" if overlaps(figure, reference) else "")
    return text


def bench_markdown(comparison: Comparison) -> str:
    if not comparison.columns:
        return ""
    out = [
        "## Benchmarks\n",
        comparison.reading_rules() + "\n",
        *([comparison.bandwidth_text() + "\n"] if comparison.bandwidth_text() else []),
    ]
    header = ["implementation", *(column.label for column in comparison.columns)]
    for group in comparison.groups():
        rows = [
            [name, *(cell_text(comparison, i, group, name) for i in range(len(comparison.columns)))]
            for name in comparison.implementations(group)
        ]
        out.append(f"### {' · '.join(group)}\n\n" + _table(header, rows))
    return "\n".join(out)


def check_markdown(runs: list[Run]) -> str:
    checks = [run for run in runs if run.kind == "check"]
    if not checks:
        return ""
    out = ["## Agreement checks\n"]
    for run in checks:
        out.append(f"**{run.label}**: {run.data.get('verdict', '?')}\n")
        counts = status_counts(run)
        statuses = sorted({s for c in counts.values() for s in c})
        out.append(
            _table(["dtype", *statuses], [[d, *(str(c.get(s, 0)) for s in statuses)] for d, c in counts.items()])
        )
        if is_decode_check(run):
            out.append(decode_oracle_markdown(run))
    return "\n".join(out)


def number_text(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def tolerance_text(row: dict) -> str:
    return "-" if row.get("atol") is None else f"atol {row['atol']:.3g}, rtol {row['rtol']:.3g}"


def cases_text(row: dict) -> str:
    """How many of an implementation's cases had each status: ``agree 2, DISAGREE 1``."""
    return ", ".join(f"{status} {count}" for status, count in row["cases"].items())


DECODE_ORACLE_HEADER = ["implementation", "status", "cases", "worst case", "max abs", "max rel", "first divergence"]


def decode_oracle_markdown(run: Run) -> str:
    """The decode check's runs against the oracle: one table per dtype, a row per implementation and cache kind."""
    out = []
    for dtype, rows in oracle_rows(run).items():
        tolerance = tolerance_text((run.data.get("tolerances") or {}).get(dtype) or {})
        body = [
            [str(row["implementation"]), row["status"], cases_text(row), str(row["case"]),
             number_text(row["max_abs"]), number_text(row["max_rel"]), str(row["where"])]
            for row in rows
        ]  # fmt: skip
        out.append(
            f"Decode, {dtype}, each implementation and cache kind against the full causal forward (its worst case; "
            f"tolerance {tolerance}):\n\n" + _table(DECODE_ORACLE_HEADER, body)
        )
    return "\n".join(out)


def claims_markdown(runs: list[Run]) -> str:
    rows = [
        [run.label, str(claim.get("claim")), str(claim.get("title")), str(claim.get("verdict"))]
        for run in runs
        for claim in run.data.get("claims", [])
        if run.kind in ("claims", "check", "bench") and isinstance(claim, dict)
    ]
    return "## Claims\n\n" + _table(["run", "claim", "title", "verdict"], rows) if rows else ""


def gate_markdown(gate: dict | None) -> str:
    if gate is None:
        return ""
    head = (
        f"## Regression gate\n\n{gate['compared']} cells compared with the baseline, threshold {gate['threshold_pct']:g} %: "
        f"{len(gate['regressions'])} slower beyond noise and beyond the threshold.\n"
    )
    rows = [
        [g["cell"], g["baseline"], ms(g["baseline_s"]), ms(g["seconds"]), f"{g['change_pct']:+.1f} %", g["used"]]
        for g in gate["regressions"]
    ]
    table = _table(["cell", "baseline", "baseline ms", "ms", "change", "figure"], rows) if rows else ""
    extra = f"\n{len(gate['unmatched'])} cells had no baseline cell (not gated).\n" if gate["unmatched"] else ""
    return head + "\n" + table + extra


def render_markdown(runs: list[Run], comparison: Comparison, gate: dict | None = None) -> str:
    parts = [
        "# mha-rosetta report\n",
        "## Runs\n\n" + _table(PROVENANCE_HEADER, provenance_rows(runs)),
        bench_markdown(comparison),
        check_markdown(runs),
        claims_markdown(runs),
        gate_markdown(gate),
    ]
    return "\n".join(part for part in parts if part)
