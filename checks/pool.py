"""The check's worker pool: spawned processes, one run at a time each, with a time limit and a replacement.

`WorkerPool` is an executor of `checks.engine` (``map`` the tasks, ``call`` one task now):

* ``jobs`` workers (`checks.worker`), started with ``spawn`` (see there why never ``fork``);
* scheduling by backend: a worker keeps taking the runs of the backend it ran last, so each
  framework's import and compilation are paid once per worker, not once per run; when that runs
  out it takes, of the backends no other worker is on, the one with the most estimated work left
  (longest-processing-time first, `estimated_seconds`), so the JAX backends that compile start
  first and the quick ones fill the end, and every worker stays busy until the last runs; among
  equal estimates it prefers one whose libraries it has already imported. When every backend
  left is taken, an idle worker joins one (it imports and compiles again, but does not wait),
  except a backend with processes of its own (`Backend.own_processes`: the sharded ones): a
  second group of ranks on the same cores made torch-tp's 54 runs of the issue's 675-run check
  take 15.9 s instead of 4.2 s alone (2 workers, 2 cores, warm, 2026-12-02);
* a run past ``timeout`` seconds has its worker killed (SIGKILL) and replaced; a worker that dies
  (``os._exit``, a signal, a native crash) is replaced too; either way the run is answered as an
  error naming what happened, the implementation and the case, and the check goes on;
* a backend that does not pickle (a class defined inside a function) runs in this process,
  without a time limit.
"""

from __future__ import annotations

import atexit
import multiprocessing
import pickle
import signal
import time
from collections import defaultdict, deque
from multiprocessing import connection

from mha_rosetta.backends import REGISTRY
from mha_rosetta.backends.frameworks import startup_s

from . import worker as worker_module
from .schedule import (
    JAX_RUN_SECONDS,
    OTHER_RUN_SECONDS,
    PROCESS_RUN_SECONDS,
    deal_imports,
    estimated_seconds,
    history_key,
    history_path,
    load_history,
    save_history,
)
from .tasks import execute

# The schedule's estimates live in `checks.schedule`; they are re-exported here, where they were first.
__all__ = [
    "JAX_RUN_SECONDS",
    "OTHER_RUN_SECONDS",
    "PROCESS_RUN_SECONDS",
    "WorkerPool",
    "deal_imports",
    "estimated_seconds",
    "exit_description",
    "history_path",
    "load_history",
]

WAIT_SECONDS = 0.5  # the longest a wait sleeps before looking at the clocks again
STOP_SECONDS = 3.0


def exit_description(exitcode: int | None) -> str:
    """``exit code 3``, ``signal SIGKILL``, or ``no exit status`` (still being reaped)."""
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class _Worker:
    def __init__(self, context, environment: dict[str, str], number: int) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=worker_module.main, args=(child, environment), name=f"mha-rosetta-check-{number}"
        )
        self.process.start()
        child.close()
        self.backends: set[str] = set()  # sent to this worker (it keeps them)
        self.imported: set[str] = set()  # the libraries those backends require
        self.last: str | None = None
        self.task = None
        self.started = 0.0

    def send(self, task, blob: bytes, requires: tuple[str, ...]) -> None:
        first = task.backend not in self.backends
        self.conn.send(("job", (task, blob if first else None, requires)))
        self.backends.add(task.backend)
        self.imported.update(requires)
        self.last, self.task, self.started = task.backend, task, time.perf_counter()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(STOP_SECONDS)
        self.conn.close()

    def ask_to_stop(self) -> None:
        """Ask an idle worker to stop (it returns from its loop; a running one is killed in `stop`)."""
        try:
            if self.task is None:
                self.conn.send(("stop", None))
        except (OSError, ValueError):
            pass

    def stop(self, deadline: float | None = None) -> None:
        """Wait until ``deadline`` (`time.perf_counter`; default: `STOP_SECONDS` from now) for it to exit, then kill."""
        if deadline is None:
            self.ask_to_stop()
            deadline = time.perf_counter() + STOP_SECONDS
        if self.task is None:
            self.process.join(max(0.0, deadline - time.perf_counter()))
        self.kill()


class WorkerPool:
    """``jobs`` spawned workers; ``timeout``: seconds per run (None: no limit); ``cache``: JAX's disk cache;
    ``fast_compile``: XLA's fast compile settings (`worker.FAST_COMPILE_FLAGS`). None: on unless switched off."""

    def __init__(
        self, jobs: int, timeout: float | None = None, cache: bool | None = None, fast_compile: bool | None = None
    ) -> None:
        if not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs: expected a whole number of worker processes >= 1, got {jobs!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: expected a number of seconds > 0 (or None: no limit), got {timeout!r}")
        self.jobs, self.timeout = jobs, timeout
        self.context = multiprocessing.get_context("spawn")
        self.environment = worker_module.worker_environment(
            worker_module.cache_enabled(cache), worker_module.fast_compile_enabled(fast_compile)
        )
        self.xla_flags = self.environment.get("XLA_FLAGS", "")
        # Seconds per run as last measured here (`load_history`), and this pool's own measurements, saved on
        # close; both only with the cache on (its folder holds the file).
        self.keeps_history = worker_module.cache_enabled(cache)
        self.history = load_history() if self.keeps_history else {}
        self.measured: dict[str, list[float]] = {}
        self.job_name = ""
        self.probe_seconds = 0.0  # the workers' import of the frameworks, before any run (`probe`)
        self.workers: list[_Worker] = []
        self.started_workers = 0
        self.pending: dict[str, deque] = defaultdict(deque)
        self.urgent: deque = deque()
        self.done: deque = deque()
        self.blobs: dict[str, bytes | None] = {}
        self.requires: dict[str, tuple[str, ...]] = {}
        self.solo: set[str] = set()  # backends with processes of their own: never in two workers at once
        self.inline_oracles: dict = {}
        self.closed = False
        atexit.register(self.close)

    # -- the executor interface ---------------------------------------------------------------
    def map(self, tasks: list, backends: dict):
        """Yield ``(task, "ok" | "error", answer, (import s, compile s, wall s))`` as each run finishes."""
        inline = deque()
        if tasks:
            self.job_name = type(tasks[0].job).__name__
        for task in tasks:
            if self._portable(task.backend, backends):
                self.pending[task.backend].append(task)
            else:
                inline.append(task)
        self._grow(len(tasks) - len(inline))
        while self._busy() or self._waiting() or self.done or inline:
            while self.done:
                yield self.done.popleft()
            if inline:  # a backend that cannot cross a process: here, between the workers' answers
                task = inline.popleft()
                started = time.perf_counter()
                answer = execute(task, backends[task.backend], self.inline_oracles)
                yield task, "ok", answer, (0.0, 0.0, time.perf_counter() - started)
                continue
            self._step(backends)

    def call(self, task, backends: dict):
        """Run ``task`` before anything else waiting and return its answer (raises RuntimeError if it failed)."""
        if self.closed:
            raise RuntimeError("the check's worker pool is closed")
        if not self._portable(task.backend, backends):
            return execute(task, backends[task.backend], self.inline_oracles)
        self._grow(1)
        self.urgent.append(task)
        while True:
            for item in list(self.done):
                if item[0] is task:
                    self.done.remove(item)
                    if item[1] != "ok":
                        raise RuntimeError(item[2])
                    return item[2]
            self._step(backends)

    def probe(self, modules) -> None:
        """Import ``modules`` in the workers and take their answers as this process's (`core.probe.remember`).

        Called before the check plans its runs, so that the frameworks are imported once, in the workers that
        run them, and not a first time here: the parent process only plans and compares (NumPy). The top-level
        libraries are dealt out to the workers by `deal_imports`, so that the imports run side by side. A worker
        that does not answer within the time limit, or dies, is replaced, and its libraries are probed here.
        """
        from mha_rosetta.core.probe import probe, remember

        modules = list(dict.fromkeys(modules))
        tops = list(dict.fromkeys(module.split(".")[0] for module in modules))
        if not tops:
            return
        dealt = deal_imports(tops, self.jobs)
        self._grow(len(dealt))
        asked: dict = {}
        for worker, share in zip(self.workers[: len(dealt)], dealt, strict=True):
            asked[worker] = [m for m in modules if m.split(".")[0] in share]
        started = time.perf_counter()
        for worker, wanted in asked.items():
            worker.conn.send(("probe", wanted))
        left = dict(asked)
        while left:
            wait = None if self.timeout is None else max(0.0, started + self.timeout - time.perf_counter())
            ready = connection.wait([w.conn for w in left] + [w.process.sentinel for w in left], wait)
            for worker in list(left):
                if worker.conn in ready:
                    try:
                        _status, answers, _timing = worker.conn.recv()
                    except (EOFError, OSError):
                        continue  # it died: below
                    remember(answers)
                    worker.imported.update(answer.module for answer in answers if answer.ok)
                    del left[worker]
                elif worker.process.sentinel in ready or not ready:  # dead, or out of time: probe here
                    for module in left.pop(worker):
                        probe(module)
                    self._replace(worker)
        self.probe_seconds = time.perf_counter() - started

    def close(self) -> None:
        """Stop every worker (killing one that is running or does not stop)."""
        if self.closed:
            return
        self.closed = True
        if self.keeps_history:
            save_history(self.measured)
        # Every worker is asked first and then waited for, so that their exits (each shuts down its
        # frameworks and a sharded backend's own processes, about 2.5 s) overlap instead of adding up.
        for worker in self.workers:
            worker.ask_to_stop()
        deadline = time.perf_counter() + STOP_SECONDS
        for worker in self.workers:
            worker.stop(deadline)
        self.workers.clear()
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scheduling ---------------------------------------------------------------------------
    def _portable(self, name: str, backends: dict) -> bool:
        if name not in self.blobs:
            backend = backends[name]
            try:
                self.blobs[name] = pickle.dumps(backend)
            except Exception:  # e.g. a class defined in a function: it runs in this process
                self.blobs[name] = None
            entry = REGISTRY.get(name)
            self.requires[name] = tuple(entry.requires if entry else getattr(backend, "requires", ()))
            if getattr(backend, "own_processes", False):
                self.solo.add(name)
        return self.blobs[name] is not None

    def _grow(self, wanted: int) -> None:
        if self.closed:
            raise RuntimeError("the check's worker pool is closed")
        while len(self.workers) < min(self.jobs, len(self._busy()) + wanted):
            self.started_workers += 1
            self.workers.append(_Worker(self.context, self.environment, self.started_workers))

    def _busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is not None]

    def _idle(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is None]

    def _waiting(self) -> bool:
        return bool(self.urgent) or any(self.pending.values())

    def _choose(self, worker: _Worker):
        if self.urgent:
            return self.urgent.popleft()
        if worker.last is not None and self.pending.get(worker.last):
            return self.pending[worker.last].popleft()
        left = [name for name, queue in self.pending.items() if queue]
        if not left:
            return None
        claimed = {w.last for w in self._busy()}
        choices = [name for name in left if name not in claimed] or [name for name in left if name not in self.solo]
        if not choices:
            return None

        def priority(name: str) -> tuple[float, int]:
            """The most work left first, less the imports this worker would add (`startup_s`): with the warm
            figures the worker that had imported JAX took torch-tp and the other jax-sharded, each importing
            the other's framework (1.5 s each); then the libraries it has."""
            measured = self.history.get(f"{self.job_name}|{name}")
            work = estimated_seconds(self.requires[name], len(self.pending[name]), measured, name in self.solo)
            missing = sum(startup_s(module) for module in self.requires[name] if module not in worker.imported)
            return work - missing, len(worker.imported.intersection(self.requires[name]))

        name = max(choices, key=priority)
        return self.pending[name].popleft()

    def _dispatch(self) -> None:
        for worker in self._idle():
            task = self._choose(worker)
            if task is None:  # nothing this worker may take; another idle one may still have its backend's runs
                continue
            try:
                worker.send(task, self.blobs[task.backend], self.requires[task.backend])
            except (OSError, ValueError):  # the worker died while idle: the task waits for its replacement
                self.urgent.appendleft(task)
                self._replace(worker)

    def _step(self, backends: dict) -> None:
        self._dispatch()
        busy = self._busy()
        if not busy:
            return
        now = time.perf_counter()
        wait = WAIT_SECONDS
        if self.timeout is not None:
            wait = max(0.0, min(wait, *(w.started + self.timeout - now for w in busy)))
        connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy], wait)
        for worker in busy:
            self._collect(worker)

    def _collect(self, worker: _Worker) -> None:
        task, elapsed = worker.task, time.perf_counter() - worker.started
        try:
            if worker.conn.poll():
                status, answer, timing = worker.conn.recv()
                worker.task = None
                if not task.stages:  # a run's whole time in the worker: import, compile and run
                    entry = self.measured.setdefault(history_key(task), [0.0, 0])
                    entry[0] += timing[0] + timing[2]
                    entry[1] += 1
                self.done.append((task, status, answer, timing))
                return
        except (EOFError, OSError):
            pass  # the pipe closed: the worker died, below
        if worker.process.is_alive() and not worker.conn.closed:
            if self.timeout is None or elapsed < self.timeout:
                return
            reason = (
                f"timed out: {task.describe()} ran past the time limit of {self.timeout:g} s (--timeout); "
                "its worker was killed and replaced, and the check went on"
            )
        else:
            worker.process.join(STOP_SECONDS)
            reason = (
                f"the worker process died ({exit_description(worker.process.exitcode)}) while running "
                f"{task.describe()}; it was replaced, and the check went on"
            )
        self.done.append((task, "error", reason, (0.0, 0.0, elapsed)))
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.task = None
        worker.kill()
        self.workers.remove(worker)
        if self._waiting():
            self.started_workers += 1
            self.workers.append(_Worker(self.context, self.environment, self.started_workers))
