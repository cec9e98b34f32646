"""The benchmark report: the versioned JSON document of one sweep, and the machine it ran on.

Its renderers live beside it: `markdown` (the table), `plots` (PNG), `baseline` (a saved
report compared); the control-variate correction of its cells is `correction`.

JSON layout (``schema`` 3)::

    {"schema": 3,
     "recorrected_from": 2,                 # only in a schema-2 file read by `load_report` (and written again)
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
                "gemm_peak_gflops", "peak_fraction", "cpu_util", "peak_mem_mb", "page_faults_per_call", "status",
                "error", "warnings", "malloc", "malloc_env", "thread_env",
                "round_medians_s", "spread_s", "round_drift", "drift", "round_peak_fractions",
                "round_status", "samples_s", "reference", "reference_samples_s", "paired_ratios",
                "ratio_median", "round_ratio_medians", "round_reference_medians_s", "corrected_median_s",
                "corrected_round_medians_s", "corrected_spread_s", "corrected_drift", "corrected_gflops",
                "corrected_peak_fraction", "round_sample_counts", "reference_beta", "reference_correlation",
                "reference_pairs", "visit_medians_s", "visit_ratio_medians", "visit_reference_medians_s", ...}],
     "reference": {"rule", "workloads": {key: {"library", "device", "dtype", "n", "flops",
                   "median_s", "visits"}}, "reference_s", "timed_s", "time_share"},
     "summary": {"cells", "ok", "unsupported", "failed", "warnings", "drift"},
     "rounds": {"count", "visits", "seed", "orders", "gemm_peaks_gflops": {key: [per round]},
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
``reference``), with their ratios. Schema 3 (the control-variate rule, `correction.correct_cell`): each
sample is corrected by (R / its reference) ^ ``reference_beta``, R the run's median reference
time for that workload (``reference.workloads[key].median_s``: the median over every visit's
median reference) and ``reference_beta`` the cell's slope of log(sample) on log(reference),
clipped to [0, 1] (``reference_correlation`` and ``reference_pairs`` beside it);
``corrected_median_s`` and ``corrected_round_medians_s`` (split by ``round_sample_counts``) are
medians of the corrected samples, ``corrected_spread_s`` ``[min, max]`` of the rounds, and
``corrected_gflops`` and ``corrected_peak_fraction`` follow (against the median GEMM peak).
``drift`` flags a cell by its corrected round spread (``corrected_drift``) where it has one;
``round_drift`` stays the raw one. Schema 2 wrote its corrected figures by the plain ratio
(beta 1, or raw figures for a cell whose reference moved alone: ``reference_disturbed``);
`load_report` re-derives them from the kept samples by today's rule (`upgrade_report`). Every
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

from .best_gap import mark_over_best
from .correction import CORRECTED_FIELDS, correct_cell, flag_drift, reference_summary, run_references
from .provenance import cpu_model_and_flags, provenance
from .rounds import (
    FINISHED_STATUSES,
    cell_time,
    round_fractions,
)

SCHEMA_VERSION = 3
# schema 1: no paired references, raw figures only; 2: corrected by the plain ratio, re-derived at load
READABLE_SCHEMAS = (1, 2, 3)
# Distributions whose versions explain a timing; read from metadata, nothing is imported.
PRIMARY_PEAK_KEY = "cpu/float32"  # the top-level gemm_peak_gflops, when it was measured
REFERENCE_SIZE = {"batch": 4, "tokens": 512, "d_model": 512, "heads": 8, "dtype": "float32"}
# What makes two forward cells the same workload, for "x its best" (`best_gap.mark_over_best`).
FORWARD_SIZE = (
    "device", "dtype", "threads", "batch", "tokens", "kv_tokens", "d_model", "heads", "kv_heads", "d_k", "causal",
    "variant",
)  # fmt: skip


# -- machine ----------------------------------------------------------------------------------


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
    workloads = run_references(cells)
    enriched = [correct_cell(enrich_cell(cell, peaks, round_peaks), workloads) for cell in cells]
    mark_over_best(enriched, FORWARD_SIZE, cell_time)  # each cell over its framework's best path, where timed
    return {
        "schema": SCHEMA_VERSION,
        "complete": complete,
        "machine": machine if machine is not None else machine_info(gemm_peaks),
        "provenance": provenance(),  # benchmarks.provenance: commit, host, CPU, command line
        "settings": settings,
        "gemm_peak_gflops": primary_gflops,
        "gemm_peak_key": primary_key,
        "gemm_peak_gflops_by": peaks,
        "gemm_peaks": gemm_peaks,
        "cells": enriched,
        "summary": {
            **status_summary(enriched),
            "warnings": sum(bool(cell.get("warnings")) for cell in enriched),
            "drift": sum(bool(cell.get("drift")) for cell in enriched),
        },
        **({"rounds": rounds} if rounds else {}),
        **({"reference": reference_summary(enriched, workloads)} if workloads else {}),
    }


def status_summary(cells: list[dict]) -> dict:
    """How many cells a report has, and how many were measured, unsupported here, or failed (any other status)."""
    statuses = [cell.get("status") for cell in cells]
    return {
        "cells": len(cells),
        "ok": statuses.count("ok"),
        "unsupported": statuses.count("unsupported"),
        "failed": sum(status not in FINISHED_STATUSES for status in statuses),
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


# Schema 2 wrote its corrected figures by the plain paired ratio (beta = 1), with an escape to the raw ones for
# a cell that disturbed its reference; it kept every sample and its reference, so they are re-derived.
PLAIN_RATIO_SCHEMA = 2


def recorrect_report(data: dict) -> dict:
    """``data`` (a loaded forward or decode report) with every paired cell's corrected figures re-derived
    from its kept samples by today's rule (`correct_cell`), its drift flag and the ``reference`` entry
    with them; cells without kept pairs are left as they are. The result is a schema-3 report (`SCHEMA_VERSION`)
    whose ``recorrected_from`` names the schema it was written in."""
    cells = data.get("cells") or []
    if not any(cell.get("reference_samples_s") for cell in cells):
        return data
    workloads = run_references(cells)
    decode = data.get("kind") == "decode"
    if decode:
        from .bandwidth import enrich_decode_cell

        bandwidths = {record.get("device"): record for record in data.get("bandwidth") or []}
    out = []
    for cell in cells:
        if cell.get("reference_samples_s"):
            cell = correct_cell({k: v for k, v in cell.items() if k not in CORRECTED_FIELDS}, workloads)
            if "corrected_median_s" not in cell and cell.get("status") == "ok":
                flag_drift(cell)  # raw figures: the raw round spread flags it
            if decode:
                record = bandwidths.get(cell.get("device")) or {}
                cell = enrich_decode_cell(cell, record.get("gbps"), record.get("llc_bytes"))
        out.append(cell)
    upgraded = {**data, "schema": SCHEMA_VERSION, "recorrected_from": data.get("schema"), "cells": out}
    upgraded["reference"] = reference_summary(out, workloads)
    summary = dict(data.get("summary") or {})
    if "drift" in summary:
        summary["drift"] = sum(bool(cell.get("drift")) for cell in out)
    if "warnings" in summary:
        summary["warnings"] = sum(bool(cell.get("warnings")) for cell in out)
    upgraded["summary"] = summary
    return upgraded


def upgrade_report(data: dict) -> dict:
    """A loaded bench report read by today's rules: a schema-1 decode file's cells with ``bias``
    (`upgrade_decode_cells`), a schema-2 file's corrected figures re-derived (`recorrect_report`)."""
    data = upgrade_decode_cells(data)
    if data.get("schema") == PLAIN_RATIO_SCHEMA:
        data = recorrect_report(data)
    return data


def load_report(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict) or "cells" not in data:
        raise ValueError(f"{path} is not a benchmark report (no 'cells')")
    return upgrade_report(data)
