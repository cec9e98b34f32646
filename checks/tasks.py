"""The unit of a check's work, and how one is carried out: `Task`, `execute` and `InlineExecutor`.

Below the engine (`checks.engine`, which plans and compares) and the worker pool
(`checks.pool`, `checks.worker`, which carry tasks to other processes), so that all three
import it and none of them imports another in a circle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .cases import SpecCase
from .results import Implementation


@dataclass(frozen=True)
class Task:
    """One unit of work: a run of one implementation on one case and dtype (or its stage dump)."""

    index: int  # position in the report
    job: object  # the job (`agreement.FORWARD`, `grad.GRADIENT`); pickled by reference to its class
    check: int  # which check it belongs to: a worker drops its cached oracles when this changes
    case: SpecCase
    oracle_dtypes: tuple[str, ...]
    backend: str
    strategy: str
    device: str
    dtype: str
    stages: bool = False  # a stage dump for a pair's first-divergence report instead of a run
    cache: str = ""  # the decode check's KV-cache kind (`Implementation.cache`); "" for the others

    @property
    def impl(self) -> Implementation:
        return Implementation(self.backend, self.strategy, self.device, self.cache)

    def describe(self) -> str:
        return f"{self.impl.label} on case {self.case.name} ({self.dtype})"


def execute(task: Task, backend, oracles: dict):
    """Run ``task`` with ``backend``; ``oracles``: this process's cache, one oracle per (job, case) of a check."""
    if oracles.get("check") != task.check:
        oracles.clear()
        oracles["check"] = task.check
    key = (type(task.job).__name__, task.case.name)
    if key not in oracles:
        oracles[key] = task.job.oracle(task.case, task.oracle_dtypes)
    if task.stages:
        return task.job.stages(backend, task.impl, task.dtype, oracles[key])
    return task.job.run(backend, task.impl, task.dtype, oracles[key])


class InlineExecutor:
    """Runs every task here, one after the other, in report order (no time limit: nothing to kill)."""

    jobs = 0
    timeout = None

    def __init__(self) -> None:
        self.oracles: dict = {}
        self.xla_flags = os.environ.get("XLA_FLAGS", "")  # this process's own: no fast compile settings here

    def map(self, tasks: list[Task], backends: dict) -> Iterator[tuple[Task, str, object, tuple]]:
        for task in tasks:
            started = time.perf_counter()
            record = execute(task, backends[task.backend], self.oracles)
            yield task, "ok", record, (0.0, 0.0, time.perf_counter() - started)

    def call(self, task: Task, backends: dict):
        return execute(task, backends[task.backend], self.oracles)

    def close(self) -> None:
        self.oracles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
