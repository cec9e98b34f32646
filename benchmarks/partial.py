"""The partial file: every finished visit of a running sweep, one JSON line each.

An interrupted sweep (Ctrl-C, a crash, a closed laptop) keeps every finished visit;
``resume=True`` reloads them (and the shuffle seed) and runs only the rest. Lines are
appended flushed and synced, so a kill loses at most the visit that was running; a torn
last line is ignored when read and ended before the next one is written.

The forward sweep writes ``cell`` and ``gemm`` entries; the decode sweep (`benchmarks.decode_sweep`)
``decode-cell`` and ``bandwidth`` entries under a header of ``"kind": "decode"``, and each refuses
to resume from the other's file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .cell import cell_key
from .plan import gemm_key
from .provenance import machine_differences, machine_key


def default_partial_path(json_path: str | None) -> Path:
    """Where finished cells are kept while the sweep runs: beside the JSON, or in the current folder."""
    if json_path and json_path != "-":
        return Path(f"{json_path}.partial.jsonl")
    return Path("mha-rosetta-bench.partial.jsonl")


def partial_entries(path: Path):
    """Every whole entry of a partial file, in order (`benchmarks.decode` reads its own entry types)."""
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written when the sweep was killed


def load_partial(path: Path) -> tuple[dict[tuple[int, int, str], dict], dict[tuple[int, str], dict]]:
    """(cell visits by (round, visit, cell key), GEMM peaks by (round, peak key)) from a partial file.

    A torn last line is ignored; entries written before rounds existed belong to round 0, those
    written before several visits a round (`rounds.pool_visits`) to visit 0.
    """
    cells: dict[tuple[int, int, str], dict] = {}
    peaks: dict[tuple[int, str], dict] = {}
    for entry in partial_entries(path):
        round_index = entry.get("round", 0)
        if entry.get("type") == "cell":
            cells[(round_index, entry.get("visit", 0), cell_key(entry["record"]))] = entry["record"]
        elif entry.get("type") == "gemm":
            peak = entry["record"]
            peaks[(round_index, gemm_key(peak["device"], peak["dtype"], peak["threads"]))] = peak
    return cells, peaks


def partial_header(path: Path) -> dict | None:
    """The header entry of a partial file (its settings, seed included), or None."""
    return next((entry for entry in partial_entries(path) if entry.get("type") == "header"), None)


def header_fields() -> dict:
    """What every partial file's header records besides its kind and settings: the machine (`machine_key`)."""
    return {"machine": machine_key()}


def check_resume_machine(path: Path, header: dict | None, what: str) -> None:
    """Refuse to resume ``path`` on a machine other than the one that wrote it (the rule of
    `provenance.MACHINE_FIELDS`); ``what`` names what would otherwise come from two machines. A header from
    before the machine was recorded is read by its ``host_id`` alone, and one without either is accepted."""
    if header is None:
        return
    recorded = header.get("machine") or {"host_id": header.get("host_id")}
    differences = machine_differences(recorded, machine_key())
    if differences:
        raise ValueError(
            f"--resume: {path} was written on another machine (the file's against this one's: "
            f"{'; '.join(differences)}); a sweep resumes only where it started: {what} would come from two machines"
        )


def end_torn_line(path: Path) -> None:
    """After a kill mid-write, start the next entry on a line of its own."""
    if path.exists() and path.stat().st_size:
        with path.open("rb+") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")


def append_entry(path: Path, entry: dict) -> None:
    # One line per finished measurement, flushed and synced, so a kill loses at most the
    # cell that was running.
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
