"""The decode table's cache flags (issue 43): the steps whose "% of limit" says nothing about memory.

Two flags, one rule each: a step whose bytes (K, V and the weights) fit the cache as measured (sysfs's figure
for a report from before the measurement), and a step past it that still ran faster than memory can feed it.
"""

from __future__ import annotations

from .decode import row_label


def cache_flag_lines(report: dict) -> list[str]:
    """The table's two cache flags for ``report`` (a decode run), each naming its cells; [] where none applies."""
    cells = [cell for cell in report["cells"] if cell.get("status") == "ok"]
    # Against the cache as measured (sysfs's figure is not what reads see; the Xeon's says 300 MiB while its reads
    # slow from 64-256 MiB); a report from before the measurement flags against sysfs's, as it did.
    measured = any("fits_measured_cache" in cell for cell in report["cells"])
    key, llc_key = ("fits_measured_cache", "measured_llc_bytes") if measured else ("fits_last_level_cache", "llc_bytes")
    lines = []
    cached = [cell for cell in cells if cell.get(key)]
    if cached:
        llc = _bandwidth_figure(report, llc_key)
        lines += [
            "",
            f"(!) The bytes these steps read (K, V and the weights) fit in the last-level cache "
            f"({llc / 2**20:.0f} MiB{', as measured' if measured else ''}): the repeated timed steps may read them "
            f"from the cache, not from memory, so their % of the (memory) limit may pass 100%: {_named(cached)}",
        ]
    # Past the measured cache yet faster than memory: the sweep's knee is where reads slow, not where every byte
    # leaves the cache (the Xeon's sysfs L3 is 300 MiB; B=1 at 32k, 168 MiB, read at 112-126% of its limit), so a
    # cell over 100% is named whatever its size: its figure says nothing about memory.
    faster = [cell for cell in cells if not cell.get(key) and (cell.get("read_limit_fraction") or 0) > 1]
    if faster:
        sysfs = _bandwidth_figure(report, "llc_bytes")
        where = f" (sysfs reports {sysfs / 2**20:.0f} MiB)" if sysfs else ""
        lines += [
            "",
            "(!) These steps read more than the cache as measured, yet ran faster than memory can feed them (over 100% "
            f"of the limit): part of their bytes still came from a cache{where}, so their figure says nothing about "
            f"memory: {_named(faster)}",
        ]
    return lines


def _bandwidth_figure(report: dict, key: str):
    """The first of the run's bandwidth records that has ``key``: its value, or None."""
    return next((record.get(key) for record in report.get("bandwidth", []) if record.get(key)), None)


def _named(cells: list[dict]) -> str:
    """Each cell as the flags name it: the implementation, its row and its context."""
    return ", ".join(f"{cell['implementation']}{row_label(cell)} {cell['context']}" for cell in cells)
