"""How an exception is quoted in a report (one line, the same everywhere), and the exit status of an
interrupted command."""

from __future__ import annotations


def error_line(error: BaseException) -> str:
    """``"TypeError: first line of the message"`` (just the type when the message is empty)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


INTERRUPTED = 130  # what a shell reports for a process ended by Ctrl-C (128 + SIGINT)


def exit_code(status: int, interrupted: bool) -> int:
    """A command's exit status: `INTERRUPTED` when Ctrl-C cut it short (what finished is kept), else ``status``."""
    return INTERRUPTED if interrupted else status
