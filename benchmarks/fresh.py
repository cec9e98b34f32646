"""Run one measurement in a fresh Python process, pinned, and read back its JSON result.

Every cell, GEMM peak and benchmark question runs this way, so that no framework, thread
pool, allocator or JIT cache from an earlier measurement can colour the next one, and so
that the thread environment is in place before the child imports anything.

Protocol: the parent runs ``python -m <module> '<json spec>'`` with the environment from
`pinning.thread_env`; the child pins itself to ``spec["cpus"]`` first thing (before it
imports NumPy or a framework), measures, and prints one line
``MHA_ROSETTA_RESULT {json}``. Frameworks may print what they like around it. A child
that dies, hangs past the timeout or prints no result line becomes a result with
``status`` "error" or "timeout" and the tail of its stderr, never an exception.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

from .pinning import pin_current_process, thread_env

RESULT_MARKER = "MHA_ROSETTA_RESULT "
_STDERR_TAIL = 2000


def parse_result(stdout: str) -> dict | None:
    """The last result line in a child's stdout, decoded, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None


def error_result(error: Exception) -> dict:
    """A measurement that raised, as data: the sweep goes on without it."""
    return {"status": "error", "error": f"{type(error).__name__}: {error}"}


def child_main(
    argv: list[str] | None,
    module: str,
    measure: Callable[[dict], dict],
    on_error: Callable[[Exception], dict] = error_result,
    spec_name: str = "json spec",
) -> int:
    """A measuring child's ``main``: one JSON spec argument, pin, measure, print the result line.

    The child pins itself before ``measure`` imports anything heavy; an exception in
    ``measure`` becomes the result ``on_error`` makes of it (called inside the ``except``,
    so it may format the traceback), never a crash.
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} '<{spec_name}>'", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    pin_current_process(spec.get("cpus"))  # pin to the spec's cores before anything heavy is imported
    try:
        result = measure(spec)
    except Exception as error:  # reported as data; one broken measurement must not stop a sweep
        result = on_error(error)
    print(RESULT_MARKER + json.dumps(result, allow_nan=True), flush=True)  # the result line
    return 0


def run_fresh(module: str, spec: dict, *, threads: int, timeout: float, extra_env: dict | None = None) -> dict:
    """Run ``python -m module spec`` in a fresh pinned process and return its result dict.

    The child's environment: the thread knobs for ``threads`` and the variables of the spec's
    ``device`` (`pinning.thread_env`), then ``extra_env``.
    """
    env = thread_env(threads, device=spec.get("device", "cpu"))
    if extra_env:
        env.update(extra_env)
    command = [sys.executable, "-m", module, json.dumps(spec)]
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
        return {
            "status": "timeout",
            "error": f"no result within {timeout:.0f} s (the child was killed)",
            "stderr_tail": stderr[-_STDERR_TAIL:],
        }
    try:
        result = parse_result(completed.stdout)
    except json.JSONDecodeError as error:
        result = {"status": "error", "error": f"unreadable result line: {error}"}
    if result is None:
        stderr = completed.stderr.strip()
        last_line = stderr.splitlines()[-1] if stderr else "(no stderr)"
        return {
            "status": "error",
            "error": f"the child exited with status {completed.returncode} and no result: {last_line}",
            "stderr_tail": stderr[-_STDERR_TAIL:],
        }
    return result
