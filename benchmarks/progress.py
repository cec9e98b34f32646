"""What the terminal is told: the estimated duration before a sweep, and its progress during it."""

from __future__ import annotations

import sys
import time

from mha_rosetta.backends import REGISTRY
from mha_rosetta.backends.frameworks import FRAMEWORKS, LIBRARY_STARTUP_S, startup_s

from .cell import CellSpec, split_implementation
from .plan import gemm_groups
from .timing import RepeatPolicy

# Seconds a fresh child spends before it times anything, per required module (`frameworks.startup_s`).
STARTUP_S = {name: startup_s(name) for name in (*FRAMEWORKS, *LIBRARY_STARTUP_S)}


def _startup_s(label: str) -> float:
    entry = REGISTRY.get(split_implementation(label)[0])
    return max((startup_s(module) for module in (entry.requires if entry else ())), default=0.5)


def _timed_s(policy: dict) -> float:
    # The timed region runs at least min_time, more while the spread is high (up to max_time),
    # after a warm-up and a first call: twice min_time plus 0.2 s matched the committed one-round
    # default and reference runs (0.8 and 1.6 s timed per cell at min_time 0.3 and 1.0).
    return 2.0 * RepeatPolicy(**policy).min_time + 0.2


def estimate_seconds(settings, cells: list[CellSpec]) -> dict:
    """The sweep's expected duration: cells x rounds x visits x seconds per visit, plus the GEMM peaks.

    The first round measures the peak with every installed library, later rounds with the
    winner only. An estimate from the repeat policy and `STARTUP_S`, not a measurement.
    """
    from .gemm import installed_gemm_libraries

    per_visit = [_startup_s(cell.implementation) + _timed_s(cell.policy) for cell in cells]
    per_cell = sum(per_visit) / len(per_visit) if per_visit else 0.0
    groups = len(gemm_groups(cells))
    peak_s = max(STARTUP_S.values()) / 2 + _timed_s(settings.gemm_policy)  # one library's peak, roughly
    libraries = max(len(installed_gemm_libraries()), 1)
    gemm_s = groups * peak_s * (libraries + (settings.rounds - 1))
    visits = getattr(settings, "visits", 1)  # the decode sweep visits each cell once a round
    total = sum(per_visit) * settings.rounds * visits + gemm_s
    return {
        "cells": len(cells), "rounds": settings.rounds, "visits": visits, "per_cell_s": per_cell, "gemm_s": gemm_s,
        "total_s": total,
    }  # fmt: skip


def duration_text(seconds: float) -> str:
    """An estimated duration as the terminal says it: ``40 s``, or ``3.6 min`` from 90 s on."""
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def describe_estimate(estimate: dict) -> str:
    """One line for the terminal: ``16 cells x 3 rounds x ~4.1 s + GEMM peaks ~20 s: about 3.6 min``."""
    when = duration_text(estimate["total_s"])
    return (
        f"{estimate['cells']} cells x {estimate['rounds']} round(s) x "
        + (f"{estimate['visits']} visits x " if estimate.get("visits", 1) > 1 else "")
        + f"~{estimate['per_cell_s']:.1f} s "
        f"+ GEMM peaks ~{estimate['gemm_s']:.0f} s: about {when} (estimated from the repeat policy "
        "and typical start-up times)"
    )


class Progress:
    """Rounds and the visits of the current round: rich bars on stderr where rich is installed,
    else one plain line per step."""

    def __init__(self, rounds: int, visits: int, enabled: bool = True) -> None:
        self.rounds, self.visits, self.enabled = rounds, visits, enabled
        self.round, self.done = 0, 0
        self._rich = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )  # fmt: skip
            self._rich.start()
            self._rounds_task = self._rich.add_task("rounds", total=rounds)
            self._task = self._rich.add_task("round 1", total=visits)
        except ImportError:
            self._rich = None

    def each_round(self, orders: list, wall_s: list[float]):
        """(round index, its visit order) for each round of a sweep, forward or decode: the round started and ended
        on the bars around the caller's visits, and its wall time appended to ``wall_s`` once it is done."""
        for index, order in enumerate(orders):
            self.start_round(index)
            started = time.perf_counter()
            yield index, order
            wall_s.append(time.perf_counter() - started)
            self.end_round()

    def start_round(self, index: int) -> None:
        self.round, self.done = index, 0
        if self._rich is not None:
            self._rich.reset(self._task, total=self.visits, description=f"round {index + 1}/{self.rounds}")

    def end_round(self) -> None:
        if self._rich is not None:
            self._rich.update(self._rounds_task, advance=1)

    def step(self, description: str) -> None:
        if self._rich is not None:
            self._rich.update(self._task, description=f"round {self.round + 1}/{self.rounds}: {description}")

    def advance(self, message: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1)
            self._rich.console.print(message, highlight=False, soft_wrap=True)
        else:
            where = f"[round {self.round + 1}/{self.rounds}, {self.done}/{self.visits}]"
            print(f"{where} {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


def describe_result(record: dict) -> str:
    """One progress line for a finished cell."""
    where = f"{record['implementation']} {record['device']} {record['dtype']} B={record['batch']} N={record['tokens']} D={record['d_model']} H={record['heads']}"
    if record.get("status") == "ok":
        warn = " (!) " + record["warnings"][0] if record.get("warnings") else ""
        util_text = f", {record['cpu_util']:.2f} cores" if record.get("cpu_util") is not None else ""
        return f"{where}: {record['median_s'] * 1e3:.3f} ms{util_text}{warn}"
    return f"{where}: {record.get('status')} ({record.get('error', '')})"
