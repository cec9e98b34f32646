"""Check, bench and explain JSON files loaded into one shape: a `Run` with a label.

Design rules:
- Any file the tool wrote loads, old ones included: a file without ``provenance`` is
  labelled by its file name and whatever its ``machine`` block says; bench schemas 1-3
  load (2 keeps ``samples_s`` and adds ``corrected_median_s`` and ``corrected_spread_s``, re-derived at load by
  today's rule, `benchmarks.report.upgrade_report`, as 3 writes them; nothing else is read).
- The kind is told from the content, never from the file name: a check has ``matrices``,
  a bench ``cells``, an explain output ``claims`` (a dict with them, or the claims-only list).
- A file that is none of these is an error naming the file and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BENCH_SCHEMAS = (1, 2, 3)
KINDS = ("check", "bench", "claims")


@dataclass
class Run:
    """One loaded file. ``label``: machine · commit (· device, per bench column) as the report shows it."""

    path: str
    kind: str
    data: dict
    provenance: dict | None
    label: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return Path(self.path).name

    def machine(self) -> str:
        """Host name (from provenance) or the CPU model an old bench file recorded, else the file name."""
        if self.provenance and self.provenance.get("host"):
            return str(self.provenance["host"])
        cpu = (self.data.get("machine") or {}).get("cpu_model")
        return str(cpu) if cpu else self.name

    def commit(self) -> str | None:
        git = (self.provenance or {}).get("git") or {}
        if not git.get("commit"):
            return None
        return git["commit"][:8] + ("+dirty" if git.get("dirty") else "")

    def devices(self) -> list[str]:
        if self.kind == "bench":
            return list(dict.fromkeys(str(cell.get("device", "cpu")) for cell in self.data.get("cells", [])))
        if self.kind == "check":
            return [str(device) for device in (self.data.get("settings") or {}).get("devices", ["cpu"])]
        return []


def _kind(data) -> str | None:
    if isinstance(data, list) and all(isinstance(item, dict) and "claim" in item for item in data):
        return "claims"
    if not isinstance(data, dict):
        return None
    if "matrices" in data:
        return "check"
    if "cells" in data:
        return "bench"
    if "claims" in data:
        return "claims"
    return None


def load_run(path: str | Path) -> Run:
    """One JSON file as a `Run`; ValueError naming the file when it is not a check, bench or explain output."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"report: cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"report: {path} is not JSON ({error.msg} at line {error.lineno})") from None
    kind = _kind(data)
    if kind is None:
        raise ValueError(
            f"report: {path} is not a check, bench or explain JSON (expected 'matrices', 'cells' or 'claims'; "
            f"got {type(data).__name__}{' with keys ' + ', '.join(list(data)[:6]) if isinstance(data, dict) else ''})"
        )
    if kind == "claims" and isinstance(data, list):
        data = {"claims": data}
    if kind == "bench" and data.get("schema") not in BENCH_SCHEMAS:
        raise ValueError(
            f"report: {path}: bench schema {data.get('schema')!r} is not one this version reads ({', '.join(map(str, BENCH_SCHEMAS))})"
        )
    if kind == "bench":
        from mha_rosetta.benchmarks.report import upgrade_report

        data = upgrade_report(data)
    run = Run(str(path), kind, data, data.get("provenance"))
    if run.provenance is None:
        run.notes.append("no provenance (written before it was recorded): labelled by file name")
    return run


def load_runs(paths) -> list[Run]:
    """Every file loaded and labelled; labels are unique (the file name is added where two would match)."""
    runs = [load_run(path) for path in paths]
    for run in runs:
        commit = run.commit()
        if run.provenance is None:
            run.label = f"{run.name} ({run.machine()})" if run.machine() != run.name else run.name
        else:
            run.label = run.machine() + (f" @ {commit}" if commit else "")
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    for run in runs:
        if counts[run.label] > 1 and run.name not in run.label:
            run.label = f"{run.label} [{run.name}]"
    seen: dict[str, int] = {}
    for index, run in enumerate(runs):  # the same file twice: numbered
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{index + 1}"
    return runs
