"""``bench --mode decode``'s sweep: its settings (a preset plus overrides, `decode_settings.DecodeSettings`), the
cells it expands to, the rounds (each device's copy bandwidth, then every cell once in a shuffled order), the
partial file, and the decode report.

An interrupted sweep keeps every finished visit and each round's bandwidth in a partial file (`partial`,
one JSON line each, the forward sweep's format with the entry types ``decode-cell`` and ``bandwidth`` and a
header of kind ``decode``); ``resume=True`` (``bench --mode decode --resume``) reloads them and the shuffle
seed and runs the rest, as the forward sweep does. It resumes only on the machine that started it (the
header's machine, by the rule of `provenance.MACHINE_FIELDS`): the cells and the bandwidth they are read against would otherwise
come from two machines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from .bandwidth import enrich_decode_cell
from .decode import (
    KIND,
    SCHEMA,
    DecodeCellSpec,
    decode_cell_key,
    decode_config,
    decode_record,
    row_label,
    run_decode_cell,
)
from .decode_mla import absorbed_over_naive
from .decode_rows import expand_decode_cells
from .decode_settings import DecodeSettings
from .pinning import choose_cpus
from .presets import DECODE_PRESETS

PARTIAL_KIND = KIND  # the header's "kind" in a decode sweep's partial file (a forward sweep's header has none)


def load_decode_partial(path: Path) -> tuple[dict[tuple[int, str], dict], dict[tuple[int, str], dict]]:
    """(cell visits by (round, `decode_cell_key`), bandwidths by (round, device)) from a decode partial file."""
    from .partial import partial_entries

    cells: dict[tuple[int, str], dict] = {}
    bandwidths: dict[tuple[int, str], dict] = {}
    for entry in partial_entries(Path(path)):
        round_index = entry.get("round", 0)
        if entry.get("type") == "decode-cell":
            cells[(round_index, decode_cell_key(entry["record"]))] = entry["record"]
        elif entry.get("type") == "bandwidth":
            bandwidths[(round_index, entry["record"].get("device"))] = entry["record"]
    return cells, bandwidths


def check_decode_partial(path: Path) -> dict | None:
    """The header of the decode partial file at ``path`` (None when there is none), or ValueError naming the file
    when it holds a forward sweep's visits or another machine's."""
    from .partial import check_resume_machine, partial_header

    header = partial_header(Path(path))
    if header is None:
        return None
    if header.get("kind") != PARTIAL_KIND:
        raise ValueError(
            f"--resume: {path} holds a forward sweep's finished cells, not a decode sweep's "
            "(give the decode sweep's --partial PATH, or run without --resume)"
        )
    check_resume_machine(path, header, "its cells and the bandwidth they are read against")
    return header


# -- the sweep ---------------------------------------------------------------------------------------
def decode_settings(name: str = "decode", **overrides) -> DecodeSettings:
    """The preset ``name`` (`presets.DECODE_PRESETS`) with every override that is not None."""
    if name not in DECODE_PRESETS:
        raise ValueError(f"decode preset must be one of {', '.join(DECODE_PRESETS)}, got {name!r}")
    values = {**DECODE_PRESETS[name], **{key: value for key, value in overrides.items() if value is not None}}
    settings = DecodeSettings(preset=name, **values)
    if settings.cpus is None:
        settings = replace(settings, cpus=choose_cpus(settings.threads))
    return settings


def parent_reason(spec: DecodeCellSpec) -> str | None:
    """Why the backend cannot decode this cell, known without a child (`Backend.decode_reason`), or None.

    The adapter's module is imported, not its framework; a backend that does not load is left to the
    child, whose error then says why.
    """
    from mha_rosetta.backends import get_backend

    try:
        backend = get_backend(spec.backend)
    except Exception:
        return None
    reason = backend.decode_reason(decode_config(spec), spec.dtype, spec.device, spec.strategy, spec.cache)
    return reason or backend.timed_step_reason(spec.cache, ragged=spec.lengths is not None)


def estimate_decode_seconds(settings: DecodeSettings, cells: list[DecodeCellSpec]) -> float:
    """The sweep's expected duration (`progress`' start-up times and repeat-policy rule), in seconds: every cell
    that can decode (`parent_reason` is None) once per round, with its prefill, plus each round's bandwidth. An
    estimate, not a measurement: a long context's prefill and a JIT's compilation make it longer."""
    from .progress import _startup_s, _timed_s

    runnable = [cell for cell in cells if parent_reason(cell) is None]
    per_round = sum(
        _startup_s(cell.implementation) + _timed_s(cell.policy) + (_timed_s(cell.prefill_policy) if cell.prefill else 0)
        for cell in runnable
    )
    bandwidth = len(settings.devices) * (_startup_s("numpy") + 2 * _timed_s(settings.bandwidth_policy))
    return settings.rounds * (per_round + bandwidth)


def describe_decode_estimate(settings: DecodeSettings, cells: list[DecodeCellSpec]) -> str:
    """One line for the terminal: how many cells and rounds, and about how long (`estimate_decode_seconds`)."""
    from .progress import duration_text

    return (
        f"decode, {len(cells)} cells x {settings.rounds} round(s) after each round's copy bandwidth: about "
        f"{duration_text(estimate_decode_seconds(settings, cells))} (estimated from the repeat policy and typical "
        "start-up times)"
    )


CellRunner = Callable[[DecodeCellSpec, float], dict]
BandwidthRunner = Callable[..., dict]


def _describe(record: dict) -> str:
    where = f"{record['implementation']} {record['device']} {record['dtype']} context={record['context']}"
    where += row_label(record)  # the paged, windowed and ragged rows
    if record.get("status") == "ok":
        return f"{where}: step {record['median_s'] * 1e3:.3f} ms"
    return f"{where}: {record.get('status')} ({record.get('error', '')})"


def run_decode_sweep(
    settings: DecodeSettings,
    implementations: list[str],
    *,
    progress: bool = True,
    cell_runner: CellRunner = run_decode_cell,
    bandwidth_runner: BandwidthRunner | None = None,
    partial_path: str | Path | None = None,
    resume: bool = False,
) -> dict:
    """Run every round (the bandwidth of each device first, then every cell once in a shuffled order) and
    return the report (`assemble_decode_report`). Ctrl-C keeps what finished (``complete: false``).

    With ``partial_path`` every finished visit and bandwidth is appended there as it ends; ``resume=True``
    reloads them (`check_decode_partial` first: a forward sweep's file or another machine's is refused) and the
    seed of its header (unless ``settings.seed`` is given), and runs only the rest: visits that failed run
    again, measured and unsupported ones do not, as in the forward sweep. ``settings.resumed_cells`` counts
    the visits taken from the file.
    """
    from .bandwidth import measure_bandwidth
    from .partial import append_entry, end_torn_line, header_fields
    from .progress import Progress
    from .rounds import FINISHED_STATUSES, draw_seed, round_orders

    bandwidth_runner = bandwidth_runner or measure_bandwidth
    partial = None if partial_path is None else Path(partial_path)
    done_cells: dict[tuple[int, str], dict] = {}
    done_bandwidths: dict[tuple[int, str], dict] = {}
    header = None
    if partial is not None and resume:
        header = check_decode_partial(partial)
        done_cells, done_bandwidths = load_decode_partial(partial)
        end_torn_line(partial)
    if settings.seed is None:
        seed = ((header or {}).get("settings") or {}).get("seed")
        settings = replace(settings, seed=seed if isinstance(seed, int) else draw_seed())
    if partial is not None:
        if not resume:
            partial.unlink(missing_ok=True)  # a fresh sweep: earlier partial results are not this run's
        partial.parent.mkdir(parents=True, exist_ok=True)
        if not partial.exists() or header is None:
            header = {"type": "header", "schema": 1, "kind": PARTIAL_KIND, **header_fields()}
            append_entry(partial, {**header, "settings": settings.as_dict()})

    def keep(entry: dict) -> None:
        if partial is not None:
            append_entry(partial, entry)

    cells = expand_decode_cells(settings, implementations)
    known = [parent_reason(spec) for spec in cells]
    orders = round_orders(len(cells), settings.rounds, settings.seed)
    bar = Progress(settings.rounds, len(settings.devices) + len(cells), enabled=progress)
    visits: list[list[dict | None]] = [[None] * settings.rounds for _ in cells]
    bandwidths: dict[str, list[dict | None]] = {device: [None] * settings.rounds for device in settings.devices}
    interrupted, started, wall_s, resumed = False, time.perf_counter(), [], 0
    try:
        for round_index, order in bar.each_round(orders, wall_s):
            for device in settings.devices:
                bar.step(f"bandwidth {device}")
                record = done_bandwidths.get((round_index, device))
                if record is None or not record.get("gbps") or record.get("malloc", settings.malloc) != settings.malloc:
                    first = bandwidths[device][0] or {}
                    libraries = [first["library"]] if round_index and first.get("library") else None
                    record = bandwidth_runner(
                        device, settings.threads, settings.cpus, array_mb=settings.array_mb,
                        policy=dict(settings.bandwidth_policy), libraries=libraries, malloc=settings.malloc,
                    )  # fmt: skip
                    keep({"type": "bandwidth", "round": round_index, "record": record})
                bandwidths[device][round_index] = record
                shown = f"{record['gbps']:.1f} GB/s ({record.get('library')})" if record.get("gbps") else "not measured"
                bar.advance(f"copy bandwidth {device}: {shown}")
            for index in order:
                spec = cells[index]
                if known[index]:
                    record = decode_record(spec, {"status": "unsupported", "error": known[index]})
                elif any((visit or {}).get("status") == "unsupported" for visit in visits[index][:round_index]):
                    bar.advance(f"{spec.implementation} context={spec.context}: unsupported [not run again]")
                    continue
                elif (done := done_cells.get((round_index, spec.key()))) and done.get("status") in FINISHED_STATUSES:
                    visits[index][round_index] = done
                    resumed += 1
                    bar.advance(_describe(done) + " [resumed]")
                    continue
                else:
                    bar.step(f"{spec.implementation} context={spec.context}")
                    visit_start = time.perf_counter()
                    record = cell_runner(spec, settings.cell_timeout)
                    record["visit_wall_s"] = time.perf_counter() - visit_start
                    keep({"type": "decode-cell", "round": round_index, "record": record})
                visits[index][round_index] = record
                bar.advance(_describe(record))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    from .bandwidth import merge_bandwidths
    from .rounds import merge_visits

    merged = [cell for cell in (merge_visits(row) for row in visits) if cell is not None]
    merged_bandwidths = [b for b in (merge_bandwidths(rows) for rows in bandwidths.values()) if b is not None]
    per_round = {device: [None if r is None else r.get("gbps") for r in rows] for device, rows in bandwidths.items()}
    rounds = {
        "count": settings.rounds,
        "seed": settings.seed,
        "orders": orders,
        "wall_s": wall_s,
        "bandwidth_gbps": per_round,
    }
    report = assemble_decode_report(
        {**settings.as_dict(), "resumed_cells": resumed}, merged_bandwidths, merged, rounds=rounds,
        complete=not interrupted,
    )  # fmt: skip
    report["sweep_time"] = {"wall_s": time.perf_counter() - started}
    return report


# -- the report ------------------------------------------------------------------------------------
def best_of_framework(cells: list[dict]) -> None:
    """Each decoded cell's time over its framework's best path at the same context, window and device
    (``over_best``, with the best path's name in ``best_path``), where the run timed that best path.

    Our convention adapters are never a framework's speed (issue 43): this is the gap the table names.
    """
    from .best_gap import DECODE_SIZE, mark_over_best

    mark_over_best(cells, DECODE_SIZE, lambda cell: cell.get("step_s"))


def assemble_decode_report(
    settings: dict, bandwidths: list[dict], cells: list[dict], *, rounds: dict | None = None, complete: bool = True
) -> dict:
    """The decode report: machine, settings, the bandwidth per device, the cells (drift-corrected, enriched)."""
    from .best_gap import paged_over_contiguous, ragged_over_rectangular
    from .correction import correct_cell, reference_summary, run_references
    from .report import machine_info, status_summary

    by_device = {record["device"]: record for record in bandwidths}
    workloads = run_references(cells)

    def enrich(cell: dict) -> dict:
        record = by_device.get(cell["device"], {})
        return enrich_decode_cell(
            correct_cell(cell, workloads),
            record.get("gbps"),
            record.get("llc_bytes"),
            read_gbps=record.get("read_gbps"),
            measured_llc_bytes=record.get("measured_llc_bytes"),
        )

    enriched = [enrich(cell) for cell in cells]
    best_of_framework(enriched)
    paged_over_contiguous(enriched)  # `best_gap`: the paged row over the contiguous one
    ragged_over_rectangular(enriched)
    absorbed_over_naive(enriched)  # `decode_mla`: the MLA row's two forms
    try:
        from .provenance import provenance

        origin = provenance()
    except Exception as error:  # provenance is a record, never a reason to lose a sweep
        origin = {"error": f"{type(error).__name__}: {error}"}
    return {
        "schema": SCHEMA,
        "kind": KIND,
        "complete": complete,
        "machine": machine_info([]),
        "provenance": origin,
        "settings": settings,
        "bandwidth": bandwidths,
        "bandwidth_gbps_by": {device: record.get("gbps") for device, record in by_device.items()},
        "cells": enriched,
        "summary": status_summary(enriched),
        **({"rounds": rounds} if rounds else {}),
        **({"reference": reference_summary(enriched, workloads)} if workloads else {}),
    }
