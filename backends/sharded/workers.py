"""Worker processes that a distributed backend starts, talks to with time limits, and tears down.

The sharded backends run outside the calling process: `jax-sharded` in one process whose
JAX sees several simulated CPU devices (``--xla_force_host_platform_device_count`` must
be set before JAX starts, and the caller's JAX may already have started), `torch-tp` in
one process per rank joined by a gloo process group. A `WorkerGroup` owns those
processes:

* it starts them (each a fresh interpreter, ``python -m`` this module, with the
  environment given and nothing inherited from the caller's frameworks) the first time a backend prepares a case, and
  reuses them for later cases, because starting a framework costs seconds;
* every request has a time limit, and while it waits it watches the processes: a rank
  that dies is reported at once (with its exit code and what it was doing) as a
  `WorkerError`, never a hang, and the group is torn down; the next request starts a
  fresh one;
* an exception inside a worker (bad input, an unsupported dtype) comes back as a
  `WorkerError` with the worker's message; a single worker stays up, a group of ranks is
  torn down (the others may be waiting for it in a collective);
* `close()` (also run at interpreter exit) stops the processes, killing any that do
  not stop within a few seconds.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing import connection
from multiprocessing.connection import Connection

# How often a waiting request checks that every worker is still alive. An answer wakes the
# wait at once (`connection.wait`): a fixed sleep here would round every forward pass up to
# a multiple of it (measured: docs/notes/backends-measurements.md).
POLL_SECONDS = 0.05
STOP_SECONDS = 5.0
# How long a rank whose collective failed waits for a dying peer to be seen dead (a loaded
# machine can take seconds to finish killing a process).
DEATH_SECONDS = 5.0


class WorkerError(RuntimeError):
    """A worker process died, timed out or raised; the message says which and why."""


def serve(conn, handlers: dict[str, Callable]) -> None:
    """The worker side: answer ``(command, payload)`` messages until "stop" or the pipe closes."""
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):
            return
        if command == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[command](payload)))
        except Exception as error:
            # The message, and where in the worker it was raised (the innermost frame).
            message = "".join(traceback.format_exception_only(type(error), error)).strip()
            frame = traceback.extract_tb(error.__traceback__)[-1]
            conn.send(("error", f"{message} (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"))


class Programs:
    """The cases a worker has built, by key (the worker side of "prepare"); the oldest beyond
    ``keep`` are dropped, since a caller holds only the last few `Prepared` passes."""

    def __init__(self, build: Callable, keep: int = 4) -> None:
        self.build, self.keep = build, keep
        self.items: dict[int, dict] = {}
        self.next_key = 0

    def prepare(self, payload) -> tuple[int, dict]:
        key, self.next_key = self.next_key, self.next_key + 1
        self.items[key] = self.build(*payload)
        for old in sorted(self.items)[: -self.keep]:
            del self.items[old]
        return key, self.items[key]["info"]

    def __getitem__(self, key: int) -> dict:
        return self.items[key]


class WorkerGroup:
    """``size`` processes running ``target(conn, rank, size, *args)``, each with a pipe to this one.

    ``target`` must call `serve` (after its own set-up, which may include a first reply).

    With ``scratch`` (a name prefix), every start makes a fresh folder for the processes' files
    (torch-tp's rendezvous file: gloo's FileStore must not be reused) and passes its path as the
    last argument: ``target(conn, rank, size, *args, folder)``. `close` removes it. The processes
    end without the interpreter's shutdown (`_child_main`), so nothing of theirs would; before
    this, every check left a ``mha-rosetta-tp-*`` folder in the temporary directory.
    """

    def __init__(
        self,
        name: str,
        target: Callable,
        size: int,
        args: tuple = (),
        env: dict | None = None,
        start_timeout: float = 120.0,
        scratch: str | None = None,
    ) -> None:
        self.name, self.target, self.size, self.args = name, target, size, args
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.scratch, self.folder = scratch, None  # the prefix, and this start's folder (None: none now)
        self.processes: list = []
        self.conns: list = []
        atexit.register(self.close)
        _GROUPS.add(self)

    @property
    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes)

    def start(self) -> None:
        """Start the processes (a fresh group) and wait until each says it is ready."""
        self.close()
        env = {**os.environ, **self.env}
        target = f"{self.target.__module__}:{self.target.__qualname__}"
        args = self.args
        if self.scratch is not None:
            self.folder = tempfile.mkdtemp(prefix=self.scratch)
            args = (*args, self.folder)
        for rank in range(self.size):
            # A socket pair per rank: a fresh interpreter (`python -m`, not multiprocessing's
            # spawn, which would re-run the caller's main script) gets its end by descriptor.
            ours, theirs = socket.socketpair()
            command = [sys.executable, "-m", __name__, str(theirs.fileno()), target, str(rank), str(self.size)]
            process = subprocess.Popen(command, env=env, pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            self.processes.append(process)
            self.conns.append(conn)
            conn.send(args)
        self._collect("starting", self.start_timeout)

    def request(self, command: str, payloads, timeout: float, what: str = "") -> list:
        """Send ``(command, payload)`` to every rank (one payload for all, or a list of one per
        rank) and return their answers, in rank order."""
        # A rank of a running group that died since the last request is that request's error, never a silent
        # restart: the group's prepared programs died with it (close() empties `processes`, so a group torn down
        # on purpose starts afresh below).
        dead = self._dead_rank(exclude=-1, wait=0.0)
        if dead is not None:
            self._fail(self._death(dead, what or command))
        if not self.alive:
            self.start()
        if not isinstance(payloads, list):
            payloads = [payloads] * self.size
        try:
            for conn, payload in zip(self.conns, payloads, strict=True):
                conn.send((command, payload))
        except (BrokenPipeError, OSError) as error:
            # A closed pipe is most often a rank that has just died: name it, as `_collect` would.
            dead = self._dead_rank(exclude=-1, wait=DEATH_SECONDS)
            if dead is not None:
                self._fail(self._death(dead, what or command))
            self._fail(f"could not send {command!r}: {error}")
        return self._collect(what or command, timeout)

    def _collect(self, what: str, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        answers: list = [None] * self.size
        pending = set(range(self.size))
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                try:
                    ready = conn.poll(0)
                    message = conn.recv() if ready else None
                except (EOFError, OSError):
                    ready, message = True, None
                if not ready:
                    continue
                if message is None:
                    self._fail(self._death(rank, what))
                if message[0] == "error" and self.size > 1:
                    # A rank's collective fails when a peer dies: name the dead peer as the cause.
                    dead = self._dead_rank(exclude=rank, wait=DEATH_SECONDS)
                    if dead is not None:
                        self._fail(f"{self._death(dead, what)} (rank {rank} then failed: {message[1]})")
                    # The other ranks may be waiting in a collective for this one: tear down now.
                    self.close()
                    raise WorkerError(
                        f"{self.name} rank {rank} raised while {what}: {message[1]}; the group was torn down"
                    )
                pending.discard(rank)
                answers[rank] = message
            if not pending:
                break
            dead = [rank for rank, p in enumerate(self.processes) if p.poll() is not None and rank in pending]
            if dead:
                self._fail(self._death(dead[0], what))
            if time.monotonic() > deadline:
                ranks = ", ".join(map(str, sorted(pending)))
                self._fail(f"{self.name}: rank(s) {ranks} gave no answer within {timeout:g} s while {what}")
            # Sleep until a pending rank answers (or its pipe closes because it died), at most POLL_SECONDS.
            connection.wait([self.conns[rank] for rank in pending], timeout=POLL_SECONDS)
        errors = [(rank, text) for rank, (status, text) in enumerate(answers) if status == "error"]
        if errors:
            rank, text = errors[0]
            raise WorkerError(f"{self.name} rank {rank} raised while {what}: {text}")
        return [value for _, value in answers]

    def _dead_rank(self, exclude: int, wait: float) -> int | None:
        """A rank (other than ``exclude``) whose process has exited, waiting up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            for rank, process in enumerate(self.processes):
                if rank != exclude and process.poll() is not None:
                    return rank
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_SECONDS)

    def _death(self, rank: int, what: str) -> str:
        try:
            code = self.processes[rank].wait(0.5)
        except subprocess.TimeoutExpired:
            code = None
        how = "is gone" if code is None else f"died (exit code {code})"
        return f"{self.name}: rank {rank} of {self.size} {how} while {what}"

    def _fail(self, message: str):
        self.close()
        raise WorkerError(message + "; the process group was torn down (the next prepare starts a new one)")

    def ask_to_stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass

    def close(self) -> None:
        """Stop every process: ask, wait a little, then terminate and kill."""
        self.ask_to_stop()
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        if self.folder is not None:  # after the processes, which may still hold files in it
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


_GROUPS: weakref.WeakSet = weakref.WeakSet()  # every group of this process, for `close_all`


def close_all() -> None:
    """Stop every group of this process side by side: all are asked first, then each is waited for."""
    groups = list(_GROUPS)
    for group in groups:
        group.ask_to_stop()
    for group in groups:
        group.close()


def _child_main(argv: list[str]) -> None:
    """``python -m mha_rosetta.backends.sharded.workers FD MODULE:FUNCTION RANK SIZE``: a worker's start.

    When its target returns (asked to stop, or its caller gone), the process ends at once, without
    the interpreter's shutdown: with torch or JAX imported that takes 1.4 s (measured, Intel Xeon,
    2026-12-02), and the caller waits for it. The target has released what it holds by then (torch-tp
    destroys its process group), and a worker writes no files.
    """
    fd, target, rank, size = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    conn = Connection(fd)
    module, _, function = target.partition(":")
    args = conn.recv()
    getattr(importlib.import_module(module), function)(conn, rank, size, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_prepared(group: WorkerGroup, payload, what: str, seconds: tuple[float, float], stages_of: Callable):
    """The `Prepared` of a case that runs in ``group``: "prepare" once (rank 0 answers with a key
    and the info), then "forward" (every rank runs, waits, keeps its result), "fetch" (rank 0's)
    and "stages" (every rank's answers, made into stage tensors by ``stages_of``).
    ``seconds`` = (prepare, forward) time limits."""
    from ..base import Prepared, tensor_to_numpy

    prepare_seconds, forward_seconds = seconds
    key, info = group.request("prepare", payload, prepare_seconds, what=what)[0]

    def forward():
        group.request("forward", key, forward_seconds, what="running the forward pass")
        return key

    def to_numpy(_token):
        return tensor_to_numpy(group.request("fetch", key, forward_seconds, what="fetching the output")[0])

    def native_stages() -> dict:
        return stages_of(group.request("stages", key, forward_seconds, what="gathering the stages"))

    return Prepared(forward=forward, to_numpy=to_numpy, native_stages=native_stages, info=info)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
