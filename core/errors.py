"""How an exception is quoted in a report (one line, the same everywhere); an interrupted command's exit status."""

from __future__ import annotations


def error_line(error: BaseException) -> str:
    """``"TypeError: first line of the message"`` (just the type when the message is empty)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


INTERRUPTED = 130  # what a shell reports for a process ended by Ctrl-C (128 + SIGINT)


def exit_code(status: int, interrupted: bool) -> int:  # what finished is kept and reported either way
    return INTERRUPTED if interrupted else status
