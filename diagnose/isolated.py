"""Diagnosing a candidate named by import path in a child process, so that a crash or a hang cannot take
`diagnose` down with it.

Why a process. A candidate given as ``pkg.mod:name`` (what ``mha-rosetta diagnose`` gets) may end its
process (a native extension fault, a CUDA abort, ``os._exit``) or hang in native code that holds the GIL,
which no thread can interrupt. `diagnose_import_path` starts a child that imports the candidate and runs
`diagnosis.diagnose` there, announcing each call of the candidate on a pipe. The parent waits on that pipe
only: it runs no thread, so it always exits. It allows each call the per-probe time limit (plus
`GRACE_S`; the child's own thread limit normally fires first, with the same message as in process), kills
the child when a call overruns it, and turns a child that died into a `DiagnoseError` naming its exit
status or signal and the probe it was running.

Started with ``spawn``, never ``fork``: a forked child inherits the locks of the parent's threads (torch's
and JAX's thread pools, OpenBLAS) in whatever state they were, and can deadlock in its first matmul;
spawn starts a fresh interpreter. A callable passed to `diagnose` directly stays in the caller's process
(it may be a closure over a module, which cannot be pickled).
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import signal

from mha_rosetta.core import MHAConfig

from .diagnosis import DiagnoseError, Diagnosis, diagnose

START_TIMEOUT_S = 120.0  # starting the child and importing the candidate's module (torch, JAX: seconds)
GRACE_S = 2.0  # beyond the per-probe limit, for the child's own thread limit to report first


def resolve_object(path: str):
    """``"pkg.mod:name"`` (``name`` may be dotted) -> the object, with errors that name the path."""
    from mha_rosetta.backends.registry import parse_target

    module_name, attr = parse_target(path)
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(f"cannot import {path}: {error}") from error
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"cannot import {path}: {obj.__name__ if hasattr(obj, '__name__') else obj!r} has no attribute {part!r}"
            )
        obj = getattr(obj, part)
    return obj


def resolve_callable(path: str):
    """``"pkg.mod:name"`` -> the callable, with errors that name the path."""
    obj = resolve_object(path)
    if not callable(obj):
        raise ValueError(
            f"{path} is a {type(obj).__name__}, not callable as (params, query, key, value, mask) -> output"
        )
    return obj


def resolve_like(path: str):
    """``--like pkg.mod:name`` -> the reference module: the object itself, or what a plain function (a
    factory taking no arguments, ``make_module()``) returns. Its configuration is `models.from_module`'s."""
    obj = resolve_object(path)
    if inspect.isfunction(obj):
        try:
            obj = obj()
        except TypeError as error:
            raise ValueError(f"--like {path}: a function must build the module with no arguments: {error}") from error
    return obj


def _child(
    path: str, cfg: MHAConfig | None, dtype: str, timeout: float, conn, decode: dict | None = None, ragged=None
) -> None:
    """The child's work: import the candidate, diagnose it, send ("result", Diagnosis) or ("error", kind, text).

    ``decode``: None for `diagnose`; ``{"prefill": ..., "step": ...}`` for `decode.diagnose_decode`.
    ``ragged``: a form of `ragged.RAGGED_FORMS` for `ragged.diagnose_ragged` (``cfg`` None for ``paged``).
    """
    try:
        candidate = resolve_callable(path)

        def announce(*event):
            conn.send(event)

        if ragged is not None:
            from .ragged import diagnose_ragged

            result = diagnose_ragged(ragged, candidate, cfg, dtype=dtype, timeout=timeout, announce=announce)
        elif decode is None:
            result = diagnose(candidate, cfg, dtype=dtype, timeout=timeout, announce=announce)
        else:
            from .decode import diagnose_decode

            result = diagnose_decode(candidate, cfg, dtype=dtype, timeout=timeout, announce=announce, **decode)
        conn.send(("result", result))
    except (DiagnoseError, ValueError, TypeError) as error:
        conn.send(("error", type(error).__name__, str(error)))
    except BaseException as error:  # anything else the candidate's import raised (SyntaxError, SystemExit...)
        conn.send(("error", "DiagnoseError", f"importing {path} raised {type(error).__name__}: {error}"))
    finally:
        conn.close()


def _death(exitcode: int | None, path: str, probe: str | None) -> str:
    """Why the child ended without a result, in words: its exit status or signal, and what it was doing."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by signal {signal.Signals(-exitcode).name} ({-exitcode})"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    doing = f"on probe {probe!r}" if probe else f"while importing {path}"
    return f"the candidate's process {how} {doing}, without a result (a crash in the candidate)"


def diagnose_import_path(
    path: str,
    cfg: MHAConfig | None,
    *,
    dtype: str = "float64",
    timeout: float,
    start_timeout: float = START_TIMEOUT_S,
    decode: dict | None = None,
    ragged: str | None = None,
) -> Diagnosis:
    """`diagnose` of the callable at ``path`` (``"pkg.mod:name"``), run in a spawned child process.

    ``decode={"prefill": ..., "step": ...}`` (each an int or None): `decode.diagnose_decode` instead, the
    callable being a decode loop ``(params, x, prefill, step, mask, positions) -> output``. ``ragged="packed"``,
    ``"padded"`` or ``"paged"``: `ragged.diagnose_ragged` of that form instead (``cfg`` None for ``paged``).

    Raises `DiagnoseError` when the candidate cannot be diagnosed, as `diagnose` does, and also when
    its process dies (naming the exit status or signal and the probe) or a call overruns ``timeout``
    (the child is killed); ``ValueError`` when ``path`` does not resolve to a callable.
    """
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    context = multiprocessing.get_context("spawn")  # never fork: see the module docstring
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_child, args=(path, cfg, dtype, timeout, sender, decode, ragged), name=f"diagnose {path}"
    )
    child.daemon = True  # never outlives this process, whatever happens below
    child.start()
    sender.close()  # the child holds the only write end: its death reads as EOF here
    probe, limit = None, start_timeout  # limit None: the child computes (no candidate call), wait for it
    try:
        while True:
            if not receiver.poll(limit):
                if probe is None:
                    raise DiagnoseError(f"the candidate {path} did not start within {start_timeout:g} s (importing it)")
                raise DiagnoseError(
                    f"the candidate did not return within {timeout:g} s on probe {probe!r} (time limit per probe; "
                    "its process was stopped)"
                )
            try:
                message = receiver.recv()
            except EOFError:
                child.join(5)
                raise DiagnoseError(_death(child.exitcode, path, probe)) from None
            if message[0] == "call":
                probe, limit = message[1], timeout + GRACE_S
            elif message[0] == "done":
                limit = None
            elif message[0] == "result":
                return message[1]
            else:
                _, kind, text = message
                raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, DiagnoseError)(text)
    finally:
        receiver.close()
        child.join(5)  # a child that sent its answer exits on its own
        if child.is_alive():
            child.kill()  # a hung candidate, or an abandoned thread that will not let it exit
            child.join(5)
