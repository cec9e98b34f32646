"""``bench --breakdown``: where one cell's time goes, stage by stage, and what its program copies and allocates.

A cell is the forward or decode cell the bench would time (`cell.CellSpec`, `decode.DecodeCellSpec`), measured
in a fresh process pinned like every cell (`fresh.run_fresh`: the thread knobs, the allocator rule, the CPU
affinity set before anything heavy is imported). Inside it:

1. prepare the cell as the bench does (``prepare``/``prepare_decode``), compile, call it twice: the compiled
   programs of the first call and of the second (a recompile) are counted apart;
2. what the program moves, asked of its framework (`backends.inspect_programs`): JAX's compiled HLO (XLA
   dumps every module it compiles in the child: ``copy``/``transpose`` instructions and the fusions whose root
   is one, with shapes and bytes); torch's allocations (``torch.profiler``, ``profile_memory``); NumPy's peak
   of traced memory and the stage tensors the adapter made as copies. A decode cell is also prepared at half
   its context, untimed, so that each allocation says whether it grows with the context;
3. the stage times: the program cut after each stage (`backends.stage_programs`), every cut and the untouched
   program timed round-robin (`timing.time_interleaved`, so drift hits them alike). A stage's time is the
   difference of consecutive cuts, taken round by round: its median and quartiles are of those differences,
   never clamped, so a negative or noisy difference shows as it is. A path with its own stage-truncated
   programs (the best paths, the jax adapter's decode step: `backends.stage_cuts`) is cut by them, its cache
   write a stage of its own; a program that cannot be cut (a decode step that records no stage, a per-head
   strategy) gets its whole time and the reason.

Why cuts and not a profiler: `backends.stage_programs` says. The report (``kind`` "breakdown") is rendered
by `breakdown_markdown`.

Child usage: ``python -m mha_rosetta.benchmarks.breakdown '{"kind": "fwd", "cell": {...}, "dump": DIR}'``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from .cell import CellSpec, _cell_error, build_config
from .decode import DecodeCellSpec, decode_config
from .fresh import child_main, run_fresh
from .pinning import malloc_env, thread_env

KIND = "breakdown"
SCHEMA = 1
KINDS = ("fwd", "decode")
EMPTY_CUT = "empty cut"  # the cuts' fixed cost (`StagePrograms.baseline`): the first stage is measured from it  # what a breakdown cell can be: a forward cell or a decode step


def cell_of(kind: str, data: dict):
    """The `CellSpec` (``kind`` "fwd") or `DecodeCellSpec` ("decode") of a spec's ``cell``."""
    if kind not in KINDS:
        raise ValueError(f"breakdown kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return CellSpec.from_dict(data) if kind == "fwd" else DecodeCellSpec.from_dict(data)


def _prepare(kind: str, cell, backend, context: int | None = None):
    """The cell's `Prepared` (a forward, or one decode step at ``context``, default the cell's)."""
    import numpy as np

    from mha_rosetta.core import init_params

    if kind == "fwd":
        cfg = build_config(cell)
        query = np.random.default_rng(cell.seed + 1).standard_normal((cell.batch, cell.tokens, cfg.d_model))
        prepared, _ = backend.prepare(
            cfg, init_params(cfg, seed=cell.seed), query, None, None, dtype=cell.dtype, device=cell.device,
            strategy=cell.strategy,
        )  # fmt: skip
        return prepared
    cfg = decode_config(cell)
    return backend.prepare_decode(
        cfg, init_params(cfg, seed=cell.seed), context=context or cell.context, batch=cell.batch, step=cell.step,
        dtype=cell.dtype, device=cell.device, strategy=cell.strategy, cache=cell.cache, seed=cell.seed,
    )  # fmt: skip


def _call(prepared):
    def once():
        result = prepared.forward()
        prepared.synchronize(result)
        return result

    return once


def _inspect(kind: str, cell, backend, prepared, dump: str | None) -> dict:
    """What the framework says the cell's program moves or allocates (module docstring, step 2)."""
    from mha_rosetta.backends import inspect_programs as inspect

    requires = backend.requires
    found: dict = {"framework": next((name for name in ("jax", "torch", "numpy") if name in requires), None)}

    def at_half():  # the same step at half the context, warm (its JAX modules would be listed too: not asked there)
        found["half_context"] = cell.context // 2
        half = _prepare(kind, cell, backend, context=cell.context // 2)
        half.forward()
        return half

    half_asked = kind == "decode" and cell.context >= 2
    if found["framework"] is None:
        found["error"] = f"no inspection is written for {', '.join(requires)} (only NumPy, torch and JAX)"
        return found
    if found["framework"] == "jax":
        if dump is None:
            found["error"] = "no XLA dump directory was given to this process"
            return found
        before = inspect.dumped_modules(dump)
        _call(prepared)()  # a second call: any module compiled now is a recompile
        after = inspect.dumped_modules(dump)
        found["recompiles"] = sorted(set(after) - set(before))
        found["modules"] = inspect.module_moves(after)
    elif found["framework"] == "torch":
        found["operators"] = inspect.torch_operator_times(_call(prepared), device=cell.device)
        at_context = inspect.torch_allocations(_call(prepared), cell.device)
        if half_asked:
            at_context = inspect.grows_with_context(
                at_context, inspect.torch_allocations(_call(at_half()), cell.device)
            )
        found["allocations"] = at_context
    else:
        peak = inspect.traced_peak_bytes(_call(prepared))
        found["peak_bytes"] = peak
        if half_asked:
            found["peak_bytes_half"] = inspect.traced_peak_bytes(_call(at_half()))
            # the growth from half the context to the whole: 2 where all of it is proportional to the context
            found["peak_ratio"] = peak / found["peak_bytes_half"] if found["peak_bytes_half"] else None
    if found["framework"] != "jax":  # NumPy's and torch's stages say whether each is a view or a copy (measured)
        found["stage_copies"] = [
            {"stage": name, "from": stage.parent, "bytes": _nbytes(stage.value)}
            for name, stage in prepared.native_stages().items()
            if stage.relation == "copy"
        ]
    return found


def _nbytes(value) -> int:
    """A stage tensor's bytes: NumPy's ``nbytes``, torch's ``numel() * element_size()``."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    return int(value.numel() * value.element_size())


def _stage_times(stage_names: list[str], samples: dict[str, list[float]]) -> list[dict]:
    """Each stage's time: the round-by-round difference of its cut and the one before (module docstring, 3)."""
    from .timing import quartiles

    rows, previous = [], None
    for name in stage_names:
        cut = samples[name]
        differences = cut if previous is None else [a - b for a, b in zip(cut, previous, strict=True)]
        q25, median, q75 = quartiles(differences)
        rows.append({"stage": name, "median_s": median, "q25_s": q25, "q75_s": q75, "cut_median_s": quartiles(cut)[1]})
        rows[-1]["noisy"] = q25 < 0 or median < 0  # shown as measured, never clamped
        previous = cut
    return rows


def measure(spec: dict) -> dict:
    """One cell's breakdown in this process (call it in a fresh, pinned child)."""
    from . import pinning
    from .timing import RepeatPolicy, time_interleaved

    kind = spec["kind"]
    cell = cell_of(kind, spec["cell"])
    record: dict = {"kind": kind, "affinity": sorted(os.sched_getaffinity(0)) if pinning.affinity_supported() else None}

    from mha_rosetta.backends import UnsupportedCase, get_backend
    from mha_rosetta.backends.stage_programs import NoCut, stage_programs

    backend = get_backend(cell.backend)
    record["framework_threads"] = pinning.configure_frameworks(cell.threads, backend.requires)
    try:
        prepared = _prepare(kind, cell, backend)
    except UnsupportedCase as reason:
        return {**record, "status": "unsupported", "error": str(reason)}
    with pinning.limit_thread_pools(cell.threads):
        if prepared.compile is not None:
            prepared.compile()
        _call(prepared)()  # the first call: anything compiled lazily is compiled now
        record["inspection"] = _inspect(kind, cell, backend, prepared, spec.get("dump"))
        programs = {"whole": _call(prepared)}
        try:
            cuts = stage_programs(prepared, backend.requires)
            stage_names = [group for group, _ in cuts.groups]
            programs[EMPTY_CUT] = cuts.baseline()
            programs.update((group, cuts.program(index)) for index, group in enumerate(stage_names))
            record["method"] = cuts.method
        except NoCut as reason:
            cuts, stage_names, record["no_stages"] = None, [], str(reason)
        if cuts is None:
            timed = time_interleaved(programs, RepeatPolicy(**cell.policy))
        else:
            with cuts.active():
                timed = time_interleaved(programs, RepeatPolicy(**cell.policy))
    summary = ("median_s", "iqr_s", "min_s", "repeats")
    record["whole"] = {key: timed["whole"][key] for key in summary}
    if cuts is not None:
        record["empty_cut"] = {key: timed[EMPTY_CUT][key] for key in summary}
        names = [EMPTY_CUT, *stage_names]
        record["stages"] = _stage_times(names, {name: timed[name]["samples_s"] for name in names})[1:]
        for index, row in enumerate(record["stages"]):
            row["reached"] = list(cuts.reached(index))
    record["info"] = {str(key): str(value) for key, value in prepared.info.items()}
    return {**record, "status": "ok"}


def run_breakdown_cell(kind: str, cell, timeout: float = 900.0) -> dict:
    """One cell's breakdown in a fresh pinned child (parent side): the cell's identity and the child's record.

    A JAX cell's child gets ``XLA_FLAGS`` with the dump flags (`inspect_programs.xla_dump_flags`) on top of
    the thread flags, and a temporary dump directory, removed afterwards.
    """
    from mha_rosetta.backends.inspect_programs import xla_dump_flags

    dump = tempfile.mkdtemp(prefix="mha-rosetta-xla-")
    try:
        flags = thread_env(cell.threads, device=cell.device).get("XLA_FLAGS", "")
        extra = {**malloc_env(cell.malloc), "XLA_FLAGS": f"{flags} {xla_dump_flags(dump)}".strip()}
        spec = {"kind": kind, "cell": cell.to_dict(), "dump": dump}
        outcome = run_fresh("mha_rosetta.benchmarks.breakdown", spec, threads=cell.threads, timeout=timeout,
                            extra_env=extra)  # fmt: skip
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    record = {**cell.identity(), "strategy": cell.strategy, "kind": kind}
    record.update(outcome)
    record.setdefault("status", "error")
    return record


def run_breakdown(kind: str, cells: list, progress=None) -> dict:
    """Every cell's breakdown, one fresh child each; the report (``kind`` "breakdown", `breakdown_markdown`)."""
    from .provenance import provenance

    records = []
    for cell in cells:
        if progress is not None:
            progress(cell)
        records.append(run_breakdown_cell(kind, cell))
    return {"schema": SCHEMA, "kind": KIND, "mode": kind, "cells": records, "provenance": provenance()}


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "mha_rosetta.benchmarks.breakdown", measure, on_error=_cell_error,
                      spec_name="json breakdown spec")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
