"""``mha-rosetta bench --mode decode``: its settings read from the options (refusing the forward sweep's own),
and its run: the decode sweep (`benchmarks.decode_sweep`), its outputs (`cli.bench_outputs`) and exit status.

The options themselves are `cli.bench`'s; the benchmarks are imported only when called.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .bench_outputs import exit_status, load_baseline, publish_decode
from .options import repeat_policy

# Options of the forward sweep that a decode sweep does not take: named in the error, never ignored.
_NOT_FOR_DECODE = (
    ("tokens", "--tokens (decode: --contexts)"), ("variants", "--variants"), ("questions", "--questions"),
    ("questions_only", "--questions-only"), ("memory_budget", "--memory-budget"), ("preset", "--preset"),
    ("visits", "--visits"),
)  # fmt: skip


def decode_settings_of(args: argparse.Namespace):
    from mha_rosetta.benchmarks.decode_settings import rows_left_out
    from mha_rosetta.benchmarks.decode_sweep import decode_settings
    from mha_rosetta.benchmarks.presets import DECODE_PRESETS

    given = [flag for name, flag in _NOT_FOR_DECODE if getattr(args, name, None)]
    if given:
        raise ValueError(
            f"--mode decode does not take {', '.join(given)} (it has --preset quick, --contexts and the shared options)"
        )
    for name, values in (
        ("--dtypes", args.dtypes),
        ("--batch", args.batch),
        ("--d-model", args.d_model),
        ("--heads", args.heads),
    ):
        if values is not None and len(values) != 1:
            raise ValueError(f"--mode decode takes one value of {name}, got {values}")
    name = "decode-quick" if args.quick else "decode"
    policy = repeat_policy(args, DECODE_PRESETS[name]["policy"])
    first = lambda values: None if values is None else values[0]  # noqa: E731
    given_contexts = dict(
        paged_contexts=args.contexts if args.contexts and DECODE_PRESETS[name].get("paged_contexts") else None,
        ragged_contexts=args.contexts if args.contexts and DECODE_PRESETS[name].get("ragged_contexts") else None,
        mla_contexts=args.contexts if args.contexts and DECODE_PRESETS[name].get("mla_contexts") else None,
        window_contexts=args.contexts,
    )
    return decode_settings(
        name, implementations=args.backends, contexts=args.contexts,
        **{**given_contexts, **rows_left_out(args.rows)},
        dtype=first(args.dtypes), devices=args.devices, threads=args.threads, cpus=args.cpus, policy=policy,
        malloc=args.malloc, rounds=args.rounds, seed=args.seed, batch=first(args.batch), d_model=first(args.d_model),
        heads=first(args.heads), plugins=args.plugin,
    )  # fmt: skip


def run_decode(args: argparse.Namespace) -> int:
    """``--mode decode``: the decode sweep (`benchmarks.decode_sweep.run_decode_sweep`) and its outputs."""
    from mha_rosetta.backends.registry import register_path
    from mha_rosetta.benchmarks.decode_sweep import (
        check_decode_partial,
        describe_decode_estimate,
        expand_decode_cells,
        run_decode_sweep,
    )
    from mha_rosetta.benchmarks.partial import default_partial_path
    from mha_rosetta.benchmarks.plan import resolve_implementations

    partial = Path(args.partial) if args.partial else default_partial_path(args.json)
    try:
        plugins = [register_path(path) for path in args.plugin or []]
        settings = decode_settings_of(args)
        labels = resolve_implementations(settings.implementations)
        baseline = load_baseline(args, "decode")
        if args.resume:
            check_decode_partial(partial)  # refused before anything is measured
    except (ValueError, ImportError, TypeError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    del plugins  # registered here (for the names) and again in every cell's process (settings.plugins)
    if args.list:
        print("\n".join(labels))
        return 0
    description = describe_decode_estimate(settings, expand_decode_cells(settings, labels))
    print(f"mha-rosetta bench: {description}", file=sys.stderr, flush=True)
    report = run_decode_sweep(settings, labels, progress=not args.no_progress, partial_path=partial, resume=args.resume)
    publish_decode(args, report, baseline)
    kept = None if report["complete"] else f"the finished cells are in the report and in {partial}"
    return exit_status(report, partial, kept)
