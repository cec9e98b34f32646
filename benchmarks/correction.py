"""The control-variate correction (issue 28): each cell's samples against the reference product paired with them.

Every sample of a paired cell is followed by one sample of a fixed reference product (`gemm.reference_product`);
here each sample is corrected by (R / its reference) ^ beta, R the run's median reference time for that workload
(`run_references`) and beta the cell's own slope of log(sample) on log(reference) (`reference_fit`), and the
corrected median, round medians, spread, drift, GFLOP/s and % of peak follow (`correct_cell`). A report records
the rule and the reference's share of the timed work (`reference_summary`). The figures a table, ranking or
verdict reads are then `rounds.cell_time` and `rounds.cell_interval` (the corrected ones where a cell has them).

Standard library only: it reads records and measures nothing.
"""

from __future__ import annotations

import math
import statistics

from .rounds import DRIFT_THRESHOLD, drift_warning, is_drift_warning, relative_range, spread


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


def flag_drift(cell: dict) -> None:
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
    flag_drift(cell)
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
