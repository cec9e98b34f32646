"""The benchmark report: the versioned JSON document of one sweep, and the machine it ran on.

Its renderers live beside it: `markdown` (the table), `plots` (PNG), `baseline` (a saved
report compared).

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
``reference``), with their ratios. Schema 3 (the control-variate rule, `correct_cell`): each
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
import math
import os
import platform
import statistics
import sys
from pathlib import Path

from mha_rosetta.backends.versions import library_versions

from .provenance import cpu_model_and_flags, provenance
from .rounds import (
    DRIFT_THRESHOLD,
    FINISHED_STATUSES,
    drift_warning,
    is_drift_warning,
    relative_range,
    round_fractions,
    spread,
)

SCHEMA_VERSION = 3
# schema 1: no paired references, raw figures only; 2: corrected by the plain ratio, re-derived at load
READABLE_SCHEMAS = (1, 2, 3)
# Distributions whose versions explain a timing; read from metadata, nothing is imported.
PRIMARY_PEAK_KEY = "cpu/float32"  # the top-level gemm_peak_gflops, when it was measured
REFERENCE_SIZE = {"batch": 4, "tokens": 512, "d_model": 512, "heads": 8, "dtype": "float32"}


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


def run_references(cells: list[dict]) -> dict[str, dict]:
    """Every reference workload of the run, by `gemm.reference_key`, with its median time: the
    median over every measured visit of that visit's median reference (each visit counts once,
    however many samples it took; with several visits a round, `rounds.pool_visits`, from the
    ``visit_reference_medians_s`` the cells keep)."""
    from .gemm import reference_key

    workloads: dict[str, dict] = {}
    for cell in cells:
        if cell.get("status") != "ok" or not cell.get("reference"):
            continue
        workload = {name: value for name, value in cell["reference"].items() if name != "versions"}
        entry = workloads.setdefault(reference_key(workload), {**workload, "visit_medians_s": []})
        per_visit = [value for row in cell.get("visit_reference_medians_s") or [] for value in row or []]
        entry["visit_medians_s"] += [
            value for value in per_visit or cell.get("round_reference_medians_s") or [] if value
        ]
    for entry in workloads.values():
        values = entry.pop("visit_medians_s")
        entry.update(median_s=statistics.median(values) if values else None, visits=len(values))
    return workloads


# The control-variate rule (issue 28). A cell's samples are corrected only as far as they are seen to
# follow their reference: beta is the least-squares slope of log(sample) on log(the reference sample
# right after it), over all the cell's pairs pooled (so it sees the visit-to-visit drift as well as
# the fast one), clipped to [0, 1], and each sample becomes sample x (R / its reference) ^ beta, with
# R the run's median reference. beta = 1 is the plain paired ratio, beta = 0 the raw sample. Measured
# on two back-to-back reference runs (Intel Xeon, 2 cores, 2026-12-01, docs/benchmarks.md), where the
# reference's round medians ranged 2.7-7.7 ms (`scripts/correction-rules`): cells within 5% across the
# runs 15 of 20 with this rule, 14 raw, 10 with the plain ratio; cell-runs with rounds within 10% 29 of
# 40, 23 raw, 8 plain. Other betas did worse across the runs: from the within-visit pairs only (fast
# drift) 13 and 25; shrunk toward 0 by its t-statistic 14 and 28; from the three round medians alone
# 14 of 20 (its 32 of 40 rounds are the very points it was fitted to). A cell that slows its own
# reference shows it as a slope near 0, so no separate escape is needed (dropping schema 2's raised
# the pair from 14 and 26 to 15 and 29).
MIN_PAIRS = 10  # fewer pairs than this: no slope is estimated, the cell keeps its raw figures (beta 0)
_STILL = 1e-18  # a variance of the logs below this per pair (a spread of 1e-9: a clock's rounding) is no movement


def reference_fit(samples: list[float], references: list[float]) -> dict:
    """``{"beta", "correlation", "pairs"}``: how far a cell's samples follow their paired references.

    ``beta`` is the slope of log(sample) on log(reference) (cov / var), clipped to [0, 1];
    ``correlation`` the Pearson correlation of the two logs (None where either never moved).
    Fewer than `MIN_PAIRS` pairs, or references that never moved, give beta 0.
    """
    if len(samples) != len(references):
        raise ValueError(
            f"reference_fit: samples and references must pair one to one; got {len(samples)} and {len(references)}"
        )
    pairs = len(samples)
    if pairs < MIN_PAIRS:
        return {"beta": 0.0, "correlation": None, "pairs": pairs}
    xs, ys = [math.log(value) for value in references], [math.log(value) for value in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    syy = sum((y - mean_y) ** 2 for y in ys)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    if sxx <= pairs * _STILL:
        return {"beta": 0.0, "correlation": None, "pairs": pairs}
    correlation = sxy / math.sqrt(sxx * syy) if syy > pairs * _STILL else None
    return {"beta": min(1.0, max(0.0, sxy / sxx)), "correlation": correlation, "pairs": pairs}


def visit_sample_counts(cell: dict) -> list[int] | None:
    """How many of a cell's pooled samples each round's visit took: ``round_sample_counts`` where the cell
    records it (schema 3), else the one split of the pooled samples whose parts have exactly the recorded
    round medians of samples, paired ratios and references (schema 2; where several splits do, the first:
    they differ only in samples on the same side of every median). None where no split does."""
    if cell.get("round_sample_counts") is not None:
        return list(cell["round_sample_counts"])
    samples, ratios, references = (cell.get(name) or [] for name in _POOLED)
    rounds = cell.get("round_medians_s") or []
    wanted = [(cell.get(name) or [None] * len(rounds)) for name in ("round_ratio_medians", "round_reference_medians_s")]
    targets = [(index, rounds[index], wanted[0][index], wanted[1][index]) for index in range(len(rounds))
               if rounds[index] is not None]  # fmt: skip
    if not samples or not targets:
        return None

    def fits(start: int, end: int, target: tuple) -> bool:
        _index, median, ratio, reference = target
        parts = ((samples, median), (ratios, ratio), (references, reference))
        return all(want is None or statistics.median(values[start:end]) == want for values, want in parts)

    def split(start: int, position: int) -> list[int] | None:
        if position == len(targets) - 1:
            return [len(samples) - start] if start < len(samples) and fits(start, len(samples), targets[-1]) else None
        for end in range(start + 1, len(samples)):
            if fits(start, end, targets[position]):
                rest = split(end, position + 1)
                if rest is not None:
                    return [end - start, *rest]
        return None

    found = split(0, 0)
    if found is None:
        return None
    counts = [0] * len(rounds)
    for (index, *_), count in zip(targets, found, strict=True):
        counts[index] = count
    return counts


_POOLED = ("samples_s", "paired_ratios", "reference_samples_s")
# What `correct_cell` derives; a report re-derived under the current rule (`recorrect_report`) drops these first.
CORRECTED_FIELDS = (
    "corrected_median_s", "corrected_round_medians_s", "corrected_spread_s", "corrected_drift", "corrected_gflops",
    "corrected_peak_fraction", "reference_beta", "reference_correlation", "reference_pairs", "reference_disturbed",
    "reference_uncorrected",
)  # fmt: skip


def _flag_drift(cell: dict) -> None:
    """``drift`` and its warning from the cell's published round figures (corrected where it has them)."""
    drift = cell.get("corrected_drift", cell.get("round_drift"))
    cell["drift"] = bool(drift is not None and drift > DRIFT_THRESHOLD)
    kept = [warning for warning in cell.get("warnings") or [] if not is_drift_warning(warning)]
    cell["warnings"] = kept + ([drift_warning(cell)] if cell["drift"] else [])


def correct_cell(cell: dict, workloads: dict[str, dict]) -> dict:
    """Add the drift-corrected figures by the control-variate rule (above `MIN_PAIRS`): every sample x
    (the run's median reference for its workload / its own reference) ^ beta (`reference_fit`), and the
    median, round medians, spread, drift, GFLOP/s and % of peak of the corrected samples."""
    from .gemm import reference_key

    if not cell.get("reference") or not cell.get("reference_samples_s"):
        return cell
    reference_s = workloads.get(reference_key(cell["reference"]), {}).get("median_s")
    samples, references = cell.get("samples_s") or [], cell["reference_samples_s"]
    if not reference_s or len(samples) != len(references):
        return cell
    cell = dict(cell)
    counts = visit_sample_counts(cell)
    if counts is None or sum(counts) != len(samples):
        cell["reference_uncorrected"] = "its samples could not be told apart by round: raw figures only"
        cell["warnings"] = [*(cell.get("warnings") or []), f"not drift-corrected: {cell['reference_uncorrected']}"]
        return cell
    cell["round_sample_counts"] = counts  # recorded (schema 3) or found from the round medians (schema 2)
    fit = reference_fit(samples, references)
    cell.update(reference_beta=fit["beta"], reference_correlation=fit["correlation"], reference_pairs=fit["pairs"])
    corrected = [
        sample * (reference_s / paired) ** fit["beta"] for sample, paired in zip(samples, references, strict=True)
    ]
    cell["corrected_median_s"] = statistics.median(corrected)
    rounds, start = [], 0
    for count in counts:
        rounds.append(statistics.median(corrected[start : start + count]) if count else None)
        start += count
    cell["corrected_round_medians_s"] = rounds
    cell["corrected_spread_s"] = spread(rounds) or [cell["corrected_median_s"]] * 2
    cell["corrected_drift"] = relative_range(rounds)
    _flag_drift(cell)
    if cell.get("flops"):
        cell["corrected_gflops"] = cell["flops"] / cell["corrected_median_s"] / 1e9
        peak = cell.get("gemm_peak_gflops")
        cell["corrected_peak_fraction"] = cell["corrected_gflops"] / peak if peak else None
    return cell


CORRECTION_RULE = (
    "corrected sample = sample x (the run's median reference time / the reference sample right after it) ^ beta, "
    "beta = the cell's slope of log(sample) on log(reference) over all its pairs, clipped to [0, 1] "
    f"(0, the raw sample, below {MIN_PAIRS} pairs); corrected median and round medians = those of the corrected samples"
)


def reference_summary(cells: list[dict], workloads: dict[str, dict]) -> dict:
    """The report's ``reference`` entry: the workloads, and the reference's share of the timed work."""
    reference_s = sum(cell.get("reference_total_s") or 0.0 for cell in cells)
    timed_s = sum(cell.get("timed_total_s") or 0.0 for cell in cells if cell.get("reference_total_s"))
    return {
        "rule": CORRECTION_RULE,
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
        "provenance": provenance(),  # benchmarks.provenance: commit, host, CPU, command line
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
                _flag_drift(cell)  # raw figures: the raw round spread flags it
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
