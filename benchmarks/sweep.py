"""The sweep: implementations × sizes × dtypes × devices, one fresh pinned process per cell.

What it guarantees:

- Every cell runs through `cell.run_cell` (a fresh process, pinned, thread knobs set
  before any import), with the same thread count for every framework, and the same
  allocator rule (``malloc``, see `pinning.malloc_env`) for every cell and GEMM peak.
- Rounds (``rounds``, `benchmarks.rounds`): every cell is visited once per round (``visits``
  times where a preset asks for more, each a fresh process, pooled into the round's figure), in an
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

The modules around it: `presets` (the named presets), `plan` (implementation names and
groups), `partial` (the partial file), `progress` (the estimate and the progress bar).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .cell import CellSpec, cell_record, run_cell
from .flops import mode_flops
from .gemm import DEFAULT_GEMM_SIZE, measure_gemm_peak
from .long import memory_budget_mb, over_budget_reason
from .partial import append_entry, check_resume_machine, end_torn_line, header_fields, load_partial, partial_header
from .pinning import DEFAULT_MALLOC_MODE, choose_cpus, malloc_env, require_positive_int
from .plan import gemm_groups, gemm_key, resolve_implementations
from .presets import PRESETS
from .progress import Progress, describe_result
from .rounds import (
    BUSY_THRESHOLD,
    DRIFT_THRESHOLD,
    FINISHED_STATUSES,
    busy_rounds,
    draw_seed,
    merge_peaks,
    merge_visits,
    pool_visits,
    round_orders,
)
from .timing import RepeatPolicy
from .variants import BENCH_VARIANTS, check_variant


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
    visits: int = 1  # visits of every cell per round, each a fresh process, pooled (rounds.pool_visits)
    # A cell whose predicted peak memory exceeds this (MiB) is skipped, not run (benchmarks.long);
    # None: half the available memory, at most 8 GiB.
    memory_budget_mb: float | None = None
    seed: int | None = None  # the shuffle seed; None: drawn when the sweep starts, then recorded
    modes: list[str] = field(default_factory=lambda: ["fwd"])  # flops.MODES: forward, forward+backward
    # benchmarks.variants.BENCH_VARIANTS names; None is the plain configuration of every other preset.
    variants: list[str | None] = field(default_factory=lambda: [None])

    def __post_init__(self) -> None:
        malloc_env(self.malloc)  # validates the mode
        require_positive_int("rounds", self.rounds)
        require_positive_int("visits", self.visits)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if not self.modes:
            raise ValueError("modes must name at least one of fwd, fwdbwd")
        for mode in self.modes:
            mode_flops(1, mode)  # validates the name
        if not self.variants:
            raise ValueError(f"variants must name at least one of {', '.join(BENCH_VARIANTS)} (or None), got []")
        for variant in self.variants:
            check_variant(variant)
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


def preset_settings(name: str, **overrides) -> SweepSettings:
    """The settings of a named preset, with any field overridden (None values are ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    values = {**PRESETS[name], "devices": default_devices(), "preset": name}
    values.update({key: value for key, value in overrides.items() if value is not None})
    return SweepSettings(**values)


# -- the plan ---------------------------------------------------------------------------------


def expand_cells(settings: SweepSettings, implementations: list[str] | None = None) -> list[CellSpec]:
    """Every cell of the sweep in plan order, size-major (each round visits them shuffled)."""
    labels = resolve_implementations(settings.implementations) if implementations is None else implementations
    cpus = choose_cpus(settings.threads, settings.cpus)
    return [
        CellSpec(
            implementation=label, device=device, dtype=dtype, batch=batch, tokens=tokens, d_model=d_model,
            heads=heads, threads=settings.threads, cpus=cpus, policy=dict(settings.policy), malloc=settings.malloc,
            mode=mode, variant=variant,
        )
        # itertools.product varies its last list fastest: the cells of one size stand together.
        for device, dtype, d_model, heads, batch, tokens, label, mode, variant in itertools.product(
            settings.devices, settings.dtypes, settings.d_model, settings.heads, settings.batch, settings.tokens,
            labels, settings.modes, settings.variants,
        )
    ]  # fmt: skip


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
        "visits": settings.visits,
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

    ``settings.rounds`` rounds; each measures the GEMM peaks, then visits every cell once
    (``settings.visits`` times) in its own shuffled order (`rounds.round_orders`, from ``settings.seed``; drawn and recorded
    when None, or taken from the partial file's header on resume). A cell found unsupported
    is not visited again. Ctrl-C stops the sweep between or during visits: the outcome then
    holds what finished and ``interrupted=True`` (the caller writes what it has and exits 130).
    """
    cells = expand_cells(settings, implementations)
    groups = gemm_groups(cells)
    partial_path = Path(partial_path)
    done_cells, done_peaks = load_partial(partial_path) if resume else ({}, {})
    header = partial_header(partial_path) if resume else None
    check_resume_machine(partial_path, header, "its cells and the GEMM peaks they are read against")
    if settings.seed is None:
        seed = (header or {}).get("settings", {}).get("seed")
        settings = replace(settings, seed=seed if isinstance(seed, int) else draw_seed())
    if resume:
        end_torn_line(partial_path)
    else:
        partial_path.unlink(missing_ok=True)  # a fresh sweep: earlier partial results are not this run's
    partial_path.parent.mkdir(parents=True, exist_ok=True)
    if not partial_path.exists():
        append_entry(partial_path, {"type": "header", "schema": 1, **header_fields(), "settings": settings.as_dict()})

    budget = memory_budget_mb(settings.memory_budget_mb)
    orders = round_orders(len(cells), settings.rounds, settings.seed, settings.visits)
    bar = Progress(settings.rounds, len(groups) + len(cells) * settings.visits, enabled=progress)
    # visits[cell][round][k]: the k-th visit of that cell in that round (None: not run)
    visits: list[list[list[dict | None]]] = [[[None] * settings.visits for _ in range(settings.rounds)] for _ in cells]
    peaks_by_round: dict[tuple[int, str], dict] = {}
    wall_s: list[float] = []
    resumed = 0
    interrupted = False
    try:
        for round_index, order in bar.each_round(orders, wall_s):
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
                    append_entry(partial_path, {"type": "gemm", "round": round_index, "record": peak})
                peaks_by_round[(round_index, key)] = peak
                gflops = peak.get("gflops")
                shown = f"{gflops:.1f} GFLOP/s ({peak.get('library')})" if gflops else "not measurable"
                bar.advance(f"GEMM peak {device} {dtype} n={peak.get('n')}: {shown}")
            seen = [0] * len(cells)  # visits of each cell so far this round
            for index in order:
                spec = cells[index]
                visit_index, seen[index] = seen[index], seen[index] + 1
                earlier = [visit for row in visits[index][: round_index + 1] for visit in row if visit is not None]
                if any(visit.get("status") == "unsupported" for visit in earlier):
                    bar.advance(describe_result(earlier[0]) + " [not run again]")
                    continue
                previous = done_cells.get((round_index, visit_index, spec.key()))
                if previous is not None and previous.get("status") in FINISHED_STATUSES:
                    visits[index][round_index][visit_index] = previous
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
                append_entry(
                    partial_path, {"type": "cell", "round": round_index, "visit": visit_index, "record": record}
                )
                visits[index][round_index][visit_index] = record
                bar.advance(describe_result(record))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    by_cell = (merge_visits([pool_visits(round_visits) for round_visits in row]) for row in visits)
    merged_cells = [cell for cell in by_cell if cell is not None]
    keys = [gemm_key(device, dtype, settings.threads) for device, dtype in groups]
    merged = (merge_peaks([peaks_by_round.get((index, key)) for index in range(settings.rounds)]) for key in keys)
    merged_peaks = [peak for peak in merged if peak is not None]
    return SweepOutcome(
        settings=settings, cells=merged_cells, gemm_peaks=merged_peaks, interrupted=interrupted,
        resumed_cells=resumed, rounds=rounds_record(settings, cells, orders, peaks_by_round, wall_s),
    )  # fmt: skip
