"""``mha-rosetta bench --breakdown``: where each chosen cell's time goes (`benchmarks.breakdown`), its options
checked (refusing the sweep's own), and its outputs: the table on the terminal, ``--json``, ``--markdown``.

The cells are the bench's own (`sweep.expand_cells`, `decode_sweep.expand_decode_cells`: the same
``--backends``, sizes, ``--dtypes``, ``--threads``, ``--cpus``, ``--malloc``; without a size option the forward
takes the reference size). The benchmarks are imported only when called.
"""

from __future__ import annotations

import argparse
import json
import sys

from .bench_outputs import emit, terminal

# Options of a sweep that a breakdown does not take: named in the error, never ignored.
_NOT_FOR_BREAKDOWN = (
    ("rounds", "--rounds"), ("visits", "--visits"), ("resume", "--resume"), ("partial", "--partial"),
    ("baseline", "--baseline"), ("write_docs", "--write-docs"), ("plot", "--plot"), ("questions", "--questions"),
    ("questions_only", "--questions-only"), ("variants", "--variants"), ("list", "--list"),
)  # fmt: skip


def breakdown_cells(args: argparse.Namespace, forward_settings) -> tuple[str, list]:
    """(``"fwd"`` or ``"decode"``, the cells to break down) from the options; ValueError names a bad one.
    ``forward_settings(args)``: the forward sweep's settings (`cli.bench`'s, passed in: no import circle)."""
    from mha_rosetta.benchmarks.plan import resolve_implementations

    given = [flag for name, flag in _NOT_FOR_BREAKDOWN if getattr(args, name, None)]
    if given:
        raise ValueError(
            f"--breakdown does not take {', '.join(given)} (it times each chosen cell once, in one process)"
        )
    if args.mode not in ("fwd", "decode"):
        raise ValueError(
            f"--breakdown breaks down a forward (--mode fwd) or a decode step (--mode decode); got --mode {args.mode}"
        )
    if not args.backends:
        raise ValueError(
            "--breakdown needs --backends: the implementations to break down, e.g. --backends jax,jax-best"
        )
    if args.mode == "decode":
        from mha_rosetta.benchmarks.decode_sweep import expand_decode_cells

        from .bench_decode import decode_settings_of

        settings = decode_settings_of(args)
        labels = resolve_implementations(settings.implementations)
        return "decode", [cell for cell in expand_decode_cells(settings, labels) if cell.window is None]
    from mha_rosetta.benchmarks.sweep import expand_cells

    sized = any(getattr(args, name) for name in ("tokens", "batch", "d_model", "heads"))
    if args.preset is None and not args.quick and not sized:
        args.preset = "reference"  # one size, the reference one, unless told otherwise
    settings = forward_settings(args)
    return "fwd", expand_cells(settings, resolve_implementations(settings.implementations))


def run_breakdown(args: argparse.Namespace, forward_settings) -> int:
    """``--breakdown``: every chosen cell in its own pinned child, then the table and the files asked for."""
    from mha_rosetta.benchmarks.breakdown import run_breakdown as measure_all
    from mha_rosetta.benchmarks.breakdown_markdown import breakdown_markdown

    try:
        kind, cells = breakdown_cells(args, forward_settings)
    except (ValueError, OSError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2

    def progress(cell) -> None:
        if not args.no_progress:
            print(f"mha-rosetta bench --breakdown: {cell.implementation} ({kind})", file=sys.stderr, flush=True)

    report = measure_all(kind, cells, progress)
    table = breakdown_markdown(report)
    terminal(args).write(table)
    emit(args.json, json.dumps(report, indent=2, allow_nan=True) + "\n", label="JSON")
    emit(args.markdown, table, label="Markdown")
    failed = [cell for cell in report["cells"] if cell["status"] not in ("ok", "unsupported")]
    if failed:
        print(f"mha-rosetta bench: {len(failed)} breakdown cell(s) failed", file=sys.stderr)
    return 1 if failed else 0
