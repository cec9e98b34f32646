"""Where a result came from: one function, `provenance()`, called by every JSON writer, and the CPU's model.

It sits in `benchmarks`, below `report` (which reads results) and beside the writers (check, bench,
explain, diagnose), so that every one of them may import it without a cycle.

Design rules:
- Standard library only, and no framework is imported: library versions are read from the
  installed packages' metadata (`importlib.metadata`), so writing provenance never changes
  what a timed or checked process has loaded.
- Every probe that can fail (git, /proc, /etc/machine-id) leaves its field out or null
  instead of raising: provenance describes a result, it must never stop one being written.
- git is asked with a short timeout, and only when the tool runs from a checkout.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

PROVENANCE_VERSION = 1
GIT_TIMEOUT_S = 2.0
# The package's source root: the folder holding core/, report/ ... (a checkout, or site-packages).
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):  # git missing, or too slow
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(root: Path | str = SOURCE_ROOT) -> dict | None:
    """``{"commit", "dirty", "branch"}`` of the checkout at ``root``; None when it is not one or git is missing.

    ``dirty`` is true when a tracked file is modified or an untracked file that git does not
    ignore exists (``git status --porcelain``); ignored files (build outputs, venvs) never count.
    """
    root = Path(root)
    top = _git(["rev-parse", "--show-toplevel"], root)
    if top is None or Path(top).resolve() != root.resolve():
        return None  # not a checkout, or the package sits inside someone else's repository
    commit = _git(["rev-parse", "HEAD"], root)
    if commit is None:
        return None  # a repository without a commit yet
    status = _git(["status", "--porcelain", "--untracked-files=normal"], root)
    branch = _git(["rev-parse", "--abbrev-ref", "HEAD"], root)
    return {"commit": commit, "dirty": None if status is None else bool(status), "branch": branch}


def host_id() -> str:
    """A stable id of this machine: a short hash of /etc/machine-id (else of the host name).

    Hashed so that the file's content, which some systems treat as confidential, is not written out.
    """
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text:
            return hashlib.sha256(("mha-rosetta:" + text).encode()).hexdigest()[:16]
    return hashlib.sha256(("mha-rosetta:" + socket.gethostname()).encode()).hexdigest()[:16]


# What tells two machines apart, for every rule that asks "the same machine?" (a sweep's --resume, the README's
# tables, a baseline comparison). The host id alone is not enough: cloned images share /etc/machine-id, and the
# Intel Xeon and the AMD EPYC this project was measured on both hash to 9d136d53bb9ca941 (checked 2026-12-06).
MACHINE_FIELDS = ("host_id", "cpu_model", "cores")


def machine_key() -> dict:
    """This machine as `MACHINE_FIELDS` tell it apart: its host id, CPU model and core count."""
    return {"host_id": host_id(), "cpu_model": cpu_model(), "cores": os.cpu_count()}


def report_machine_key(report: dict) -> dict:
    """A bench report's machine (its ``machine`` block and its ``provenance``) as `MACHINE_FIELDS` tell it apart;
    a field the report does not hold is None."""
    machine = report.get("machine") or {}
    prov = report.get("provenance") or {}
    return {
        "host_id": prov.get("host_id"),
        "cpu_model": machine.get("cpu_model") or prov.get("cpu_model"),
        "cores": machine.get("cores") or prov.get("cpu_count"),
    }


def machine_differences(first: dict, second: dict) -> list[str]:
    """Where two machine keys differ, one phrase a field (``"cpu_model 'A' against 'B'"``); empty for the same
    machine. A field missing (None) on either side is not compared: a file from before the field was written."""
    return [
        f"{name} {first[name]!r} against {second[name]!r}"
        for name in MACHINE_FIELDS
        if first.get(name) is not None and second.get(name) is not None and first[name] != second[name]
    ]


INTERESTING_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "neon", "sve")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and its vector-unit flags (`INTERESTING_CPU_FLAGS`), from /proc/cpuinfo where it
    exists (the first processor's), else what `platform` says and no flags."""
    model, flags = None, []
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Model") and value.strip() and model is None:
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            present = set(value.split())
            flags = [flag for flag in INTERESTING_CPU_FLAGS if flag in present]
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` says."""
    return cpu_model_and_flags()[0]


def allowed_cores() -> int | None:
    """How many cores this process may run on (its affinity), where the OS says."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def package_versions() -> dict[str, str]:
    """Installed version of each package the registry names (`backends.versions.library_versions`: this
    project, every module a registered backend requires, the supporting libraries; metadata only, nothing
    imported); absent ones left out, and none at all where the registry cannot be read."""
    try:
        from mha_rosetta.backends.versions import library_versions

        return library_versions()
    except Exception:  # provenance must not fail because the registry could not be read
        return {}


def tool_version() -> str:
    try:
        return importlib.metadata.version("mha-rosetta")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"  # run from sources that were never installed


# The checkout's state when the command started (`remember_start`): the code it runs. A sweep can run
# for an hour and write its JSON at the end; a commit made meanwhile is not the code that measured.
_START: dict = {}


def _now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def remember_start() -> None:
    """Record the git state and the time now, as a command starts (`cli.main` calls it for each command):
    every later `provenance()` of this process reports them, not the state when its JSON is written."""
    _START.update(git=git_state(), started_utc=_now_utc())


def forget_start() -> None:
    """The command has ended (`cli.main`): later `provenance()` calls read the checkout again."""
    _START.clear()


def provenance(argv: list[str] | None = None) -> dict:
    """Everything a reader needs to know where a JSON result came from (schema `PROVENANCE_VERSION`).

    ``argv``: the command line (default: ``sys.argv``). ``git`` is null outside a checkout; after
    `remember_start` it is the state when the command started, and ``started_utc`` says when.
    """
    started = {"started_utc": _START["started_utc"]} if _START else {}
    return {
        "provenance_version": PROVENANCE_VERSION,
        "tool": "mha-rosetta",
        "tool_version": tool_version(),
        "git": _START["git"] if _START else git_state(),
        **started,
        "created_utc": _now_utc(),
        "host": socket.gethostname(),
        "host_id": host_id(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "allowed_cores": allowed_cores(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "libraries": package_versions(),
        "command": list(sys.argv if argv is None else argv),
    }
