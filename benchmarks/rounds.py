"""Interleaved rounds: the visit order, and one cell's (or GEMM peak's) figures merged over rounds.

A sweep of R rounds visits every cell once per round, in an order shuffled afresh each round
from one recorded seed, each visit a fresh process. Load from elsewhere on the machine then
lands on different cells in different rounds instead of on one implementation's whole row.

Visits per round (``visits``, V; 1 unless a preset says otherwise): every cell is visited V times
a round, each a fresh process, the round's order shuffling all V x cells visits together, and the
round's figures pool its V visits (`pool_visits`). Why: a cell's speed changes from one process to
the next by more than its paired reference can correct. Measured on the Intel Xeon (2 cores, 1
thread, 2026-12-04, reference size, numpy, torch, jax, torch-mha, einops-numpy): two visits of a
cell started under 8 s apart differed by 1.6-2.5% (rms / sqrt 2) in their paired-ratio medians,
as much as visits minutes apart (2.3-3.0%), and neither glibc's huge pages nor turning address
randomization off changed it; the samples within a visit spread far less (0.9-1.6% for the
visit's median). Only more processes average it out, and a round of V visits narrows its
median by about sqrt V, so that the round medians, and two runs, agree more closely.

What a cell reports after R rounds:

- ``median_s``: the median over *all* its timed samples (every round's samples pooled);
- ``round_medians_s``: one median per round (None where that visit failed or did not run);
- ``spread_s``: ``[min, max]`` of the round medians. Chosen over a bootstrap interval of the
  pooled median because the noise that moves a published figure is time-correlated (a burst
  of load covers a whole visit), so the samples of one visit are not independent draws: a
  bootstrap over them gives an interval far narrower than the round-to-round movement that
  a rerun shows. The range of the round medians measures exactly that movement, needs no
  assumption, and reads the same to everyone. With one round it is one point: no spread;
- ``round_drift``: max / min of the round medians minus 1; above `DRIFT_THRESHOLD` (10%)
  the cell is flagged (``drift: true``, and a warning).

Paired samples (schema 2): every sample of a visit is followed by one sample of a fixed
reference product (`gemm.reference_product`), and ``paired_ratios[i]`` is sample ``i`` over
reference ``i``. A cell then also has:

- ``reference_samples_s``, pooled like ``samples_s``, and ``round_sample_counts`` (schema 3):
  how many of the pooled samples each round's visit took (0 where it measured nothing), so that
  any per-sample correction can be taken round by round again;
- ``ratio_median``: the median of all its paired ratios (every round's pooled), and
  ``round_ratio_medians`` one per round; ``round_reference_medians_s`` each visit's median
  reference time;
- and, set by `correction.correct_cell` (it needs the run's median reference, so every cell): the
  control-variate correction, each sample x (the run's median reference / its own reference)
  ^ beta, with beta the cell's own slope of log(sample) on log(reference), clipped to [0, 1]
  (`correction.reference_fit`). ``corrected_median_s``, ``corrected_round_medians_s``,
  ``corrected_spread_s`` and ``corrected_drift`` come from the corrected samples; with them, it
  is ``corrected_drift``, not the raw ``round_drift``, that flags the cell (``drift``).

`cell_time` and `cell_interval` give the figure a table, ranking or verdict uses: the
corrected one where the cell has it, the raw median (and round range) otherwise.

The GEMM peak is measured in every round; a round whose peak is more than `BUSY_THRESHOLD`
(5%) below the best other round's is flagged: the machine was busy (`busy_rounds`).

Standard library only (it merges records; it measures nothing).
"""

from __future__ import annotations

import random
import statistics

from .timing import summarize

DRIFT_THRESHOLD = 0.10  # a cell whose round medians differ by more than this is flagged
BUSY_THRESHOLD = 0.05  # a round whose GEMM peak is this far below the best other round is flagged
# A visit with one of these statuses is done (a resumed sweep keeps it); anything else failed.
FINISHED_STATUSES = ("ok", "unsupported")
# Per-visit figures that summarise to the median over the rounds, those whose maximum counts, and those summed.
_COMBINED_FIELDS = (
    (("compile_s", "first_call_s", "cpu_util"), statistics.median),
    (("peak_mem_mb", "host_peak_growth_mb", "peak_rss_mb", "call_rss_peak_mb", "call_traced_peak_mb",
      "page_faults_per_call"), max),
    (("timed_total_s", "span_wall_s", "span_cpu_s", "visit_wall_s", "reference_total_s"), sum),
)  # fmt: skip


# A visit's per-sample lists, pooled over the rounds in the merged cell (sample i of reference_samples_s
# and paired_ratios belongs to sample i of samples_s).
_POOLED_FIELDS = ("samples_s", "reference_samples_s", "paired_ratios")


def _field_if_ok(visit: dict | None, name: str):
    return visit.get(name) if (visit or {}).get("status") == "ok" else None


def draw_seed() -> int:
    """A fresh shuffle seed (recorded in the report, so an order can be replayed with ``--seed``)."""
    return random.SystemRandom().randrange(2**31)


def round_orders(count: int, rounds: int, seed: int, visits: int = 1) -> list[list[int]]:
    """For each round, the order in which the ``count`` cells are visited (indices), from ``seed``:
    every index ``visits`` times, shuffled together (one visit a round gives the orders it always gave)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(count)) * visits
        rng.shuffle(order)
        orders.append(order)
    return orders


def _median(values: list) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def spread(values: list) -> list[float] | None:
    """``[min, max]`` of the values that are not None, or None without any."""
    present = [value for value in values if value is not None]
    return [min(present), max(present)] if present else None


def relative_range(values: list) -> float | None:
    """max / min - 1 of the values that are not None (0.0 for one value; None without any)."""
    present = [value for value in values if value is not None]
    return max(present) / min(present) - 1.0 if present and min(present) > 0 else None


def intervals_overlap(first: list[float] | tuple, second: list[float] | tuple) -> bool:
    """Whether two closed intervals ``[lo, hi]`` share a point."""
    return first[0] <= second[1] and second[0] <= first[1]


def raw_interval(cell: dict) -> list[float]:
    """A cell's ``spread_s`` (its raw round medians); for reports written before rounds existed, its median alone."""
    return list(cell.get("spread_s") or [cell["median_s"], cell["median_s"]])


def cell_time(cell: dict) -> float:
    """The time a table, ranking or verdict uses: ``corrected_median_s`` where the cell has it, else ``median_s``."""
    corrected = cell.get("corrected_median_s")
    return cell["median_s"] if corrected is None else corrected


def cell_interval(cell: dict) -> list[float]:
    """The spread of `cell_time`: a corrected cell's ``corrected_spread_s`` (its corrected median alone where it
    has none), a raw cell's `raw_interval`. Never the raw range of a corrected figure: a range is of the figure used."""
    if not is_corrected(cell):
        return raw_interval(cell)
    corrected = cell.get("corrected_spread_s")
    return list(corrected) if corrected else [cell["corrected_median_s"]] * 2


def is_corrected(cell: dict) -> bool:
    return cell.get("corrected_median_s") is not None


def published(cell: dict, name: str):
    """``corrected_<name>`` where the cell has corrected figures (``gflops``, ``peak_fraction``), else ``name``."""
    return cell.get(f"corrected_{name}") if is_corrected(cell) else cell.get(name)


def busy_rounds(peaks: list[float | None], threshold: float = BUSY_THRESHOLD) -> list[int]:
    """Rounds whose GEMM peak is more than ``threshold`` below the best other round's peak.

    Load from elsewhere only ever lowers a peak, so the best round is the least disturbed
    one; a round well under it shared the machine. (Against the median of the others, one
    busy round out of three would make the other two look moved as well.)
    """
    flagged = []
    for index, value in enumerate(peaks):
        others = [other for position, other in enumerate(peaks) if position != index and other is not None]
        if value is not None and others and value < (1.0 - threshold) * max(others):
            flagged.append(index)
    return flagged


# A cell whose visits differ by more than this many times as much as its paired reference's visit
# medians did: the host's speed explains little of it, the cell's own process changed. Measured on an
# Intel Xeon (2 cores, 1 thread, 2026-12-02): equinox's visits ran at 84-87 ms or at about 101-104 ms,
# one speed per process (8 rounds: 101.2, 101.0, 101.0, 86.4, 101.1, 84.9, 101.5, 100.9 ms), while the
# reference moved by 8% (2.40-2.59 ms); two back-to-back reference sweeps then differed by 17% on it.
OWN_DRIFT_FACTOR = 2.0


def drift_warning(cell: dict, threshold: float = DRIFT_THRESHOLD) -> str:
    """The warning of a cell flagged ``drift``: of its corrected round medians where it has them, else of its raw ones.

    Where the cell moved far more than its paired reference over the same visits (`OWN_DRIFT_FACTOR`),
    it says that the cell itself, not the host, changed speed from one process to the next.
    """
    reference = relative_range(cell.get("round_reference_medians_s") or [])
    steady = reference is not None and reference * OWN_DRIFT_FACTOR < cell["round_drift"]
    if cell.get("corrected_drift") is not None:
        text = (
            f"drift: the corrected round medians differ by {cell['corrected_drift']:.0%}, more than {threshold:.0%}, "
            f"even after the correction (raw: {cell['round_drift']:.0%})"
        )
    else:
        low, high = cell["spread_s"]
        text = (
            f"drift: the round medians differ by {cell['round_drift']:.0%} ({low * 1e3:.3f} to {high * 1e3:.3f} ms), "
            f"more than {threshold:.0%}" + ("" if steady else ": the machine's load changed between rounds")
        )
    if steady:
        text += (
            f"; its paired reference moved by only {reference:.0%} over those visits, so the host explains little "
            "of it: the cell itself ran at different speeds in different processes (more rounds narrow its median)"
        )
    return text


def is_drift_warning(text: str) -> bool:
    """Whether a warning is `drift_warning`'s (or an older report's: its paired-ratio and disturbed-reference ones)."""
    return text.startswith(("drift: ", "reference disturbed, "))


def _combine_per_visit(record: dict, measured: list[dict]) -> None:
    """Set ``record``'s per-visit figures (`_COMBINED_FIELDS`: medians, maxima, sums) and ``stable`` from
    the measured visits (or rounds)."""
    for names, combine in _COMBINED_FIELDS:
        for name in names:
            values = [visit.get(name) for visit in measured if visit.get(name) is not None]
            if values:
                record[name] = combine(values)
    record["stable"] = all(visit.get("stable", True) for visit in measured)


def pool_visits(visits: list[dict | None]) -> dict | None:
    """One round's record of a cell from that round's visits (``visits`` per round, each a fresh process).

    One visit is returned as it is. Several: the samples (and their paired references and ratios)
    pooled in visit order, the statistics taken again over them, per-visit figures combined as
    `merge_visits` combines rounds, and each visit's median, ratio median and reference median kept
    (``visit_medians_s``, ``visit_ratio_medians``, ``visit_reference_medians_s``). A failed visit makes
    the round failed (its status, "visit k: ..." as the error; a resumed sweep runs that visit again);
    a round whose visits were all unsupported is unsupported; None: none ran.
    """
    present = [(index, visit) for index, visit in enumerate(visits) if visit is not None]
    if len(visits) == 1 or not present:
        return visits[0] if visits else None
    failed = [(index, visit) for index, visit in present if visit.get("status") not in FINISHED_STATUSES]
    ok = [visit for _index, visit in present if visit.get("status") == "ok"]
    if failed or not ok:
        index, visit = (failed or present)[0]
        return {**visit, "error": f"visit {index + 1}: {visit.get('error', '')}"} if failed else dict(visit)
    record = dict(ok[0])
    for name in _POOLED_FIELDS:
        record.pop(name, None)
        if all(visit.get(name) for visit in ok):
            record[name] = [value for visit in ok for value in visit[name]]
    if "samples_s" in record:
        record.update(summarize(record["samples_s"]))
    else:  # visits recorded without their samples: the median of the visit medians
        record["median_s"] = statistics.median(visit["median_s"] for visit in ok)
    record["visit_medians_s"] = [visit["median_s"] for visit in ok]
    if "paired_ratios" in record:
        record["ratio_median"] = statistics.median(record["paired_ratios"])
        record["reference_median_s"] = statistics.median(record["reference_samples_s"])
        record["visit_ratio_medians"] = [visit.get("ratio_median") for visit in ok]
        record["visit_reference_medians_s"] = [visit.get("reference_median_s") for visit in ok]
    _combine_per_visit(record, ok)
    record["warnings"] = list(dict.fromkeys(
        f"visit {index + 1}: {warning}" for index, visit in present for warning in visit.get("warnings") or []
    ))  # fmt: skip
    return record


def merge_visits(visits: list[dict | None], drift_threshold: float = DRIFT_THRESHOLD) -> dict | None:
    """One cell's record from its visits, one per round (None: that round did not reach it).

    Identity, settings and per-visit details come from the first measured visit; the timing
    statistics from all samples pooled; compile and first-call time and cores used are
    medians over the rounds, memory the maximum. A cell with a failed visit keeps the failure
    as its status (a resumed sweep runs that visit again) and the figures of the other rounds.
    """
    present = [(index, visit) for index, visit in enumerate(visits) if visit is not None]
    if not present:
        return None
    ok = [(index, visit) for index, visit in present if visit.get("status") == "ok"]
    record = dict(ok[0][1] if ok else present[0][1])
    for name in _POOLED_FIELDS:
        record.pop(name, None)
    several = len(visits) > 1
    failed = [(index, visit) for index, visit in present if visit.get("status") not in FINISHED_STATUSES]
    if failed:
        index, visit = failed[0]
        record["status"] = visit.get("status", "error")
        record["error"] = f"round {index + 1}: {visit.get('error', '')}" if several else visit.get("error", "")
    if several:
        record["round_status"] = [None if visit is None else visit.get("status") for visit in visits]
    if not ok:
        return record
    oks = [visit for _index, visit in ok]
    pooled = [sample for visit in oks for sample in visit.get("samples_s") or []]
    if pooled and all(visit.get("samples_s") for visit in oks):
        record.update(summarize(pooled))
    else:  # visits recorded without their samples: the median of the round medians
        record.update(
            median_s=_median([visit["median_s"] for visit in oks]),
            iqr_s=_median([visit.get("iqr_s") for visit in oks]),
            min_s=min(visit.get("min_s", visit["median_s"]) for visit in oks),
            repeats=sum(visit.get("repeats", 0) for visit in oks),
        )
    for name in _POOLED_FIELDS:  # kept (schema 2): every sample, in round order
        if all(visit.get(name) for visit in oks):
            record[name] = [value for visit in oks for value in visit[name]]
    record["round_medians_s"] = [visit["median_s"] if (visit or {}).get("status") == "ok" else None for visit in visits]
    record["spread_s"] = spread(record["round_medians_s"])
    # Several visits a round (`pool_visits`): each visit's figures, per round.
    for name in ("visit_medians_s", "visit_ratio_medians", "visit_reference_medians_s"):
        if any(_field_if_ok(visit, name) for visit in visits):
            record[name] = [_field_if_ok(visit, name) for visit in visits]
    drift = relative_range(record["round_medians_s"])
    record["round_drift"] = drift
    record["drift"] = bool(drift is not None and drift > drift_threshold)
    if "paired_ratios" in record:
        record["round_sample_counts"] = [len(visit.get("samples_s") or []) if _field_if_ok(visit, "median_s") else 0
                                         for visit in visits]  # fmt: skip
        record["ratio_median"] = statistics.median(record["paired_ratios"])
        record["round_ratio_medians"] = [_field_if_ok(visit, "ratio_median") for visit in visits]
        record["round_reference_medians_s"] = [_field_if_ok(visit, "reference_median_s") for visit in visits]
        record["reference_median_s"] = statistics.median(record["reference_samples_s"])
    _combine_per_visit(record, oks)
    if record.get("flops") and record["median_s"]:
        record["gflops"] = record["flops"] / record["median_s"] / 1e9
    warnings: list[str] = []
    for index, visit in ok:
        for warning in visit.get("warnings") or []:
            text = f"round {index + 1}: {warning}" if several else warning
            if text not in warnings:
                warnings.append(text)
    if record["drift"]:
        warnings.append(drift_warning(record, drift_threshold))
    record["warnings"] = warnings
    return record


def merge_peaks(peaks: list[dict | None], busy_threshold: float = BUSY_THRESHOLD) -> dict | None:
    """One (device, dtype)'s GEMM peak from its per-round records (None: that round did not measure it).

    ``gflops`` is the median of the round peaks; ``round_gflops`` keeps each round's figure
    (the cells' ``% of peak`` uses its own round's), ``busy_rounds`` the rounds flagged busy.
    The libraries compared, and the winner, are those of the first round that measured.
    """
    present = [peak for peak in peaks if peak is not None]
    if not present:
        return None
    record = dict(present[0])
    round_gflops = [None if peak is None else peak.get("gflops") for peak in peaks]
    record["round_gflops"] = round_gflops
    record["measured_gflops"] = [value for value in round_gflops if value is not None]
    record["gflops"] = _median(round_gflops)
    record["busy_rounds"] = busy_rounds(round_gflops, busy_threshold)
    return record


def round_fractions(cell: dict, round_peaks: list[float | None] | None) -> list[float | None] | None:
    """Each round's GFLOP/s of ``cell`` over the same round's GEMM peak (None where either is missing)."""
    medians, flops = cell.get("round_medians_s"), cell.get("flops")
    if not medians or not round_peaks or not flops or len(medians) != len(round_peaks):
        return None
    return [
        flops / median / 1e9 / peak if (median and peak) else None
        for median, peak in zip(medians, round_peaks, strict=True)
    ]
