"""The benchmark report: versioned JSON, a Markdown table, plots, and a baseline comparison.

JSON layout (``schema`` 1)::

    {"schema": 1,
     "complete": true,                      # false when the sweep was interrupted
     "machine": {"platform", "cpu_model", "cpu_flags", "cores", "allowed_cpus", "python",
                 "libraries": {name: version}, "blas": [threadpoolctl pools]},
     "settings": {... SweepSettings ..., "malloc": "keep"},
     "gemm_peak_gflops": 151.2,             # a number: the peak of the primary (device, dtype)
     "gemm_peak_key": "cpu/float32",        # which (device, dtype) that is
     "gemm_peak_gflops_by": {"cpu/float32": 151.2, ...},   # best library per device/dtype
     "gemm_peaks": [{"device", "dtype", "threads", "n", "gflops", "library", "by_library",
                     "malloc", "round_gflops", "busy_rounds"}],
     "cells": [{"implementation", "backend", "strategy", "device", "dtype", "batch", "tokens",
                "kv_tokens", "d_model", "heads", "threads", "median_s", "iqr_s", "min_s",
                "repeats", "compile_s", "first_call_s", "flops", "gflops",
                "gemm_peak_gflops", "peak_fraction", "cpu_util", "peak_mem_mb", "status",
                "error", "warnings", "malloc", "malloc_env", "thread_env",
                "round_medians_s", "spread_s", "round_drift", "drift", "round_peak_fractions",
                "round_status", ...}],
     "summary": {"cells", "ok", "unsupported", "failed", "warnings", "drift"},
     "rounds": {"count", "seed", "orders", "gemm_peaks_gflops": {key: [per round]},
                "busy_rounds", "busy_threshold", "drift_threshold", "wall_s"}}

Every field of schema 1 keeps its meaning, with one correction: ``peak_mem_mb`` on a CPU is
counted by `memory.MemoryProbe` (held + one call's peak) in reports whose cells have
``peak_mem_method``; before, it was the growth of ``ru_maxrss``, which an earlier transient
could hide (kept as ``host_peak_growth_mb``). Rounds only added fields. With R rounds
(`benchmarks.rounds`): a cell's ``median_s``, ``iqr_s``, ``min_s`` and ``repeats`` are over
all its samples pooled, ``round_medians_s`` has one median per round and ``spread_s`` is
``[min, max]`` of them; a GEMM peak's ``gflops`` is the median of its ``round_gflops``.

The top-level ``gemm_peak_gflops`` is always a number (or null when nothing could be
measured), so that scripts can read it directly: the peak of cpu/float32 when that was
measured, else of the first (device, dtype) of the sweep that was; ``gemm_peak_key`` names
it. Every (device, dtype) is in ``gemm_peak_gflops_by``.

``peak_fraction`` is the cell's GFLOP/s over the GEMM peak of its own device and dtype
(0.5 = half of what the best square product reaches under the same thread limit); with
rounds, the median over the rounds of each round's GFLOP/s over the same round's peak.
``malloc`` is the allocator rule of the measured children (``"keep"`` or ``"default"``,
see `pinning.malloc_env`); ``malloc_env`` what a cell's child really started with.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path

from mha_rosetta.backends.versions import library_versions
from mha_rosetta.core.tables import markdown_table as table_lines
from mha_rosetta.report.provenance import provenance

from .rounds import FINISHED_STATUSES, cell_interval, intervals_overlap, round_fractions

SCHEMA_VERSION = 1
# Distributions whose versions explain a timing; read from metadata, nothing is imported.
BASELINE_THRESHOLD = 0.10
PRIMARY_PEAK_KEY = "cpu/float32"  # the top-level gemm_peak_gflops, when it was measured
REFERENCE_SIZE = {"batch": 4, "tokens": 512, "d_model": 512, "heads": 8, "dtype": "float32"}
INTERESTING_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "neon", "sve")


# -- machine ----------------------------------------------------------------------------------


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and its vector-unit flags, from /proc/cpuinfo where it exists."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Model") and value.strip():
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            present = set(value.split())
            flags = [flag for flag in INTERESTING_CPU_FLAGS if flag in present]
    return model, flags


def blas_pools(gemm_peaks: list[dict]) -> list[dict]:
    """The distinct BLAS/OpenMP pools the GEMM children saw (threadpoolctl), with the library that loaded them."""
    seen, pools = set(), []
    for peak in gemm_peaks:
        for library, result in peak.get("by_library", {}).items():
            for pool in result.get("thread_pools", []):
                key = (library, pool.get("internal_api"), pool.get("version"), pool.get("prefix"))
                if key not in seen:
                    seen.add(key)
                    pools.append({"loaded_by": library, **pool})
    return pools


def machine_info(gemm_peaks: list[dict] | None = None) -> dict:
    from .pinning import allowed_cpus

    model, flags = cpu_model_and_flags()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": model,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "allowed_cpus": allowed_cpus(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "libraries": library_versions(),
        "blas": blas_pools(gemm_peaks or []),
    }


# -- the report -------------------------------------------------------------------------------


def peak_lookup(gemm_peaks: list[dict]) -> dict[str, float | None]:
    """``{"cpu/float32": gflops}`` for every measured (device, dtype)."""
    return {f"{peak['device']}/{peak['dtype']}": peak.get("gflops") for peak in gemm_peaks}


def primary_peak(peaks: dict[str, float | None]) -> tuple[str | None, float | None]:
    """(key, gflops) of the headline peak: cpu/float32 when measured, else the first measured
    (device, dtype) in sweep order, else the first one (with None); (None, None) without any."""
    if peaks.get(PRIMARY_PEAK_KEY) is not None:
        return PRIMARY_PEAK_KEY, peaks[PRIMARY_PEAK_KEY]
    measured = [key for key, gflops in peaks.items() if gflops is not None]
    key = measured[0] if measured else next(iter(peaks), None)
    return key, peaks.get(key) if key is not None else None


def enrich_cell(cell: dict, peaks: dict[str, float | None], round_peaks: dict[str, list] | None = None) -> dict:
    """Add the GEMM peak of the cell's device/dtype and its fraction reached.

    With per-round peaks (``round_peaks[key]``, one per round) each round's GFLOP/s is set
    against the same round's peak (``round_peak_fractions``) and ``peak_fraction`` is their
    median; without, the cell's GFLOP/s over the (median) peak.
    """
    cell = dict(cell)
    key = f"{cell.get('device')}/{cell.get('dtype')}"
    peak = peaks.get(key)
    cell["gemm_peak_gflops"] = peak
    gflops = cell.get("gflops")
    cell["peak_fraction"] = gflops / peak if (gflops and peak) else None
    fractions = round_fractions(cell, (round_peaks or {}).get(key))
    if fractions is not None:
        cell["round_peak_fractions"] = fractions
        present = [fraction for fraction in fractions if fraction is not None]
        if present:
            cell["peak_fraction"] = statistics.median(present)
    return cell


def assemble_report(
    settings: dict,
    gemm_peaks: list[dict],
    cells: list[dict],
    *,
    complete: bool = True,
    machine: dict | None = None,
    rounds: dict | None = None,
) -> dict:
    """The versioned JSON document of one sweep (``rounds``: `sweep.rounds_record`, when it had rounds)."""
    peaks = peak_lookup(gemm_peaks)
    primary_key, primary_gflops = primary_peak(peaks)
    round_peaks = {f"{peak['device']}/{peak['dtype']}": peak.get("round_gflops") for peak in gemm_peaks}
    enriched = [enrich_cell(cell, peaks, round_peaks) for cell in cells]
    statuses = [cell.get("status") for cell in enriched]
    return {
        "schema": SCHEMA_VERSION,
        "complete": complete,
        "machine": machine if machine is not None else machine_info(gemm_peaks),
        "provenance": provenance(),  # mha_rosetta.report.provenance: commit, host, CPU, command line
        "settings": settings,
        "gemm_peak_gflops": primary_gflops,
        "gemm_peak_key": primary_key,
        "gemm_peak_gflops_by": peaks,
        "gemm_peaks": gemm_peaks,
        "cells": enriched,
        "summary": {
            "cells": len(enriched),
            "ok": statuses.count("ok"),
            "unsupported": statuses.count("unsupported"),
            "failed": sum(status not in FINISHED_STATUSES for status in statuses),
            "warnings": sum(bool(cell.get("warnings")) for cell in enriched),
            "drift": sum(bool(cell.get("drift")) for cell in enriched),
        },
        **({"rounds": rounds} if rounds else {}),
    }


def failed_cells(report: dict) -> list[dict]:
    return [cell for cell in report["cells"] if cell.get("status") not in FINISHED_STATUSES]


# -- Markdown ---------------------------------------------------------------------------------


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def _fmt(value, pattern: str) -> str:
    return "" if value is None else format(value, pattern)


MARKDOWN_COLUMNS = (
    "implementation", "device", "dtype", "B", "N", "D", "H", "median ms", "rounds ms", "IQR ms", "min ms", "n",
    "compile s", "GFLOP/s", "% peak", "cores", "mem MB", "status",
)  # fmt: skip


def round_range_text(cell: dict, digits: int = 3) -> str:
    """``"84.032-88.100"``: the lowest and highest round median in ms ("" with fewer than two rounds)."""
    measured = [value for value in cell.get("round_medians_s") or [] if value is not None]
    if len(measured) < 2:
        return ""
    low, high = cell_interval(cell)
    return f"{low * 1e3:.{digits}f}-{high * 1e3:.{digits}f}"


def cell_label(cell: dict) -> str:
    """The implementation as tables and plots show it: ``numpy:slicing``, or ``numpy:slicing fwd+bwd``."""
    mode = cell.get("mode", "fwd")  # reports from before training cells hold forward cells
    return cell["implementation"] if mode == "fwd" else f"{cell['implementation']} fwd+bwd"


def markdown_row(cell: dict) -> list[str]:
    ok = cell.get("status") == "ok"
    fraction = cell.get("peak_fraction")
    status = cell.get("status", "")
    if not ok:
        status += f": {cell.get('error', '')}".replace("|", "/").replace("\n", " ")[:120]
    elif cell.get("warnings"):
        status += " (drift)" if cell.get("drift") else " (!)"
    return [
        f"`{cell_label(cell)}`", cell["device"], cell["dtype"], str(cell["batch"]), str(cell["tokens"]),
        str(cell["d_model"]), str(cell["heads"]),
        _ms(cell.get("median_s")) if ok else "", round_range_text(cell) if ok else "",
        _ms(cell.get("iqr_s")) if ok else "", _ms(cell.get("min_s")) if ok else "",
        str(cell.get("repeats", "")) if ok else "", _fmt(cell.get("compile_s"), ".2f"), _fmt(cell.get("gflops"), ".1f"),
        "" if fraction is None else f"{100 * fraction:.0f}%", _fmt(cell.get("cpu_util"), ".2f"),
        _fmt(cell.get("peak_mem_mb"), ".1f"), status,
    ]  # fmt: skip


def rounds_lines(report: dict) -> list[str]:
    """The rounds, their seed, each round's GEMM peak and the rounds flagged busy ([] without rounds)."""
    rounds = report.get("rounds")
    if not rounds:
        return []
    lines = [
        f"Rounds: {rounds['count']} (seed {rounds['seed']}), each visiting every cell once in a shuffled order; "
        "a cell's median pools every round's samples, \"rounds ms\" is the range of its round medians  "
    ]
    for key, values in rounds.get("gemm_peaks_gflops", {}).items():
        shown = ", ".join("-" if value is None else f"{value:.1f}" for value in values)
        lines.append(f"GEMM peak {key} per round: {shown} GFLOP/s  ")
    for index in rounds.get("busy_rounds", []):
        lines.append(
            f"(!) round {index + 1}: its GEMM peak is more than {rounds['busy_threshold']:.0%} below the best "
            "other round's: the machine was busy  "
        )
    return lines


def markdown_table(report: dict) -> str:
    """The cells as a Markdown table, preceded by the GEMM peaks and the settings that matter."""
    lines = []
    headline = report.get("gemm_peak_key")
    for peak in report.get("gemm_peaks", []):
        gflops = peak.get("gflops")
        text = f"{gflops:.1f} GFLOP/s ({peak.get('library')}, n={peak.get('n')})" if gflops else "not measured"
        measured = [value for value in peak.get("round_gflops") or [] if value is not None]
        if gflops and len(measured) > 1:
            text += f", the median of {len(measured)} rounds"
        key = f"{peak['device']}/{peak['dtype']}"
        marker = " (the headline gemm_peak_gflops)" if key == headline and len(report["gemm_peaks"]) > 1 else ""
        lines.append(f"GEMM peak {key}, {peak['threads']} thread(s): {text}{marker}  ")
    machine = report.get("machine", {})
    if machine:
        lines.append(
            f"Machine: {machine.get('cpu_model')}, {machine.get('cores')} cores, Python {machine.get('python')}  "
        )
    lines += rounds_lines(report)
    malloc = report.get("settings", {}).get("malloc")
    if malloc:
        rule = "glibc mmap/trim thresholds raised to 4 GiB" if malloc == "keep" else "the environment as it was"
        lines.append(f"Allocator: malloc={malloc} ({rule}), the same for every cell  ")
    if lines:
        lines.append("")
    lines += table_lines(MARKDOWN_COLUMNS, [markdown_row(cell) for cell in report["cells"]])
    warned = [cell for cell in report["cells"] if cell.get("warnings")]
    if warned:
        lines.append("")
        lines.append("(!) warnings:")
        for cell in warned:
            for warning in cell["warnings"]:
                lines.append(f"- `{cell_label(cell)}` N={cell['tokens']}: {warning}")
    return "\n".join(lines) + "\n"


# -- plots ------------------------------------------------------------------------------------


def _size_group(cell: dict) -> tuple:
    return (cell["device"], cell["dtype"], cell["batch"], cell["d_model"], cell["heads"], cell["threads"])


def reference_cells(report: dict) -> list[dict]:
    """The measured cells at the reference size; failing that, at the largest size measured."""
    ok = [cell for cell in report["cells"] if cell.get("status") == "ok" and cell["device"] == "cpu"] or [
        cell for cell in report["cells"] if cell.get("status") == "ok"
    ]
    at_reference = [cell for cell in ok if all(cell.get(key) == value for key, value in REFERENCE_SIZE.items())]
    if at_reference or not ok:
        return at_reference
    largest = max(ok, key=lambda cell: (cell["batch"] * cell["tokens"] * cell["d_model"], cell["tokens"]))
    return [cell for cell in ok if _size_group(cell) == _size_group(largest) and cell["tokens"] == largest["tokens"]]


def pyplot_into(directory: str | Path):
    """matplotlib's pyplot, and ``directory`` as a Path (created where missing) for its figures."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window, works without a display
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return plt, directory


def save_figure(plt, figure, path: Path) -> Path:
    """Lay ``figure`` out, write it to ``path`` (PNG) and close it."""
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_report(report: dict, directory: str | Path) -> list[Path]:
    """time vs tokens (log-log, one line per implementation) per size group, and a bar chart
    of GFLOP/s at the reference size. Returns the files written (PNG)."""
    plt, directory = pyplot_into(directory)
    written: list[Path] = []
    ok = [cell for cell in report["cells"] if cell.get("status") == "ok"]
    groups: dict[tuple, list[dict]] = {}
    for cell in ok:
        groups.setdefault(_size_group(cell), []).append(cell)
    for group, cells in groups.items():
        device, dtype, batch, d_model, heads, threads = group
        figure, axes = plt.subplots(figsize=(10, 5.5))
        colors = plt.get_cmap("tab20").colors  # 20 distinct colours; markers and dashes tell repeats apart
        markers, dashes = "osD^v<>ph*", ("-", "--", ":")
        for index, label in enumerate(sorted({cell_label(cell) for cell in cells})):
            points = sorted(
                (cell["tokens"], cell["median_s"], *cell_interval(cell)) for cell in cells if cell_label(cell) == label
            )
            medians = [p[1] * 1e3 for p in points]
            # Error bars: the range of the round medians (zero height with one round).
            below = [max(0.0, (p[1] - p[2]) * 1e3) for p in points]
            above = [max(0.0, (p[3] - p[1]) * 1e3) for p in points]
            axes.errorbar(
                [p[0] for p in points], medians, yerr=[below, above], label=label, capsize=2,
                color=colors[(2 * index) % 20 + (index // 10) % 2], marker=markers[index % len(markers)],
                linestyle=dashes[(index // len(markers)) % len(dashes)],
            )  # fmt: skip
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("tokens N")
        axes.set_ylabel("median time per call, forward (or fwd+bwd) (ms; bars: range over rounds)")
        axes.set_title(f"{device} {dtype}, B={batch}, d_model={d_model}, heads={heads}, {threads} thread(s)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        name = f"time_vs_tokens_{device}_{dtype}_B{batch}_D{d_model}_H{heads}_T{threads}.png"
        written.append(save_figure(plt, figure, directory / name))
    at_reference = reference_cells(report)
    if at_reference:
        at_reference = sorted(at_reference, key=lambda cell: cell.get("gflops") or 0, reverse=True)
        sample = at_reference[0]
        figure, axes = plt.subplots(figsize=(8, 0.4 * len(at_reference) + 1.8))
        labels = [cell_label(cell) for cell in at_reference]
        values = [cell.get("gflops") or 0 for cell in at_reference]
        # Error bars: GFLOP/s at the slowest and fastest round median.
        slowest = [cell["flops"] / cell_interval(cell)[1] / 1e9 if cell.get("flops") else 0 for cell in at_reference]
        fastest = [cell["flops"] / cell_interval(cell)[0] / 1e9 if cell.get("flops") else 0 for cell in at_reference]
        xerr = [
            [max(0.0, value - low) for value, low in zip(values, slowest, strict=True)],
            [max(0.0, high - value) for value, high in zip(values, fastest, strict=True)],
        ]
        axes.barh(labels, values, xerr=xerr, capsize=3, color="tab:blue", ecolor="black")
        axes.invert_yaxis()
        peak = sample.get("gemm_peak_gflops")
        if peak:
            axes.axvline(peak, color="tab:red", linestyle="--", label=f"GEMM peak {peak:.0f}")
            axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        for index, cell in enumerate(at_reference):
            fraction = cell.get("peak_fraction")
            if fraction is not None:
                end = values[index] + xerr[1][index]  # after the error bar
                axes.text(end, index, f" {100 * fraction:.0f}%", va="center", fontsize="small")
        axes.set_xlabel("GFLOP/s (matmul FLOPs / median time; bars: range over rounds; %: of each round's GEMM peak)")
        at_reference_size = all(sample.get(key) == value for key, value in REFERENCE_SIZE.items())
        axes.set_title(
            f"B={sample['batch']}, N={sample['tokens']}, d_model={sample['d_model']}, heads={sample['heads']}, "
            f"{sample['dtype']}, {sample['device']}, {sample['threads']} thread(s)"
            + ("" if at_reference_size else "\n(the reference size was not measured: largest size shown)")
        )
        written.append(save_figure(plt, figure, directory / "gflops_at_reference_size.png"))
    return written


# -- baseline ---------------------------------------------------------------------------------


def _comparison_key(cell: dict) -> tuple:
    fields = ("implementation", "device", "dtype", "batch", "tokens", "kv_tokens", "d_model", "heads", "threads")
    return (*(cell.get(name) for name in fields), cell.get("mode", "fwd"))


def compare_to_baseline(report: dict, baseline: dict, threshold: float = BASELINE_THRESHOLD) -> dict:
    """Median time of every cell against the same cell in ``baseline``, with their intervals.

    A change counts ("slower" or "faster") only when the medians differ by more than
    ``threshold`` (0.10 = 10%) *and* the two cells' intervals (``spread_s``: the range of
    their round medians; a report without rounds has its median alone) do not overlap;
    a change beyond the threshold whose intervals overlap is "within noise". Cells present
    on one side only are listed, as are cells that stopped working. The two headline GEMM
    peaks are set side by side (``gemm_peak``): when the peak moved too, the machine
    changed, not (only) the implementations.
    """
    if baseline.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"baseline schema is {baseline.get('schema')!r}; this version reads schema {SCHEMA_VERSION}")
    old = {_comparison_key(cell): cell for cell in baseline.get("cells", [])}
    new = {_comparison_key(cell): cell for cell in report.get("cells", [])}
    rows, flagged, noise, broken = [], [], [], []
    for key, cell in new.items():
        before = old.get(key)
        if before is None:
            continue
        if before.get("status") == "ok" and cell.get("status") != "ok":
            broken.append(
                {"implementation": cell["implementation"], "tokens": cell["tokens"], "status": cell.get("status")}
            )
            continue
        if before.get("status") != "ok" or cell.get("status") != "ok":
            continue
        ratio = cell["median_s"] / before["median_s"]
        change = ratio - 1.0
        overlap = intervals_overlap(cell_interval(cell), cell_interval(before))
        beyond = abs(change) > threshold
        verdict = ("slower" if change > 0 else "faster") if beyond and not overlap else "same"
        row = {
            "implementation": cell["implementation"], "device": cell["device"], "dtype": cell["dtype"],
            "batch": cell["batch"], "tokens": cell["tokens"], "d_model": cell["d_model"], "heads": cell["heads"],
            "baseline_median_s": before["median_s"], "median_s": cell["median_s"], "ratio": ratio, "change": verdict,
            "baseline_spread_s": cell_interval(before), "spread_s": cell_interval(cell), "intervals_overlap": overlap,
        }  # fmt: skip
        rows.append(row)
        if verdict != "same":
            flagged.append(row)
        elif beyond:
            noise.append(row)
    return {
        "threshold": threshold,
        "rule": "a change counts when the medians differ by more than the threshold and the intervals do not overlap",
        "gemm_peak": _peak_change(report, baseline),
        "compared": rows,
        "flagged": flagged,
        "within_noise": noise,
        "stopped_working": broken,
        "only_in_report": [list(key) for key in new if key not in old],
        "only_in_baseline": [list(key) for key in old if key not in new],
    }


def headline_peak(report: dict) -> tuple[str | None, float | None]:
    """(key, gflops) of a report's headline GEMM peak.

    Reports written before ``gemm_peak_gflops`` became a number held the per-(device, dtype)
    mapping there; the headline is then chosen from it the way `primary_peak` does.
    """
    value = report.get("gemm_peak_gflops")
    if isinstance(value, dict):
        return primary_peak(value)
    return report.get("gemm_peak_key"), value


def _peak_change(report: dict, baseline: dict) -> dict | None:
    """The headline peak of both reports when they measured the same (device, dtype), else None."""
    key, gflops = headline_peak(report)
    baseline_key, baseline_gflops = headline_peak(baseline)
    if key is None or key != baseline_key or not gflops or not baseline_gflops:
        return None
    return {"key": key, "baseline_gflops": baseline_gflops, "gflops": gflops, "ratio": gflops / baseline_gflops}


def _interval_ms(interval: list[float]) -> str:
    return f"{interval[0] * 1e3:.3f}-{interval[1] * 1e3:.3f}"


def baseline_markdown(comparison: dict) -> str:
    """The flagged changes (and cells that stopped working) as a Markdown list."""
    threshold = comparison["threshold"]
    lines = [
        f"Against the baseline ({len(comparison['compared'])} cells compared; a change counts when the medians "
        f"differ by more than {threshold:.0%} and the round ranges do not overlap):"
    ]
    peak = comparison.get("gemm_peak")
    if peak:
        lines.append(
            f"- GEMM peak {peak['key']}: {peak['baseline_gflops']:.1f} -> {peak['gflops']:.1f} GFLOP/s "
            f"({peak['ratio'] - 1:+.0%}; the machine's own change, for scale)"
        )
    for row in comparison["flagged"]:
        lines.append(
            f"- `{row['implementation']}` {row['device']} {row['dtype']} B={row['batch']} N={row['tokens']}: "
            f"{row['change']} by {abs(row['ratio'] - 1):.0%} ({row['baseline_median_s'] * 1e3:.3f} ms -> {row['median_s'] * 1e3:.3f} ms)"
        )
    for row in comparison.get("within_noise", []):
        lines.append(
            f"- `{row['implementation']}` {row['device']} {row['dtype']} B={row['batch']} N={row['tokens']}: "
            f"moved by {row['ratio'] - 1:+.0%} but within noise (the round ranges overlap: "
            f"{_interval_ms(row['baseline_spread_s'])} and {_interval_ms(row['spread_s'])} ms)"
        )
    for row in comparison["stopped_working"]:
        lines.append(f"- `{row['implementation']}` N={row['tokens']}: worked in the baseline, now {row['status']}")
    if not comparison["flagged"] and not comparison["stopped_working"]:
        lines.append(f"- no change beyond {threshold:.0%}")
    return "\n".join(lines) + "\n"


def load_report(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict) or "cells" not in data:
        raise ValueError(f"{path} is not a benchmark report (no 'cells')")
    return data
