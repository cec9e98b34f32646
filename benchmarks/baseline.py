"""A report against a saved baseline: which cells moved beyond the threshold and beyond noise.

Forward (and forward+backward) reports and decode reports (``bench --mode decode``, ``"kind": "decode"``)
are compared by the one rule that ``report --fail-on-regression`` and ``bench --compare`` read too
(`benchmarks.verdict`): a cell is matched by its identity (`comparison_key`: a decode cell's context,
window and step among it), read by its figure and range (`cell_figure`), and judged by `verdict`; a
report is compared only with a baseline of its own kind.

Paired reports (schema 2 and later) are also compared **at one host speed**, as ``bench --compare``
does (`benchmarks.rerun`): each run's corrected figures are in that run's milliseconds, put at its own
median reference product, so a host that ran a few percent faster for the whole of one run moves
every figure with it. A cell paired with the same reference workload on both sides gets ``host_ratio``
(its ratio x the baseline's median reference / the report's) and ``host_change`` (the same rule on
the scaled figure and range), and the comparison lists where that verdict differs from the one in
milliseconds (``host_differs``). The verdict and the exit status stay in milliseconds: against a
baseline from another machine, the reference's own speed is part of what changed.
"""

from __future__ import annotations

from .provenance import machine_differences, report_machine_key
from .report import READABLE_SCHEMAS, cell_label, headline_peak
from .rounds import is_corrected
from .verdict import (
    DECODE_KIND,
    RULE,
    cell_figure,
    check_same_kind,
    comparison_key,
    host_scale,
    is_decode_cell,
    overlaps,
    report_kind,
    verdict,
)

BASELINE_THRESHOLD = 0.10
# What a comparison row says of its cell, besides the figures.
FORWARD_ROW = ("implementation", "device", "dtype", "batch", "tokens", "d_model", "heads")
DECODE_ROW = ("implementation", "device", "dtype", "batch", "context", "window", "step", "d_model", "heads", "cache")


def cell_where(row: dict) -> str:
    """A compared cell's size as the tables spell it: ``B=4 N=512``, or ``B=1 context=32768 W=4096``."""
    if "context" not in row:
        return f"B={row['batch']} N={row['tokens']}"
    text = f"B={row['batch']} context={row['context']}" + (f" W={row['window']}" if row.get("window") else "")
    text += f" step={row['step']}" if row.get("step") not in (None, 1) else ""
    return text + (f" cache={row['cache']}" if row.get("cache") else "")


# A forward cell's mode and variant, where it has them: part of its name (`report.cell_label`: ``numpy fwd+bwd [softcap]``).
FORWARD_NAME = ("mode", "variant")


def _row_fields(cell: dict) -> dict:
    if is_decode_cell(cell):
        return {name: cell.get(name) for name in DECODE_ROW}
    named = {name: cell[name] for name in FORWARD_NAME if cell.get(name) is not None}
    return {**{name: cell.get(name) for name in FORWARD_ROW}, **named}


def compare_to_baseline(report: dict, baseline: dict, threshold: float = BASELINE_THRESHOLD) -> dict:
    """Time of every cell against the same cell in ``baseline``, with their intervals.

    By `benchmarks.verdict`'s rule: the time is the drift-corrected median where a cell has one
    (schema 2), else the raw median (``corrected`` says which, for the baseline and the report).
    A change counts ("slower" or "faster") only when the times differ by more than
    ``threshold`` (0.10 = 10%) *and* the two cells' intervals (the range of their round figures;
    a cell without rounds is its figure alone) do not overlap; a change beyond the threshold
    whose intervals overlap is "within noise". Cells present
    on one side only are listed, as are cells that stopped working. The two headline GEMM
    peaks are set side by side (``gemm_peak``): when the peak moved too, the machine
    changed, not (only) the implementations.
    """
    if baseline.get("schema") not in READABLE_SCHEMAS:
        raise ValueError(
            f"baseline schema is {baseline.get('schema')!r}; this version reads schemas "
            f"{', '.join(map(str, READABLE_SCHEMAS))}"
        )
    check_same_kind(report, baseline)
    old = {comparison_key(cell): cell for cell in baseline.get("cells", [])}
    new = {comparison_key(cell): cell for cell in report.get("cells", [])}
    rows, flagged, noise, broken = [], [], [], []
    for key, cell in new.items():
        before = old.get(key)
        if before is None:
            continue
        if before.get("status") == "ok" and cell.get("status") != "ok":
            broken.append({**_row_fields(cell), "status": cell.get("status")})
            continue
        if before.get("status") != "ok" or cell.get("status") != "ok":
            continue
        now, then = cell_figure(cell), cell_figure(before)
        ratio = now.seconds / then.seconds
        change = verdict(now, then, threshold)
        row = {
            **_row_fields(cell),
            "baseline_median_s": then.seconds, "median_s": now.seconds, "ratio": ratio, "change": change,
            "corrected": [is_corrected(before), is_corrected(cell)],
            "baseline_spread_s": then.interval, "spread_s": now.interval, "intervals_overlap": overlaps(now, then),
        }  # fmt: skip
        # The same rule at one host speed: the report's figure and range x (the baseline's median reference /
        # the report's), both runs in the unit of the reference product's time (`benchmarks.rerun`'s reason).
        scale = host_scale(cell, report, before, baseline)
        if scale is not None:
            row["host_scale"] = scale
            row["host_ratio"] = ratio * scale
            row["host_change"] = verdict(now.scaled(scale), then, threshold)
        rows.append(row)
        if change != "same":
            flagged.append(row)
        elif abs(ratio - 1.0) > threshold:
            noise.append(row)
    scales = sorted({row["host_scale"] for row in rows if "host_scale" in row})
    return {
        "threshold": threshold,
        "rule": RULE,
        # Another machine (`provenance.machine_differences`): every figure's change is partly the machine's.
        "machine_differences": machine_differences(report_machine_key(baseline), report_machine_key(report)),
        "gemm_peak": _peak_change(report, baseline),
        **({"bandwidth": _bandwidth_change(report, baseline)} if report_kind(report) == DECODE_KIND else {}),
        # The host's speed between the runs (the reference product's run median, report over baseline), and the
        # cells whose verdict at one host speed differs from the one in milliseconds. The verdict and the exit
        # status stay in milliseconds: across machines the reference's speed is part of what differs.
        "reference_shifts": [1.0 / scale - 1.0 for scale in reversed(scales)],
        "host_compared": sum("host_scale" in row for row in rows),
        "host_differs": [row for row in rows if row.get("host_change", row["change"]) != row["change"]],
        "compared": rows,
        "flagged": flagged,
        "within_noise": noise,
        "stopped_working": broken,
        "only_in_report": [list(key) for key in new if key not in old],
        "only_in_baseline": [list(key) for key in old if key not in new],
    }


def _peak_change(report: dict, baseline: dict) -> dict | None:
    """The headline peak of both reports when they measured the same (device, dtype), else None."""
    key, gflops = headline_peak(report)
    baseline_key, baseline_gflops = headline_peak(baseline)
    if key is None or key != baseline_key or not gflops or not baseline_gflops:
        return None
    return {"key": key, "baseline_gflops": baseline_gflops, "gflops": gflops, "ratio": gflops / baseline_gflops}


def _bandwidth_change(report: dict, baseline: dict) -> list[dict]:
    """The copy bandwidth of each device both decode reports measured (the yardstick of their limits)."""
    now, before = report.get("bandwidth_gbps_by") or {}, baseline.get("bandwidth_gbps_by") or {}
    return [
        {"device": device, "baseline_gbps": before[device], "gbps": gbps, "ratio": gbps / before[device]}
        for device, gbps in now.items()
        if gbps and before.get(device)
    ]


def _row_name(row: dict) -> str:
    """A compared cell as the list names it: the implementation in backticks, then device, dtype and size."""
    return f"`{_label(row)}` {row['device']} {row['dtype']} {cell_where(row)}"


def _label(row: dict) -> str:
    """The implementation as the tables name it: a forward cell's mode and variant with it (`report.cell_label`)."""
    return row["implementation"] if "context" in row else cell_label(row)


def _signed_percent(change: float) -> str:
    """``+3%``; a change that rounds to nothing reads ``+0%``, never ``-0%``."""
    return f"{round(change, 2) + 0.0:+.0%}"


def _interval_ms(interval: list[float]) -> str:
    return f"{interval[0] * 1e3:.3f}-{interval[1] * 1e3:.3f}"


def baseline_markdown(comparison: dict) -> str:
    """The flagged changes (and cells that stopped working) as a Markdown list."""
    threshold = comparison["threshold"]
    lines = [
        f"Against the baseline ({len(comparison['compared'])} cells compared; a change counts when the medians "
        f"differ by more than {threshold:.0%} and the round ranges do not overlap):"
    ]
    differences = comparison.get("machine_differences")
    if differences:
        lines.append(
            f"- another machine (the baseline's against this run's: {'; '.join(differences)}): every change below "
            "is partly the machine's"
        )
    peak = comparison.get("gemm_peak")
    if peak:
        lines.append(
            f"- GEMM peak {peak['key']}: {peak['baseline_gflops']:.1f} -> {peak['gflops']:.1f} GFLOP/s "
            f"({_signed_percent(peak['ratio'] - 1)}; the machine's own change, for scale)"
        )
    for bandwidth in comparison.get("bandwidth") or []:
        lines.append(
            f"- copy bandwidth {bandwidth['device']}: {bandwidth['baseline_gbps']:.1f} -> {bandwidth['gbps']:.1f} GB/s "
            f"({_signed_percent(bandwidth['ratio'] - 1)}; the machine's own change, for scale)"
        )
    shifts = comparison.get("reference_shifts") or []
    if shifts:
        lines.append(
            f"- reference product: its run median moved by {', '.join(f'{shift:+.1%}' for shift in shifts)} "
            f"(the host's own speed; {comparison['host_compared']} cells also compared at one host speed: "
            "this run's figures x the baseline's median reference / this run's)"
        )

    def at_one_speed(row: dict) -> str:
        if "host_change" not in row:
            return ""
        said = (
            "the same" if row["host_change"] == "same" else f"{row['host_change']} by {abs(row['host_ratio'] - 1):.0%}"
        )
        return f"; at one host speed {_signed_percent(row['host_ratio'] - 1)}, {said}"

    for row in comparison["flagged"]:
        lines.append(
            f"- {_row_name(row)}: "
            f"{row['change']} by {abs(row['ratio'] - 1):.0%} ({row['baseline_median_s'] * 1e3:.3f} ms -> "
            f"{row['median_s'] * 1e3:.3f} ms{at_one_speed(row)})"
        )
    for row in comparison.get("host_differs", []):
        if row["change"] == "same":
            lines.append(
                f"- {_row_name(row)}: the same in ms "
                f"({_signed_percent(row['ratio'] - 1)}) but {row['host_change']} by {abs(row['host_ratio'] - 1):.0%} "
                "at one host speed"
            )
    for row in comparison.get("within_noise", []):
        lines.append(
            f"- {_row_name(row)}: "
            f"moved by {row['ratio'] - 1:+.0%} but within noise (the round ranges overlap: "
            f"{_interval_ms(row['baseline_spread_s'])} and {_interval_ms(row['spread_s'])} ms)"
        )
    for row in comparison["stopped_working"]:
        lines.append(f"- `{_label(row)}` {cell_where(row)}: worked in the baseline, now {row['status']}")
    if not comparison["flagged"] and not comparison["stopped_working"]:
        lines.append(f"- no change beyond {threshold:.0%}")
    return "\n".join(lines) + "\n"
