"""One engine for every check: plan the runs, execute them (here or in a worker pool), compare as they arrive.

A check is a *job* (the forward check `agreement.FORWARD`, the gradient check `grad.GRADIENT`,
the decode check `decode.DECODE`) with five parts:

* ``oracle(case, dtypes)``: the float64 answer of one case, built once per case in the parent
  and once per case in each worker that runs it;
* ``plan(case, selection)``: ``[(dtype, [Implementation, ...]), ...]``, the runs of one case in
  report order; each (case, dtype) is a *group* whose runs are compared pairwise;
* ``run(backend, impl, dtype, oracle)``: one run against the oracle (a backend's exception is
  its own status, never the engine's); ``portable(record)`` readies it to cross a process;
* ``pairs(records, oracle)``: every pair of a complete group; ``failed(...)``: the record of a
  run that could not finish (time limit, dead worker, oracle failure);
* ``stages(backend, impl, dtype, oracle)`` (forward only): a run's stage tensors, fetched from a
  worker when a disagreeing pair needs them for its first-divergence report.

`Job` holds what the jobs share (``pairs`` from ``compare_pair``, ``failed`` from the job's
``record`` class, ``portable``, ``release``); `checks.facade.run_check` adds ``select_cases``,
``new_result`` and ``label`` and runs any of them.

The engine hands the runs to an executor: `InlineExecutor` (in this process, in report order:
the library default, and the only one that accepts a backend object that does not pickle) or
`checks.pool.WorkerPool` (spawned workers, time limits; ``mha-rosetta check``'s default). Results
are kept in report order whatever order they finish in, so the JSON is the same either way.
Design rule: the engine knows no job's internals and imports no renderer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import combinations

from .cases import SpecCase
from .pool import WorkerPool
from .results import Run, Status
from .tasks import InlineExecutor, Task

UPDATE_SECONDS = 1.0  # at most one partial-result callback per second (each rewrites the JSON)
# ...and at most this share of the wall time in them: the default check's JSON is 3.9 MB, and
# rewriting it after each of its 67 groups took the parent 67 x 0.25 s of a 2-core machine's CPU
# (measured on an Intel Xeon, 2026-12-02), time the workers lost.
UPDATE_SHARE = 0.05


def executor_for(
    jobs: int | None, timeout: float | None = None, cache: bool | None = None, fast_compile: bool | None = None
):
    """`InlineExecutor` for ``jobs`` 0 or None, else a `checks.pool.WorkerPool` of ``jobs`` workers."""
    if not jobs:
        return InlineExecutor()
    if not isinstance(jobs, int) or jobs < 0:
        raise ValueError(f"jobs: expected a whole number of worker processes (0: run here), got {jobs!r}")
    return WorkerPool(jobs, timeout=timeout, cache=cache, fast_compile=fast_compile)


class Job:
    """What every check's job shares; a job sets ``record`` and ``label`` and writes ``compare_pair``."""

    record: type = Run  # the record of one run (`results.Run`, `GradRun`, `DecodeRun`)
    label = ""  # the prefix of its progress messages (`checks.facade.run_check`)

    def select_cases(self, cases):
        """``cases`` as `selection.resolve_selection` takes them: spec case names or `SpecCase` objects."""
        return cases

    def comparable(self, record) -> bool:
        """Whether ``record`` takes part in the pairs (it produced what is compared)."""
        return record.compared

    def compare_pair(self, a, b, oracle):
        raise NotImplementedError

    def pairs(self, records: list, oracle) -> list:
        compared = [record for record in records if self.comparable(record)]
        return [self.compare_pair(a, b, oracle) for a, b in combinations(compared, 2)]

    def portable(self, record):
        """The record without its stage source (a closure over the prepared run); stages already computed stay."""
        record.stage_source = None
        return record

    def release(self, records: list) -> None:
        for record in records:  # the stage tensors of this group are no longer needed
            record.release_stages()

    def failed(self, case: SpecCase, impl, dtype: str, kind: str, reason: str):
        return self.record(case.name, impl, dtype, kind, Status.ERROR, reason)


@dataclass
class _Group:
    case: SpecCase
    dtype: str
    indices: list[int]
    oracle: object
    done: bool = False


_check_ids = iter(range(1, 1 << 62))


def run_job(
    job,
    sel,
    result,
    executor=None,
    progress: Callable[[str], None] | None = None,
    on_update: Callable[[object], None] | None = None,
    started: float | None = None,
) -> None:
    """Fill ``result`` (its ``runs``, ``pairs``, ``timings``, ``interrupted``) with ``job`` over ``sel``.

    ``executor``: None (in this process), or an executor the caller keeps open across checks.
    ``on_update(result)`` is called with the finished groups as results arrive (at most once a
    second) and once at the end. Ctrl-C (KeyboardInterrupt) stops the check; the (case, dtype) groups
    that finished stay, whole, and a group still running is left out.
    ``started``: the clock (`time.perf_counter`) that ``result.seconds`` counts from (default: now).
    """
    started = time.perf_counter() if started is None else started
    own = executor is None
    executor = executor or InlineExecutor()
    check = next(_check_ids)
    backends = {backend.name: backend for backend in sel.backends}
    tasks: list[Task] = []
    groups: list[_Group] = []
    records: dict[int, object] = {}
    position = 0  # report order: oracle failures and runs in the order the cases come
    for case in sel.cases:
        plan = job.plan(case, sel)
        if not plan:
            continue
        dtypes = tuple(sel.case_dtypes(case))
        try:
            oracle = job.oracle(case, dtypes)
        except Exception as error:  # the oracle itself failed: every run of the case is an error
            for record in job.oracle_failed(case, sel, error):
                records[position], position = record, position + 1
            continue
        for dtype, impls in plan:
            group = _Group(case, dtype, [], oracle)
            for impl in impls:
                task = Task(
                    position,
                    job,
                    check,
                    case,
                    dtypes,
                    impl.backend,
                    impl.strategy,
                    impl.device,
                    dtype,
                    cache=impl.cache,
                )
                tasks.append(task)
                group.indices.append(position)
                position += 1
            groups.append(group)
    kinds = {name: backend.kind for name, backend in backends.items()}
    timings = _Timings(executor)
    pairs: dict[int, list] = {}
    next_update = -float("inf")  # the first finished group is written at once

    def publish() -> None:
        result.runs = [records[i] for i in sorted(records)]
        result.pairs = [pair for g in sorted(pairs) for pair in pairs[g]]
        result.timings = timings.as_dict()
        result.seconds = time.perf_counter() - started

    def finish(number: int, group: _Group) -> None:
        group.done = True
        finished = [i for i in group.indices if i in records]
        for i in finished:  # a run from a worker fetches its stages from one only if a pair needs them
            run = records[i]
            if getattr(run, "stage_source", False) is None and getattr(run, "_stages", False) is None:
                task = replace(task_at[i], stages=True)
                run.stage_source = lambda task=task: executor.call(task, backends)
        runs = [records[i] for i in finished]
        pairs[number] = job.pairs(runs, group.oracle)
        job.release(runs)

    task_at = {task.index: task for task in tasks}
    group_of = {index: number for number, group in enumerate(groups) for index in group.indices}
    left = {number: len(group.indices) for number, group in enumerate(groups)}
    try:
        announced = set()
        for task, status, answer, timing in executor.map(tasks, backends):
            number = group_of[task.index]
            if progress and number not in announced:
                announced.add(number)
                progress(f"{task.case.name} {task.dtype}")
            if status == "ok":
                records[task.index] = answer
            else:  # the executor's own failure: time limit, dead worker, an answer that did not come back
                records[task.index] = job.failed(task.case, task.impl, task.dtype, kinds[task.backend], answer)
            timings.add(task.backend, timing)
            left[number] -= 1
            if not left[number]:
                finish(number, groups[number])
                if on_update and time.perf_counter() >= next_update:
                    began = time.perf_counter()
                    publish()
                    on_update(result)
                    done = time.perf_counter()
                    next_update = done + max(UPDATE_SECONDS, (done - began) / UPDATE_SHARE)
    except KeyboardInterrupt:
        result.interrupted = True
        executor.close()  # stop the workers now: their runs are not waited for
    finally:
        for group in groups:  # an interrupted check keeps whole groups only, never half a comparison
            if not group.done:
                for index in group.indices:
                    records.pop(index, None)
        publish()
        if own:
            executor.close()
    if on_update:
        on_update(result)


class _Timings:
    """Per backend: runs, and seconds importing, compiling and running (from the workers' answers)."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.started = time.perf_counter()
        self.backends: dict[str, dict] = defaultdict(
            lambda: {"runs": 0, "import": 0.0, "compile": 0.0, "run": 0.0, "loaded": 0, "stored": 0}
        )

    def add(self, backend: str, timing: tuple) -> None:
        """``timing``: (import, compile, wall seconds[, executables loaded, stored]); the counts come from workers."""
        import_seconds, compile_seconds, wall = timing[:3]
        entry = self.backends[backend]
        entry["runs"] += 1
        if len(timing) == 5:
            entry["loaded"] += timing[3]
            entry["stored"] += timing[4]
        entry["import"] += import_seconds
        entry["compile"] += compile_seconds
        entry["run"] += max(wall - compile_seconds, 0.0)

    def as_dict(self) -> dict:
        return {
            "jobs": self.executor.jobs,
            "timeout": self.executor.timeout,
            "xla_flags": getattr(self.executor, "xla_flags", ""),  # what JAX compiled with (`checks.worker`)
            "probe": getattr(self.executor, "probe_seconds", 0.0),  # the workers' import of the frameworks
            "wall": time.perf_counter() - self.started,
            "backends": {name: dict(entry) for name, entry in self.backends.items()},
        }
