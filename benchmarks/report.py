"""The benchmark report: the versioned JSON document of one sweep, and the machine it ran on.

Its renderers live beside it: `markdown` (the table), `plots` (PNG), `baseline` (a saved
report compared).

JSON layout (``schema`` 2)::

    {"schema": 2,
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
                "round_status", "samples_s", "reference", "reference_samples_s", "paired_ratios",
                "ratio_median", "round_ratio_medians", "round_reference_medians_s", "corrected_median_s",
                "corrected_round_medians_s", "corrected_spread_s", "corrected_drift", "corrected_gflops",
                "corrected_peak_fraction", ...}],
     "reference": {"rule", "workloads": {key: {"library", "device", "dtype", "n", "flops",
                   "median_s", "visits"}}, "reference_s", "timed_s", "time_share"},
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

Schema 2 (paired samples, `benchmarks.rounds`): cells keep every raw sample (``samples_s``)
and the reference sample that followed each one (``reference_samples_s``, the workload in
``reference``), with their ratios. ``corrected_median_s`` is the cell's median paired ratio
x the run's median reference time for that workload (``reference.workloads[key].median_s``:
the median over every visit's median reference); ``corrected_spread_s`` is ``[min, max]``
of the same per round; ``corrected_gflops`` and ``corrected_peak_fraction`` follow from it
(the fraction against the median GEMM peak). ``drift`` now flags a cell by its corrected
round spread (``corrected_drift``) where it has one; ``round_drift`` stays the raw one. Every
other schema-1 field keeps its meaning, and schema-1 files still load (their cells have no
corrected figures, so tables and comparisons use the raw ones: `rounds.cell_time`).
``reference.time_share`` is the reference's part of all timed work (cells + references).

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
from mha_rosetta.report.provenance import provenance

from .rounds import DRIFT_THRESHOLD, FINISHED_STATUSES, round_fractions, spread

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # schema 1: no paired references, raw figures only
# Distributions whose versions explain a timing; read from metadata, nothing is imported.
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


def run_references(cells: list[dict]) -> dict[str, dict]:
    """Every reference workload of the run, by `gemm.reference_key`, with its median time: the
    median over every measured visit of that visit's median reference (each visit counts once,
    however many samples it took)."""
    from .gemm import reference_key

    workloads: dict[str, dict] = {}
    for cell in cells:
        if cell.get("status") != "ok" or not cell.get("reference"):
            continue
        workload = {name: value for name, value in cell["reference"].items() if name != "versions"}
        entry = workloads.setdefault(reference_key(workload), {**workload, "visit_medians_s": []})
        entry["visit_medians_s"] += [value for value in cell.get("round_reference_medians_s") or [] if value]
    for entry in workloads.values():
        values = entry.pop("visit_medians_s")
        entry.update(median_s=statistics.median(values) if values else None, visits=len(values))
    return workloads


# A visit whose median reference is this far from the run's median reference, while the cell's
# own visit median moved by less than half as much, did not see host drift (which slows both):
# the cell disturbed its reference. Measured on an Intel Xeon (2 cores, 1 thread, 2026-12-01):
# jax-dpa's first visit slowed its NumPy reference 2.6x (6.1 ms against 2.3 ms) while its own
# median stayed within 2%, which put a corrected round at 45 ms against a raw 117 ms.
DISTURBED_REFERENCE = 0.25


def disturbed_visits(cell: dict, reference_s: float) -> list[int]:
    """The visits (0-based) whose reference the cell itself disturbed (see `DISTURBED_REFERENCE`)."""
    references = cell.get("round_reference_medians_s") or []
    raws = cell.get("round_medians_s") or []
    raw_median = statistics.median([value for value in raws if value]) if any(raws) else None
    out = []
    for index, value in enumerate(references):
        if not value or not raw_median or index >= len(raws) or not raws[index]:
            continue
        moved = abs(value / reference_s - 1)
        if moved > DISTURBED_REFERENCE and abs(raws[index] / raw_median - 1) < moved / 2:
            out.append(index)
    return out


def correct_cell(cell: dict, workloads: dict[str, dict]) -> dict:
    """Add the drift-corrected figures: the cell's paired ratios x its workload's run median reference time."""
    from .gemm import reference_key

    if cell.get("ratio_median") is None or not cell.get("reference"):
        return cell
    reference_s = workloads.get(reference_key(cell["reference"]), {}).get("median_s")
    if not reference_s:
        return cell
    cell = dict(cell)
    disturbed = disturbed_visits(cell, reference_s)
    if disturbed:
        # The pairing assumes that whatever slows the host slows the sample and its reference alike;
        # here the reference moved on its own, so a ratio would carry the disturbance: raw figures only.
        cell["reference_disturbed"] = (
            f"visit(s) {', '.join(str(i + 1) for i in disturbed)}: the reference moved more than "
            f"{DISTURBED_REFERENCE:.0%} from the run's median while the cell's own median did not follow "
            "(the cell's runtime slowed its reference): raw figures only"
        )
        cell.pop("corrected_drift", None)  # the raw round spread flags the cell again
        raw_drift = cell.get("round_drift")
        cell["drift"] = bool(raw_drift is not None and raw_drift > DRIFT_THRESHOLD)
        kept = [w for w in cell.get("warnings") or [] if not w.startswith("drift: the round medians of the paired")]
        cell["warnings"] = [*kept, f"reference disturbed, {cell['reference_disturbed']}"]
        return cell
    cell["corrected_median_s"] = cell["ratio_median"] * reference_s
    rounds = [None if ratio is None else ratio * reference_s for ratio in cell.get("round_ratio_medians") or []]
    cell["corrected_round_medians_s"] = rounds
    cell["corrected_spread_s"] = spread(rounds) or [cell["corrected_median_s"]] * 2
    if cell.get("flops"):
        cell["corrected_gflops"] = cell["flops"] / cell["corrected_median_s"] / 1e9
        peak = cell.get("gemm_peak_gflops")
        cell["corrected_peak_fraction"] = cell["corrected_gflops"] / peak if peak else None
    return cell


def reference_summary(cells: list[dict], workloads: dict[str, dict]) -> dict:
    """The report's ``reference`` entry: the workloads, and the reference's share of the timed work."""
    reference_s = sum(cell.get("reference_total_s") or 0.0 for cell in cells)
    timed_s = sum(cell.get("timed_total_s") or 0.0 for cell in cells if cell.get("reference_total_s"))
    return {
        "rule": "corrected = the cell's median paired ratio (sample / the reference sample right after it) "
        "x the run's median reference time",
        "workloads": workloads,
        "reference_s": reference_s,
        "timed_s": timed_s,
        "time_share": reference_s / (reference_s + timed_s) if reference_s else None,
    }


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
    workloads = run_references(cells)
    enriched = [correct_cell(enrich_cell(cell, peaks, round_peaks), workloads) for cell in cells]
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
        **({"reference": reference_summary(enriched, workloads)} if workloads else {}),
    }


def failed_cells(report: dict) -> list[dict]:
    return [cell for cell in report["cells"] if cell.get("status") not in FINISHED_STATUSES]


def cell_label(cell: dict) -> str:
    """The implementation as tables and plots show it: ``numpy:slicing``, or ``numpy:slicing fwd+bwd``."""
    mode = cell.get("mode", "fwd")  # reports from before training cells hold forward cells
    label = cell["implementation"] if mode == "fwd" else f"{cell['implementation']} fwd+bwd"
    return label if cell.get("variant") is None else f"{label} [{cell['variant']}]"


def headline_peak(report: dict) -> tuple[str | None, float | None]:
    """(key, gflops) of a report's headline GEMM peak.

    Reports written before ``gemm_peak_gflops`` became a number held the per-(device, dtype)
    mapping there; the headline is then chosen from it the way `primary_peak` does.
    """
    value = report.get("gemm_peak_gflops")
    if isinstance(value, dict):
        return primary_peak(value)
    return report.get("gemm_peak_key"), value


def upgrade_decode_cells(data: dict) -> dict:
    """A schema-1 decode report's cells with ``bias`` filled in: that layer had biases on all four
    projections (schema 2 records it per cell; the preset's layer now has none). Other files as they are."""
    if data.get("kind") == "decode" and data.get("schema") == 1:
        for cell in data.get("cells", []):
            cell.setdefault("bias", True)
    return data


def layer_biases(settings: dict) -> str:
    """``"biases"`` or ``"no biases"``: a decode report's layer, in words (schema-1 settings do not say; that
    layer had biases, as `upgrade_decode_cells` reads its cells)."""
    return "biases" if settings.get("bias", True) else "no biases"


def load_report(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict) or "cells" not in data:
        raise ValueError(f"{path} is not a benchmark report (no 'cells')")
    return upgrade_decode_cells(data)
