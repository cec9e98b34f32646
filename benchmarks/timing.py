"""Warm-up, adaptive repeats and the summary statistics of one timed callable.

The loop keeps timing until three things hold: at least ``min_repeats`` samples, at least
``min_time`` seconds of timed work, and a spread (IQR / median) under ``STABLE_SPREAD``.
It stops early at ``max_repeats`` samples and gives up on stability at ``max_time``
seconds (the result then says ``stable: false``). Each sample times one call of
``run_once``, which must include the device synchronisation, so that asynchronous
dispatch (JAX, CUDA) is never timed as free.

CPU time is read over the same span, so the caller can tell how many cores the timed
region really used, and so are this process's minor page faults (``page_faults_per_call``):
a call that maps its buffers afresh pays for faulting them in every time. Standard library
only: this runs inside measured children.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

STABLE_SPREAD = 0.10  # IQR / median below which more repeats would not move the median


def minor_page_faults() -> int | None:
    """This process's minor page faults so far (``getrusage``); None where the OS does not count them."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass(frozen=True)
class RepeatPolicy:
    """How long and how often to time one callable."""

    min_time: float = 1.0
    min_repeats: int = 5
    max_repeats: int = 10_000
    max_time: float = 5.0
    warmup: int = 2

    def __post_init__(self) -> None:
        for name in ("min_repeats", "max_repeats", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(
                    f"RepeatPolicy.{name} must be a {'non-negative' if name == 'warmup' else 'positive'} int, got {value!r}"
                )
        for name in ("min_time", "max_time"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RepeatPolicy.{name} must be a non-negative number of seconds, got {value!r}")
        if self.max_repeats < self.min_repeats:
            raise ValueError(f"RepeatPolicy.max_repeats={self.max_repeats} is below min_repeats={self.min_repeats}")


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """(q25, median, q75) with linear interpolation (NumPy's default), for any sample count."""
    if not samples:
        raise ValueError("quartiles of an empty sample list")
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0], ordered[0], ordered[0]
    q25, q50, q75 = statistics.quantiles(ordered, n=4, method="inclusive")
    return q25, q50, q75


def summarize(samples: list[float]) -> dict:
    """median, IQR, min, mean and count of a list of per-call times in seconds."""
    q25, median, q75 = quartiles(samples)
    return {
        "median_s": median,
        "iqr_s": q75 - q25,
        "min_s": min(samples),
        "mean_s": statistics.fmean(samples),
        "repeats": len(samples),
    }


def relative_spread(samples: list[float]) -> float:
    """IQR / median; infinite for fewer than 4 samples (too few to judge)."""
    if len(samples) < 4:
        return float("inf")
    q25, median, q75 = quartiles(samples)
    return (q75 - q25) / median if median > 0 else float("inf")


def warm_up(run_once: Callable[[], None], policy: RepeatPolicy, clock: Callable[[], float] = time.perf_counter) -> int:
    """Run ``policy.warmup`` calls, and more until a tenth of ``min_time`` is spent (capped at 50)."""
    calls = 0
    start = clock()
    while calls < policy.warmup or (calls < 50 and clock() - start < 0.1 * policy.min_time):
        run_once()
        calls += 1
    return calls


def time_repeats(
    run_once: Callable[[], None],
    policy: RepeatPolicy,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
    reference: Callable[[], None] | None = None,
) -> dict:
    """Time ``run_once`` under ``policy``; summary statistics plus CPU and wall time of the span.

    With ``reference`` (a fixed workload, `gemm.reference_product`), every sample is followed
    by one timed call of it: sample, reference, sample, reference, ... Sample ``i`` and
    reference ``i`` are adjacent, so a slowdown of the host hits both, and their ratio
    (``paired_ratios``) cancels it. The policy's time budget (``min_time``, ``max_time``)
    counts both, so pairing adds no time to a cell's timed span: it takes some of it.
    """
    samples: list[float] = []
    references: list[float] = []
    timed_total = reference_total = 0.0
    # Read at the span's ends only, never between a sample's clock readings. The reference product between
    # the samples faults no page on its own (0 a call over 200 calls, numpy 512^3 under the rule 'keep'),
    # so the count is the calls' (`pinning.malloc_env` says why that matters).
    faults_start = minor_page_faults()
    wall_start, cpu_start = clock(), cpu_clock()
    while True:
        start = clock()
        run_once()
        elapsed = clock() - start
        samples.append(elapsed)
        timed_total += elapsed
        if reference is not None:
            start = clock()
            reference()
            references.append(clock() - start)
            reference_total += references[-1]
        count, spent = len(samples), timed_total + reference_total
        if count >= policy.max_repeats:
            break
        if count >= policy.min_repeats and spent >= policy.min_time:
            if relative_spread(samples) <= STABLE_SPREAD or spent >= policy.max_time:
                break
    wall, cpu = clock() - wall_start, cpu_clock() - cpu_start
    faults_end = minor_page_faults()
    summary = summarize(samples)
    summary.update(
        page_faults_per_call=None if faults_start is None else (faults_end - faults_start) / len(samples),
        stable=relative_spread(samples) <= STABLE_SPREAD,
        samples_s=samples,  # every sample: a sweep of several rounds pools them (benchmarks.rounds)
        timed_total_s=timed_total,
        span_wall_s=wall,
        span_cpu_s=cpu,
    )
    if reference is not None:
        ratios = [sample / paired for sample, paired in zip(samples, references, strict=True)]
        summary.update(
            reference_samples_s=references,  # reference_samples_s[i] ran right after samples_s[i]
            paired_ratios=ratios,
            ratio_median=statistics.median(ratios),
            reference_median_s=statistics.median(references),
            reference_total_s=reference_total,
        )
    return summary


def fixed_median_s(
    run_once: Callable[[], None], repeats: int, warmup: int = 1, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The median seconds of exactly ``repeats`` timed calls of ``run_once`` after ``warmup`` untimed ones:
    `warm_up` and `time_repeats` at a fixed count (no time budget, no stability rule), for the cost scripts."""
    policy = RepeatPolicy(min_time=0.0, min_repeats=repeats, max_repeats=repeats, warmup=warmup)
    warm_up(run_once, policy, clock)
    return time_repeats(run_once, policy, clock=clock)["median_s"]


def cold_median_s(
    run_once: Callable[[], None],
    repeats: int,
    flush: Callable[[], None],
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The median seconds of exactly ``repeats`` timed calls of ``run_once``, each right after an untimed call of
    ``flush`` (a read of an array larger than the last-level cache), so that every call reads its arrays from
    memory: what the cost scripts time over caches of 256-512 MiB, which this host's 300 MiB L3, shared with
    other machines, holds in part or not at all from one run to the next (np.max over 256 MiB read 15.6-16.7
    GB/s warm on 2026-12-06 afternoon and 23.8-31.3 that night; issue 43). `memory_flush` makes a ``flush``."""
    for _ in range(warmup):
        run_once()
    samples = []
    for _ in range(repeats):
        flush()
        start = clock()
        run_once()
        samples.append(clock() - start)
    return statistics.median(samples)


def memory_flush(mib: int = 1024) -> Callable[[], None]:
    """A ``flush`` for `cold_median_s`: ``np.max`` over ``mib`` MiB of float32 (the default, 1 GiB, over three
    times this host's 300 MiB L3), allocated once here."""
    import numpy as np  # here, not at the top: the measured children import this module without NumPy's cost

    return np.ones(mib * 2**20 // 4, dtype=np.float32).max


def time_interleaved(
    variants: dict[str, Callable[[], None]],
    policy: RepeatPolicy,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict]:
    """Time several variants round-robin, so that drift in machine load hits them alike.

    Each round runs every variant once; rounds continue until every variant meets the
    policy's minimums (each variant's own timed total counts toward ``min_time``), and then
    until every variant is stable or ``max_time`` has passed. ``max_time`` also ends the
    rounds once every variant has ``min_repeats`` samples when a variant far shorter than the
    round has not yet filled ``min_time`` by itself: a breakdown's empty cut (microseconds)
    among cuts of a 60 ms decode step would otherwise run to ``max_repeats`` rounds (10,000:
    ten minutes at B=4, 4k, issue 43).
    """
    if not variants:
        raise ValueError("time_interleaved needs at least one variant")
    for run_once in variants.values():
        warm_up(run_once, RepeatPolicy(min_time=0.0, min_repeats=1, warmup=max(policy.warmup, 1)), clock)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    started = clock()
    while True:
        for name, run_once in variants.items():
            start = clock()
            run_once()
            samples[name].append(clock() - start)
        rounds = len(next(iter(samples.values())))
        if rounds >= policy.max_repeats:
            break
        counted = all(len(s) >= policy.min_repeats for s in samples.values())
        timed_out = clock() - started >= policy.max_time
        filled = all(sum(s) >= policy.min_time for s in samples.values())
        if counted and (timed_out or (filled and all(relative_spread(s) <= STABLE_SPREAD for s in samples.values()))):
            break
    # Every variant's samples are kept: sample i of each ran in the same round, next to the others,
    # so a ratio of two variants can be taken round by round (`questions._ratio`).
    return {name: {**summarize(times), "samples_s": times} for name, times in samples.items()}
