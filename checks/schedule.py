"""The check pool's schedule: how long a backend's runs are expected to take (from the registry, or as
last measured on this machine), and which worker imports which library at the start (`checks.pool`
re-exports these)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mha_rosetta.backends import REGISTRY
from mha_rosetta.backends.frameworks import startup_s

from . import worker as worker_module

# Seconds per run before this machine has measured any (`load_history`), from what the registry says
# of a backend: one that requires JAX compiles each program, one with processes of its own
# (`Backend.own_processes`: the sharded ones) starts and drives them. From `check --timings` (the
# default check, cold cache, 2 workers, on a 2-core machine under a load of about 8, 2026-12-01): the
# backends that require JAX took 0.2 to 1.5 s a run (jax 82 s over 54 runs, jax-sharded 60 s / 54,
# einops-jax 29 s / 27, equinox 23 s / 27, jax-dpa 11 s / 27, flax 6 s / 27), torch-tp 18 s / 54
# (0.33 s a run against eager torch's 0.03: its process group). Only the ratios matter: they order
# the dispatch, they never limit a run.
JAX_RUN_SECONDS = 0.5  # a backend that requires JAX: it compiles each program
PROCESS_RUN_SECONDS = 0.3  # added for a backend with processes of its own
OTHER_RUN_SECONDS = 0.03  # NumPy and eager torch: about 0.02-0.13 s per run in the same measurement


HISTORY_FILE = "run-seconds.json"  # in the cache folder (`worker.cache_root`): seconds per run, last measured


def estimated_seconds(
    requires: tuple[str, ...], runs: int, measured: float | None = None, own_processes: bool = False
) -> float:
    """The scheduler's estimate of ``runs`` runs of a backend: ``measured`` seconds per run (what the last
    check on this machine took, `load_history`) where there is one, else what its registry entry's
    ``requires`` and its ``own_processes`` say (`JAX_RUN_SECONDS`, `PROCESS_RUN_SECONDS`, `OTHER_RUN_SECONDS`)."""
    # A per-framework branch kept here on purpose (one of the few outside backends/): it only orders
    # the dispatch of a backend not yet measured here, from the one fact that matters for that, JAX compiles.
    per_run = (JAX_RUN_SECONDS if "jax" in requires else OTHER_RUN_SECONDS) + (
        PROCESS_RUN_SECONDS if own_processes else 0
    )
    return (per_run if measured is None else measured) * runs


def history_path() -> Path:
    return worker_module.cache_root() / HISTORY_FILE


def load_history() -> dict[str, float]:
    """Seconds per run by ``"<job>|<backend>"``, as the last checks measured them here; {} if none or unreadable.

    `JAX_RUN_SECONDS` was measured with an empty cache, where JAX's compiling is nearly all of the work;
    with the executable cache warm, torch-tp's process group is the longest instead (0.13 s per run
    against jax's 0.02, the issue's 675-run selection, 2026-12-02), and a schedule from the cold
    figures started it last. So the pool orders by what the backends took last time on this machine.
    """
    try:
        data = json.loads(history_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float)) and v >= 0}


def save_history(measured: dict[str, list[float]]) -> None:
    """Merge ``measured`` (``"<job>|<backend>"`` -> [seconds, runs]) into the history file, written whole."""
    if not measured:
        return
    history = load_history()
    history.update({key: seconds / runs for key, (seconds, runs) in measured.items() if runs})
    path = history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(history, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError:  # a read-only cache folder: the next check schedules from the registry (`estimated_seconds`)
        pass


def history_key(task) -> str:
    return f"{type(task.job).__name__}|{task.backend}"


def deal_imports(tops: list[str], jobs: int) -> list[list[str]]:
    """The top-level libraries ``tops`` dealt out to at most ``jobs`` workers, for the probe to import side by side.

    A library that only ever runs on one framework (every registered backend that requires flax requires
    JAX too; transformers, torch) goes to the worker that imports that framework, since importing it imports
    the framework anyway. The groups then go, the longest first (`startup_s`), to the least loaded worker.
    Dealt in turn instead, the default check had both workers import both torch and JAX: its probe took
    3.1 s, and 1.8 s dealt this way (the issue's 675-run selection, warm, 2 workers, 2026-12-02).
    """
    from mha_rosetta.backends.frameworks import FRAMEWORKS

    def anchor(top: str) -> str:
        if top in FRAMEWORKS:
            return top
        alongside = [(set(e.requires) & set(FRAMEWORKS)) - {top} for e in REGISTRY.values() if top in e.requires]
        common = set.intersection(*alongside) if alongside else set()
        return next(iter(common)) if len(common) == 1 else top

    groups: dict[str, list[str]] = {}
    for top in tops:
        groups.setdefault(anchor(top), []).append(top)

    def cost(item: tuple[str, list[str]]) -> float:
        base, members = item
        return sum(startup_s(m) for m in members) + (0.0 if base in members else startup_s(base))

    shares: list[list[str]] = [[] for _ in range(max(1, min(jobs, len(groups))))]
    loads = [0.0] * len(shares)
    for item in sorted(groups.items(), key=cost, reverse=True):
        least = loads.index(min(loads))
        shares[least].extend(item[1])
        loads[least] += cost(item)
    return [share for share in shares if share]
