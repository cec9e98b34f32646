"""The sweep: implementations × sizes × dtypes × devices, one fresh pinned process per cell.

What it guarantees:

- Every cell runs through `cell.run_cell` (a fresh process, pinned, thread knobs set
  before any import), with the same thread count for every framework, and the same
  allocator rule (``malloc``, see `pinning.malloc_env`) for every cell and GEMM peak.
- The GEMM peak for each (device, dtype) is measured first and again after the cells, in
  the same run, under the same limits (`gemm.measure_gemm_peak`); the better of the two
  counts, so that a peak taken while the machine was busy does not flatter the cells.
- Each finished cell is appended at once to a partial JSONL file. An interrupted sweep
  (Ctrl-C, a crash, a closed laptop) keeps every finished cell; ``resume=True`` reloads
  them and runs only the rest. Cells that failed (``error``/``timeout``) are run again on
  resume; measured (``ok``) and ``unsupported`` cells are not.
- A failing cell is recorded with its error and the sweep goes on.

Cells are ordered size-major (every implementation at one size, then the next size), so
that a burst of load from elsewhere on the machine lands on all implementations of a
size alike instead of on one implementation's whole row.

Implementation names: registry backend names (``numpy``, ``torch-sdpa``, ...), optionally
with a strategy (``numpy:slicing``), or the groups ``main`` (every installed backend in
its standard strategy), ``strategies`` (the seed's other correct strategies of every
backend that has them) and ``all`` (both). The direct-reshape strategy is the known
mistake: it is never part of a group, though it can be named explicitly.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .cell import CellSpec, cell_key, implementation_label, run_cell, split_implementation
from .gemm import DEFAULT_GEMM_SIZE, best_of, measure_gemm_peak
from .pinning import DEFAULT_MALLOC_MODE, choose_cpus, malloc_env
from .timing import RepeatPolicy

GROUPS = ("main", "strategies", "all")
# Statuses a resumed sweep keeps; anything else is measured again.
FINISHED_STATUSES = ("ok", "unsupported")


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

    def __post_init__(self) -> None:
        malloc_env(self.malloc)  # validates the mode
        RepeatPolicy(**self.policy)  # validate early, in the parent, with a clear message
        RepeatPolicy(**self.gemm_policy)
        for name in ("tokens", "batch", "d_model", "heads"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {values!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def _gpu_present() -> bool:
    # Checked without importing a framework: the driver's device nodes.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def default_devices() -> list[str]:
    """``cpu``, plus ``gpu`` where an NVIDIA driver is present."""
    return ["cpu", "gpu"] if _gpu_present() else ["cpu"]


PRESETS: dict[str, dict] = {
    # Under two minutes on 2 cores: every installed implementation, two small sizes, short budgets.
    "quick": dict(
        implementations=["main"], tokens=[32, 128], batch=[2], d_model=[64], heads=[4], dtypes=["float32"],
        policy=dict(min_time=0.05, min_repeats=5, max_time=0.3, warmup=1),
        gemm_n=1024, gemm_policy=dict(min_time=0.2, min_repeats=5, max_time=0.5, warmup=1), cell_timeout=120.0,
    ),
    # About ten minutes here: every implementation and strategy, tokens 64 ... 1024 at the reference width.
    "default": dict(
        implementations=["all"], tokens=[64, 128, 256, 512, 1024], batch=[4], d_model=[512], heads=[8],
        dtypes=["float32"], policy=dict(min_time=0.3, min_repeats=5, max_time=1.5, warmup=2),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=2),
    ),
    # The reference size, timed longer: the figures quoted in the notes.
    "reference": dict(
        implementations=["all"], tokens=[512], batch=[4], d_model=[512], heads=[8], dtypes=["float32"],
        policy=dict(min_time=1.0, min_repeats=7, max_time=5.0, warmup=3),
        gemm_n=1024, gemm_policy=dict(min_time=1.0, min_repeats=7, max_time=4.0, warmup=2),
    ),
    # One GPU (scripts/gpu-run; pass --devices gpu): the reference size, 4k and 16k tokens, every GPU-capable
    # adapter and the fused references, float32 (TF32 off; MHA_ROSETTA_TF32=1 for on), bfloat16, float16.
    "gpu": dict(
        implementations=["torch", "jax", "einops-torch", "einops-jax", "torch-mha", "torch-sdpa", "jax-dpa"],
        tokens=[512, 4096, 16384], batch=[4], d_model=[512], heads=[8], dtypes=["float32", "bfloat16", "float16"],
        policy=dict(min_time=0.1, min_repeats=5, max_time=0.5, warmup=2),
        gemm_policy=dict(min_time=0.2, min_repeats=5, max_time=1.0, warmup=3), cell_timeout=60.0,
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


def _registry():
    from mha_rosetta.backends import KNOWN_WRONG_STRATEGIES, REGISTRY, available_backends, get_backend

    return REGISTRY, available_backends, get_backend, KNOWN_WRONG_STRATEGIES


def main_implementations() -> list[str]:
    """Every registered backend whose framework is installed, in its standard strategy."""
    _registry_dict, available_backends, _get, _wrong = _registry()
    return list(available_backends())


def strategy_implementations() -> list[str]:
    """The seed's other correct strategies (per-head matrices, slicing) of every installed backend."""
    _registry_dict, available_backends, get_backend, known_wrong = _registry()
    labels = []
    for name in available_backends():
        try:
            strategies = get_backend(name).strategies  # imports the adapter module, not its framework
        except Exception:  # an adapter that does not load shows up as a failing main cell instead
            continue
        labels += [implementation_label(name, s) for s in strategies if s != "standard" and s not in known_wrong]
    return labels


def resolve_implementations(names: list[str]) -> list[str]:
    """Expand the groups and validate explicit names; order kept, duplicates dropped."""
    registry, _available, _get, _wrong = _registry()
    resolved: list[str] = []
    for name in names:
        if name == "main":
            expanded = main_implementations()
        elif name == "strategies":
            expanded = strategy_implementations()
        elif name == "all":
            expanded = main_implementations() + strategy_implementations()
        else:
            backend, _strategy = split_implementation(name)
            if backend not in registry:
                raise ValueError(
                    f"unknown implementation {name!r}: the backend must be one of {', '.join(registry)} "
                    f"(optionally ':strategy'), or a group: {', '.join(GROUPS)}"
                )
            expanded = [name]
        resolved += [label for label in expanded if label not in resolved]
    return resolved


# -- the plan ---------------------------------------------------------------------------------


def expand_cells(settings: SweepSettings, implementations: list[str] | None = None) -> list[CellSpec]:
    """Every cell of the sweep, size-major (see the module docstring)."""
    labels = resolve_implementations(settings.implementations) if implementations is None else implementations
    cpus = choose_cpus(settings.threads, settings.cpus)
    cells = []
    for device in settings.devices:
        for dtype in settings.dtypes:
            for d_model in settings.d_model:
                for heads in settings.heads:
                    for batch in settings.batch:
                        for tokens in settings.tokens:
                            for label in labels:
                                cells.append(
                                    CellSpec(
                                        implementation=label, device=device, dtype=dtype, batch=batch, tokens=tokens,
                                        d_model=d_model, heads=heads, threads=settings.threads, cpus=cpus,
                                        policy=dict(settings.policy), malloc=settings.malloc,
                                    )
                                )  # fmt: skip
    return cells


def gemm_groups(cells: list[CellSpec]) -> list[tuple[str, str]]:
    """The (device, dtype) pairs that need a GEMM peak, in first-use order."""
    groups: list[tuple[str, str]] = []
    for cell in cells:
        if (cell.device, cell.dtype) not in groups:
            groups.append((cell.device, cell.dtype))
    return groups


def gemm_key(device: str, dtype: str, threads: int) -> str:
    return f"{device}/{dtype}/{threads}"


# -- the partial file -------------------------------------------------------------------------


def default_partial_path(json_path: str | None) -> Path:
    """Where finished cells are kept while the sweep runs: beside the JSON, or in the current folder."""
    if json_path and json_path != "-":
        return Path(f"{json_path}.partial.jsonl")
    return Path("mha-rosetta-bench.partial.jsonl")


def load_partial(path: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(cells by key, GEMM peaks by key) from a partial file; a torn last line is ignored."""
    cells: dict[str, dict] = {}
    peaks: dict[str, dict] = {}
    if not path.exists():
        return cells, peaks
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written when the sweep was killed
        if entry.get("type") == "cell":
            cells[cell_key(entry["record"])] = entry["record"]
        elif entry.get("type") == "gemm":
            peak = entry["record"]
            peaks[gemm_key(peak["device"], peak["dtype"], peak["threads"])] = peak
    return cells, peaks


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


# -- progress ---------------------------------------------------------------------------------


class Progress:
    """A rich progress bar on stderr where rich is installed, else one plain line per step."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
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
            self._task = self._rich.add_task("bench", total=total)
        except ImportError:
            self._rich = None

    def step(self, description: str) -> None:
        if self._rich is not None:
            self._rich.update(self._task, description=description)

    def advance(self, message: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1)
            self._rich.console.print(message, highlight=False, soft_wrap=True)
        else:
            print(f"[{self.done}/{self.total}] {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


def describe_result(record: dict) -> str:
    """One progress line for a finished cell."""
    where = f"{record['implementation']} {record['device']} {record['dtype']} B={record['batch']} N={record['tokens']} D={record['d_model']} H={record['heads']}"
    if record.get("status") == "ok":
        util = record.get("cpu_util")
        warn = " (!) " + record["warnings"][0] if record.get("warnings") else ""
        util_text = f", {util:.2f} cores" if util is not None else ""
        return f"{where}: {record['median_s'] * 1e3:.3f} ms{util_text}{warn}"
    return f"{where}: {record.get('status')} ({record.get('error', '')})"


# -- the sweep --------------------------------------------------------------------------------

CellRunner = Callable[[CellSpec, float], dict]
GemmRunner = Callable[..., dict]


@dataclass
class SweepOutcome:
    """What a sweep produced: the cells and GEMM peaks in plan order, and whether it finished."""

    settings: SweepSettings
    cells: list[dict]
    gemm_peaks: list[dict]
    interrupted: bool = False
    resumed_cells: int = 0

    @property
    def failed(self) -> list[dict]:
        return [cell for cell in self.cells if cell.get("status") not in FINISHED_STATUSES]


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
    """Run (or resume) the sweep; every finished cell is in ``partial_path`` as soon as it ends.

    Ctrl-C stops the sweep between or during cells: the outcome then holds the finished
    cells and ``interrupted=True`` (the caller writes what it has and exits with 130).
    """
    cells = expand_cells(settings, implementations)
    groups = gemm_groups(cells)
    partial_path = Path(partial_path)
    done_cells, done_peaks = load_partial(partial_path) if resume else ({}, {})
    if resume:
        _end_torn_line(partial_path)
    if not resume and partial_path.exists():
        partial_path.unlink()  # a fresh sweep: earlier partial results are not this run's
    partial_path.parent.mkdir(parents=True, exist_ok=True)
    if not partial_path.exists():
        _append(partial_path, {"type": "header", "schema": 1, "settings": settings.as_dict()})

    bar = Progress(total=len(groups) + len(cells), enabled=progress)  # the closing peak re-check is not a step
    results: list[dict] = []
    peaks: list[dict] = []
    resumed = 0
    interrupted = False
    try:
        for device, dtype in groups:
            key = gemm_key(device, dtype, settings.threads)
            peak = done_peaks.get(key)
            if peak is None or peak.get("gflops") is None or peak.get("malloc", settings.malloc) != settings.malloc:
                bar.step(f"GEMM peak {device} {dtype}")
                peak = gemm_runner(
                    dtype, device, settings.threads, cells[0].cpus, n=settings.gemm_n,
                    policy=dict(settings.gemm_policy), malloc=settings.malloc,
                )  # fmt: skip
                _append(partial_path, {"type": "gemm", "record": peak})
            peaks.append(peak)
            gflops = peak.get("gflops")
            shown = f"{gflops:.1f} GFLOP/s ({peak.get('library')})" if gflops else "not measurable"
            bar.advance(f"GEMM peak {device} {dtype} n={peak.get('n')}: {shown}")
        for spec in cells:
            previous = done_cells.get(spec.key())
            if previous is not None and previous.get("status") in FINISHED_STATUSES:
                results.append(previous)
                resumed += 1
                bar.advance(describe_result(previous) + " [resumed]")
                continue
            bar.step(f"{spec.implementation} N={spec.tokens}")
            record = cell_runner(spec, settings.cell_timeout)
            _append(partial_path, {"type": "cell", "record": record})
            results.append(record)
            bar.advance(describe_result(record))
        # The peak again, after the cells, with the library that won: the better of the two
        # is the fairer yardstick (a peak measured while the machine was busy flatters every cell).
        for index, (device, dtype) in enumerate(groups):
            bar.step(f"GEMM peak again {device} {dtype}")
            winner = peaks[index].get("library")
            again = gemm_runner(
                dtype, device, settings.threads, cells[0].cpus, n=settings.gemm_n, policy=dict(settings.gemm_policy),
                libraries=[winner] if winner else None, retries=0, malloc=settings.malloc,
            )  # fmt: skip
            peaks[index] = best_of(peaks[index], again)
            _append(partial_path, {"type": "gemm", "record": peaks[index]})
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    return SweepOutcome(
        settings=settings, cells=results, gemm_peaks=peaks, interrupted=interrupted, resumed_cells=resumed
    )


def with_overrides(settings: SweepSettings, **changes) -> SweepSettings:
    """A copy of ``settings`` with some fields changed (None values ignored)."""
    return replace(settings, **{key: value for key, value in changes.items() if value is not None})
