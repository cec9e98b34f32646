"""Atomic file output shared by every command (check, bench, explain).

A result file is either the old one or the whole new one, never half written: an
interrupted run (Ctrl-C, a crash) leaves finished results intact.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` so that ``path`` holds either the old or the whole new content, never half.

    The one atomic writer of the project: the check's JSON, the benchmark report and the
    explainer's documents all go through it (a temporary file in the same folder, then
    `os.replace`; folders created as needed; the file gets the usual umask mode).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(temporary, 0o666 & ~_current_umask())  # mkstemp makes 0600; give the usual mode
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_output(target: str | Path, text: str) -> None:
    """``text`` to stdout for the target "-", else to the file ``target`` atomically."""
    if str(target) == "-":
        sys.stdout.write(text)
    else:
        write_text_atomic(target, text)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
