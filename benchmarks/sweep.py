"""The sweep: implementations × sizes × dtypes × devices, one fresh pinned process per cell.

What it guarantees:

- Every cell runs through `cell.run_cell` (a fresh process, pinned, thread knobs set
  before any import), with the same thread count for every framework, and the same
  allocator rule (``malloc``, see `pinning.malloc_env`) for every cell and GEMM peak.
- Rounds (``rounds``, `benchmarks.rounds`): every cell is visited once per round, in an
  order shuffled afresh each round from one recorded seed, so that a burst of load from
  elsewhere on the machine lands on different cells in different rounds instead of on one
  implementation's whole row. A cell's figure is the median over all its samples, with the
  range of its round medians as its spread; a cell whose round medians differ by more than
  10% is flagged (drift).
- The GEMM peak for each (device, dtype) is measured at the start of every round, under
  the same limits as the cells (`gemm.measure_gemm_peak`; the first round compares every
  installed library, later rounds measure its winner); a cell's ``% of peak`` uses the
  peak of its own round, and a round whose peak is more than 5% below the best other round's
  is flagged (the machine was busy).
- Each finished visit is appended at once to a partial JSONL file. An interrupted sweep
  (Ctrl-C, a crash, a closed laptop) keeps every finished visit; ``resume=True`` reloads
  them (and the shuffle seed) and runs only the rest. Visits that failed (``error``/
  ``timeout``) are run again on resume; measured (``ok``) and ``unsupported`` ones are not.
- A failing cell is recorded with its error and the sweep goes on.

Implementation names: registry backend names (``numpy``, ``torch-sdpa``, ...), optionally
with a strategy (``numpy:slicing``), or the groups ``main`` (every installed backend in
its standard strategy), ``strategies`` (the column/row-sample article's other correct strategies of every
backend that has them, and ``chunked``), ``all`` (both) and ``dist`` (the sharded backends: the cell counts their worker
processes' CPU time but not their memory; run them with ``--threads`` at least their process
count). The direct-reshape strategy is the known
mistake: it is never part of a group, though it can be named explicitly.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mha_rosetta.backends import KNOWN_WRONG_STRATEGIES, REGISTRY, available_backends, get_backend

from .cell import CellSpec, cell_key, cell_record, implementation_label, run_cell, split_implementation
from .flops import mode_flops
from .gemm import DEFAULT_GEMM_SIZE, measure_gemm_peak
from .long import memory_budget_mb, over_budget_reason
from .pinning import DEFAULT_MALLOC_MODE, choose_cpus, malloc_env, require_positive_int
from .rounds import (
    BUSY_THRESHOLD,
    DRIFT_THRESHOLD,
    FINISHED_STATUSES,
    busy_rounds,
    draw_seed,
    merge_peaks,
    merge_visits,
    round_orders,
)
from .timing import RepeatPolicy


@dataclass
class SweepSettings:
    """What to measure and how; the sweep takes the cross product of the size lists."""

    implementations: list[str] = field(default_factory=lambda: ["main"])
    tokens: list[int] = field(default_factory=lambda: [64, 256])
    batch: list[int] = field(default_factory=lambda: [4])
    d_model: list[int] = field(default_factory=lambda: [512])
    heads: list[int] = field(default_factory=lambda: [8])
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    threads: int = 1
    cpus: list[int] | None = None
    policy: dict = field(default_factory=dict)  # timing.RepeatPolicy fields
    gemm_n: int = DEFAULT_GEMM_SIZE
    gemm_policy: dict = field(default_factory=dict)
    cell_timeout: float = 600.0
    preset: str | None = None
    malloc: str = DEFAULT_MALLOC_MODE  # "keep": glibc keeps freed memory (pinning.malloc_env)
    rounds: int = 1  # every cell is visited once per round, in a shuffled order (benchmarks.rounds)
    # A cell whose predicted peak memory exceeds this (MiB) is skipped, not run (benchmarks.long);
    # None: half the available memory, at most 8 GiB.
    memory_budget_mb: float | None = None
    seed: int | None = None  # the shuffle seed; None: drawn when the sweep starts, then recorded
    modes: list[str] = field(default_factory=lambda: ["fwd"])  # flops.MODES: forward, forward+backward

    def __post_init__(self) -> None:
        malloc_env(self.malloc)  # validates the mode
        require_positive_int("rounds", self.rounds)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if not self.modes:
            raise ValueError("modes must name at least one of fwd, fwdbwd")
        for mode in self.modes:
            mode_flops(1, mode)  # validates the name
        RepeatPolicy(**self.policy)  # validate early, in the parent, with a clear message
        RepeatPolicy(**self.gemm_policy)
        for name in ("tokens", "batch", "d_model", "heads"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {values!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def default_devices() -> list[str]:
    """``cpu``, plus ``gpu`` where an NVIDIA driver is present."""
    # Checked without importing a framework: the driver's device nodes.
    return ["cpu", "gpu"] if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0") else ["cpu"]


PRESETS: dict[str, dict] = {
    # Under two minutes on 2 cores: every installed implementation, two small sizes, short budgets, one round.
    "quick": dict(
        implementations=["main"], tokens=[32, 128], batch=[2], d_model=[64], heads=[4], dtypes=["float32"],
        policy=dict(min_time=0.05, min_repeats=5, max_time=0.3, warmup=1),
        gemm_n=1024, gemm_policy=dict(min_time=0.2, min_repeats=5, max_time=0.5, warmup=1), cell_timeout=120.0,
        rounds=1,
    ),
    # Every implementation and strategy, tokens 64 ... 1024 at the reference width, three rounds.
    "default": dict(
        implementations=["all"], tokens=[64, 128, 256, 512, 1024], batch=[4], d_model=[512], heads=[8],
        dtypes=["float32"], policy=dict(min_time=0.3, min_repeats=5, max_time=1.5, warmup=2),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=2), rounds=3,
    ),
    # The reference size, three rounds: the figures the README quotes (its block is generated from them).
    "reference": dict(
        implementations=["all"], tokens=[512], batch=[4], d_model=[512], heads=[8], dtypes=["float32"],
        policy=dict(min_time=1.0, min_repeats=7, max_time=3.0, warmup=3),
        gemm_n=1024, gemm_policy=dict(min_time=1.0, min_repeats=7, max_time=3.0, warmup=2), rounds=3,
    ),
    # Long context (B=1, H=8, D=512): every implementation and strategy from 1k to 16k tokens and the
    # memory-linear ones (chunked, torch SDPA) to 32k; cells predicted over the memory budget are skipped.
    # No warm-up beyond the first call (timed on its own): at these sizes a call takes up to 40 s.
    "long": dict(
        implementations=["all"], tokens=[1024, 2048, 4096, 8192, 16384, 32768], batch=[1], d_model=[512],
        heads=[8], dtypes=["float32"], policy=dict(min_time=0.2, min_repeats=3, max_time=2.0, warmup=0),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=1), rounds=1,
        cell_timeout=1800.0,
    ),
    # One GPU (scripts/gpu-run; pass --devices gpu): the reference size, 4k and 16k tokens, every GPU-capable
    # adapter and the fused references, float32 (TF32 off; MHA_ROSETTA_TF32=1 for on), bfloat16, float16.
    "gpu": dict(
        implementations=["torch", "jax", "einops-torch", "einops-jax", "torch-mha", "torch-sdpa", "jax-dpa"],
        tokens=[512, 4096, 16384], batch=[4], d_model=[512], heads=[8], dtypes=["float32", "bfloat16", "float16"],
        policy=dict(min_time=0.1, min_repeats=5, max_time=0.5, warmup=2),
        gemm_policy=dict(min_time=0.2, min_repeats=5, max_time=1.0, warmup=3), cell_timeout=60.0, rounds=1,
    ),
}  # fmt: skip


def preset_settings(name: str, **overrides) -> SweepSettings:
    """The settings of a named preset, with any field overridden (None values are ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    values = {**PRESETS[name], "devices": default_devices(), "preset": name}
    values.update({key: value for key, value in overrides.items() if value is not None})
    return SweepSettings(**values)


# -- implementations --------------------------------------------------------------------------


def _loaded(name: str):
    """The adapter registered as ``name`` (its module imported, not its framework), or None where it
    does not load: such an adapter shows up as a failing main cell instead."""
    try:
        return get_backend(name)
    except Exception:
        return None


def _is_sharded(name: str) -> bool:
    """A backend that splits the heads over worker processes (``splits_heads``): the cell counts
    their CPU time but not their memory, so it is a group of its own ("dist"), not "main"."""
    return bool(getattr(_loaded(name), "splits_heads", False))


def main_implementations() -> list[str]:
    """Every registered backend whose framework is installed, in its standard strategy (sharded ones apart)."""
    return [name for name in available_backends() if not _is_sharded(name)]


def dist_implementations() -> list[str]:
    """The sharded backends (worker processes), every strategy."""
    return [
        implementation_label(name, strategy)
        for name in available_backends()
        if _is_sharded(name)
        for strategy in get_backend(name).strategies
    ]


def strategy_implementations() -> list[str]:
    """The article's other correct strategies (per-head matrices, slicing) of every installed backend."""
    return [
        implementation_label(name, strategy)
        for name in available_backends()
        if not _is_sharded(name)
        for strategy in getattr(_loaded(name), "strategies", ())
        if strategy != "standard" and strategy not in KNOWN_WRONG_STRATEGIES
    ]


# The groups an implementation list may name, each expanded from the registry when the sweep is planned.
GROUPS = {
    "main": main_implementations,
    "strategies": strategy_implementations,
    "all": lambda: main_implementations() + strategy_implementations(),
    "dist": dist_implementations,
}


def resolve_implementations(names: list[str]) -> list[str]:
    """Expand the groups and validate explicit names; order kept, duplicates dropped."""
    resolved: list[str] = []
    for name in names:
        if name in GROUPS:
            expanded = GROUPS[name]()
        else:
            backend, _strategy = split_implementation(name)
            if backend not in REGISTRY:
                raise ValueError(
                    f"unknown implementation {name!r}: the backend must be one of {', '.join(REGISTRY)} "
                    f"(optionally ':strategy'), or a group: {', '.join(GROUPS)}"
                )
            expanded = [name]
        resolved += [label for label in expanded if label not in resolved]
    return resolved


# -- the plan ---------------------------------------------------------------------------------


def expand_cells(settings: SweepSettings, implementations: list[str] | None = None) -> list[CellSpec]:
    """Every cell of the sweep in plan order, size-major (each round visits them shuffled)."""
    labels = resolve_implementations(settings.implementations) if implementations is None else implementations
    cpus = choose_cpus(settings.threads, settings.cpus)
    return [
        CellSpec(
            implementation=label, device=device, dtype=dtype, batch=batch, tokens=tokens, d_model=d_model,
            heads=heads, threads=settings.threads, cpus=cpus, policy=dict(settings.policy), malloc=settings.malloc,
            mode=mode,
        )
        # itertools.product varies its last list fastest: the cells of one size stand together.
        for device, dtype, d_model, heads, batch, tokens, label, mode in itertools.product(
            settings.devices, settings.dtypes, settings.d_model, settings.heads, settings.batch, settings.tokens,
            labels, settings.modes,
        )
    ]  # fmt: skip


def gemm_groups(cells: list[CellSpec]) -> list[tuple[str, str]]:
    """The (device, dtype) pairs that need a GEMM peak, in first-use order."""
    return list(dict.fromkeys((cell.device, cell.dtype) for cell in cells))


def gemm_key(device: str, dtype: str, threads: int) -> str:
    return f"{device}/{dtype}/{threads}"


# -- the partial file -------------------------------------------------------------------------


def default_partial_path(json_path: str | None) -> Path:
    """Where finished cells are kept while the sweep runs: beside the JSON, or in the current folder."""
    if json_path and json_path != "-":
        return Path(f"{json_path}.partial.jsonl")
    return Path("mha-rosetta-bench.partial.jsonl")


def _partial_entries(path: Path):
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written when the sweep was killed


def load_partial(path: Path) -> tuple[dict[tuple[int, str], dict], dict[tuple[int, str], dict]]:
    """(cell visits by (round, cell key), GEMM peaks by (round, peak key)) from a partial file.

    A torn last line is ignored; entries written before rounds existed belong to round 0.
    """
    cells: dict[tuple[int, str], dict] = {}
    peaks: dict[tuple[int, str], dict] = {}
    for entry in _partial_entries(path):
        round_index = entry.get("round", 0)
        if entry.get("type") == "cell":
            cells[(round_index, cell_key(entry["record"]))] = entry["record"]
        elif entry.get("type") == "gemm":
            peak = entry["record"]
            peaks[(round_index, gemm_key(peak["device"], peak["dtype"], peak["threads"]))] = peak
    return cells, peaks


def partial_header(path: Path) -> dict | None:
    """The header entry of a partial file (its settings, seed included), or None."""
    return next((entry for entry in _partial_entries(path) if entry.get("type") == "header"), None)


def _end_torn_line(path: Path) -> None:
    """After a kill mid-write, start the next entry on a line of its own."""
    if path.exists() and path.stat().st_size:
        with path.open("rb+") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")


def _append(path: Path, entry: dict) -> None:
    # One line per finished measurement, flushed and synced, so a kill loses at most the
    # cell that was running.
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


# -- the time it will take --------------------------------------------------------------------

# Seconds a fresh child spends before it times anything (interpreter start, framework import,
# client start), roughly as measured on the project's 2-core machine; the slowest framework a
# backend needs counts. Only for the estimate printed before a sweep starts.
STARTUP_S = {"numpy": 0.5, "einops": 0.5, "jax": 1.5, "flax": 2.0, "equinox": 2.0, "torch": 2.5}


def _startup_s(label: str) -> float:
    entry = REGISTRY.get(split_implementation(label)[0])
    return max((STARTUP_S.get(module, 0.5) for module in (entry.requires if entry else ())), default=0.5)


def _timed_s(policy: dict) -> float:
    # The timed region runs at least min_time, more while the spread is high (up to max_time),
    # after a warm-up and a first call: twice min_time plus 0.2 s matched the committed one-round
    # default and reference runs (0.8 and 1.6 s timed per cell at min_time 0.3 and 1.0).
    return 2.0 * RepeatPolicy(**policy).min_time + 0.2


def estimate_seconds(settings: SweepSettings, cells: list[CellSpec]) -> dict:
    """The sweep's expected duration: cells x rounds x seconds per visit, plus the GEMM peaks.

    The first round measures the peak with every installed library, later rounds with the
    winner only. An estimate from the repeat policy and `STARTUP_S`, not a measurement.
    """
    from .gemm import installed_gemm_libraries

    per_visit = [_startup_s(cell.implementation) + _timed_s(cell.policy) for cell in cells]
    per_cell = sum(per_visit) / len(per_visit) if per_visit else 0.0
    groups = len(gemm_groups(cells))
    peak_s = max(STARTUP_S.values()) / 2 + _timed_s(settings.gemm_policy)  # one library's peak, roughly
    libraries = max(len(installed_gemm_libraries()), 1)
    gemm_s = groups * peak_s * (libraries + (settings.rounds - 1))
    total = sum(per_visit) * settings.rounds + gemm_s
    return {"cells": len(cells), "rounds": settings.rounds, "per_cell_s": per_cell, "gemm_s": gemm_s, "total_s": total}


def describe_estimate(estimate: dict) -> str:
    """One line for the terminal: ``16 cells x 3 rounds x ~4.1 s + GEMM peaks ~20 s: about 3.6 min``."""
    total = estimate["total_s"]
    when = f"{total / 60:.1f} min" if total >= 90 else f"{total:.0f} s"
    return (
        f"{estimate['cells']} cells x {estimate['rounds']} round(s) x ~{estimate['per_cell_s']:.1f} s "
        f"+ GEMM peaks ~{estimate['gemm_s']:.0f} s: about {when} (estimated from the repeat policy "
        "and typical start-up times)"
    )


# -- progress ---------------------------------------------------------------------------------


class Progress:
    """Rounds and the visits of the current round: rich bars on stderr where rich is installed,
    else one plain line per step."""

    def __init__(self, rounds: int, visits: int, enabled: bool = True) -> None:
        self.rounds, self.visits, self.enabled = rounds, visits, enabled
        self.round, self.done = 0, 0
        self._rich = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )  # fmt: skip
            self._rich.start()
            self._rounds_task = self._rich.add_task("rounds", total=rounds)
            self._task = self._rich.add_task("round 1", total=visits)
        except ImportError:
            self._rich = None

    def start_round(self, index: int) -> None:
        self.round, self.done = index, 0
        if self._rich is not None:
            self._rich.reset(self._task, total=self.visits, description=f"round {index + 1}/{self.rounds}")

    def end_round(self) -> None:
        if self._rich is not None:
            self._rich.update(self._rounds_task, advance=1)

    def step(self, description: str) -> None:
        if self._rich is not None:
            self._rich.update(self._task, description=f"round {self.round + 1}/{self.rounds}: {description}")

    def advance(self, message: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1)
            self._rich.console.print(message, highlight=False, soft_wrap=True)
        else:
            where = f"[round {self.round + 1}/{self.rounds}, {self.done}/{self.visits}]"
            print(f"{where} {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


def describe_result(record: dict) -> str:
    """One progress line for a finished cell."""
    where = f"{record['implementation']} {record['device']} {record['dtype']} B={record['batch']} N={record['tokens']} D={record['d_model']} H={record['heads']}"
    if record.get("status") == "ok":
        warn = " (!) " + record["warnings"][0] if record.get("warnings") else ""
        util_text = f", {record['cpu_util']:.2f} cores" if record.get("cpu_util") is not None else ""
        return f"{where}: {record['median_s'] * 1e3:.3f} ms{util_text}{warn}"
    return f"{where}: {record.get('status')} ({record.get('error', '')})"


# -- the sweep --------------------------------------------------------------------------------

CellRunner = Callable[[CellSpec, float], dict]
GemmRunner = Callable[..., dict]


@dataclass
class SweepOutcome:
    """What a sweep produced: the cells and GEMM peaks in plan order (merged over rounds), the
    rounds themselves, and whether it finished."""

    settings: SweepSettings
    cells: list[dict]
    gemm_peaks: list[dict]
    interrupted: bool = False
    resumed_cells: int = 0
    rounds: dict = field(default_factory=dict)  # see `rounds_record`

    @property
    def failed(self) -> list[dict]:
        return [cell for cell in self.cells if cell.get("status") not in FINISHED_STATUSES]


def rounds_record(settings: SweepSettings, cells: list[CellSpec], orders, peaks_by_round, wall_s) -> dict:
    """The report's ``rounds`` entry: the seed, each round's visit order (cell labels), its
    GEMM peaks and wall time, and the rounds flagged busy."""
    keys = [gemm_key(device, dtype, settings.threads) for device, dtype in gemm_groups(cells)]
    round_peaks = {
        key.rsplit("/", 1)[0]: [peaks_by_round.get((index, key), {}).get("gflops") for index in range(len(orders))]
        for key in keys
    }
    busy = sorted({index for values in round_peaks.values() for index in busy_rounds(values)})
    return {
        "count": settings.rounds,
        "seed": settings.seed,
        "orders": [[f"{cells[i].implementation} N={cells[i].tokens}" for i in order] for order in orders],
        "gemm_peaks_gflops": round_peaks,
        "busy_rounds": busy,
        "busy_threshold": BUSY_THRESHOLD,
        "drift_threshold": DRIFT_THRESHOLD,
        "wall_s": wall_s,
    }


def run_sweep(
    settings: SweepSettings,
    *,
    partial_path: Path,
    resume: bool = False,
    progress: bool = True,
    cell_runner: CellRunner = run_cell,
    gemm_runner: GemmRunner = measure_gemm_peak,
    implementations: list[str] | None = None,
) -> SweepOutcome:
    """Run (or resume) the sweep; every finished visit is in ``partial_path`` as soon as it ends.

    ``settings.rounds`` rounds; each measures the GEMM peaks, then visits every cell once in
    its own shuffled order (`rounds.round_orders`, from ``settings.seed``; drawn and recorded
    when None, or taken from the partial file's header on resume). A cell found unsupported
    is not visited again. Ctrl-C stops the sweep between or during visits: the outcome then
    holds what finished and ``interrupted=True`` (the caller writes what it has and exits 130).
    """
    cells = expand_cells(settings, implementations)
    groups = gemm_groups(cells)
    partial_path = Path(partial_path)
    done_cells, done_peaks = load_partial(partial_path) if resume else ({}, {})
    if settings.seed is None:
        header = partial_header(partial_path) if resume else None
        seed = (header or {}).get("settings", {}).get("seed")
        settings = replace(settings, seed=seed if isinstance(seed, int) else draw_seed())
    if resume:
        _end_torn_line(partial_path)
    else:
        partial_path.unlink(missing_ok=True)  # a fresh sweep: earlier partial results are not this run's
    partial_path.parent.mkdir(parents=True, exist_ok=True)
    if not partial_path.exists():
        _append(partial_path, {"type": "header", "schema": 1, "settings": settings.as_dict()})

    budget = memory_budget_mb(settings.memory_budget_mb)
    orders = round_orders(len(cells), settings.rounds, settings.seed)
    bar = Progress(settings.rounds, len(groups) + len(cells), enabled=progress)
    visits: list[list[dict | None]] = [[None] * settings.rounds for _ in cells]
    peaks_by_round: dict[tuple[int, str], dict] = {}
    wall_s: list[float] = []
    resumed = 0
    interrupted = False
    try:
        for round_index, order in enumerate(orders):
            bar.start_round(round_index)
            round_start = time.perf_counter()
            for device, dtype in groups:
                key = gemm_key(device, dtype, settings.threads)
                peak = done_peaks.get((round_index, key))
                if peak is None or peak.get("gflops") is None or peak.get("malloc", settings.malloc) != settings.malloc:
                    bar.step(f"GEMM peak {device} {dtype}")
                    # Later rounds measure the first round's winner only: the same yardstick, cheaper.
                    first = peaks_by_round.get((0, key), {})
                    libraries = [first["library"]] if round_index and first.get("library") else None
                    peak = gemm_runner(
                        dtype, device, settings.threads, cells[0].cpus, n=settings.gemm_n,
                        policy=dict(settings.gemm_policy), malloc=settings.malloc, libraries=libraries,
                    )  # fmt: skip
                    _append(partial_path, {"type": "gemm", "round": round_index, "record": peak})
                peaks_by_round[(round_index, key)] = peak
                gflops = peak.get("gflops")
                shown = f"{gflops:.1f} GFLOP/s ({peak.get('library')})" if gflops else "not measurable"
                bar.advance(f"GEMM peak {device} {dtype} n={peak.get('n')}: {shown}")
            for index in order:
                spec = cells[index]
                earlier = [visit for visit in visits[index][:round_index] if visit is not None]
                if any(visit.get("status") == "unsupported" for visit in earlier):
                    bar.advance(describe_result(earlier[0]) + " [not run again]")
                    continue
                previous = done_cells.get((round_index, spec.key()))
                if previous is not None and previous.get("status") in FINISHED_STATUSES:
                    visits[index][round_index] = previous
                    resumed += 1
                    bar.advance(describe_result(previous) + " [resumed]")
                    continue
                bar.step(f"{spec.implementation} N={spec.tokens}")
                started = time.perf_counter()
                # Over the (host) memory budget: recorded with the prediction as the reason, never run into swap.
                skip = spec.device == "cpu" and over_budget_reason(
                    spec.implementation, spec.batch, spec.tokens, spec.d_model, spec.heads, spec.dtype, budget
                )
                record = cell_record(spec, {"status": "unsupported", "error": skip}) if skip else None
                record = record or cell_runner(spec, settings.cell_timeout)
                record["visit_wall_s"] = time.perf_counter() - started
                _append(partial_path, {"type": "cell", "round": round_index, "record": record})
                visits[index][round_index] = record
                bar.advance(describe_result(record))
            wall_s.append(time.perf_counter() - round_start)
            bar.end_round()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    merged_cells = [cell for cell in (merge_visits(row) for row in visits) if cell is not None]
    keys = [gemm_key(device, dtype, settings.threads) for device, dtype in groups]
    merged = (merge_peaks([peaks_by_round.get((index, key)) for index in range(settings.rounds)]) for key in keys)
    merged_peaks = [peak for peak in merged if peak is not None]
    return SweepOutcome(
        settings=settings, cells=merged_cells, gemm_peaks=merged_peaks, interrupted=interrupted,
        resumed_cells=resumed, rounds=rounds_record(settings, cells, orders, peaks_by_round, wall_s),
    )  # fmt: skip
