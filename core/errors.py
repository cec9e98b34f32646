"""How an exception is quoted in a report: one line, the same everywhere."""

from __future__ import annotations


def error_line(error: BaseException) -> str:
    """``"TypeError: first line of the message"`` (just the type when the message is empty)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
