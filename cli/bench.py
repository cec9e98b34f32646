"""``mha-rosetta bench``: fair timings of every installed implementation, side by side.

Each cell runs in a fresh process pinned to ``--threads`` cores (default 1) by CPU
affinity and every thread knob, and is checked afterwards by CPU time / wall time.
``--malloc keep`` (the default) gives every cell and GEMM-peak process the same allocator
rule (`pinning.malloc_env`), so large temporaries cost the same in every framework.
A preset picks the sizes (``--preset quick``: under two minutes; ``default``: about ten;
``reference``: B=4, N=512, D=512, H=8, float32); any size option overrides the preset.
``--rounds R`` visits every cell once per round in a shuffled order (3 rounds for default
and reference, 1 for quick): medians pool every round, the range of the round medians is
the spread. ``--visits V`` visits every cell V times a round, each a fresh process, pooled
into the round's figure (2 for reference, 1 for the others: `benchmarks.rounds` says why).
The estimated duration is printed before the sweep starts.
Finished visits go to a partial file as they end, so an interrupted sweep can ``--resume``.
``--write-docs DIR`` writes DIR/bench/ and regenerates the benchmark block of DIR/benchmarks.md;
``--render JSON`` does the same from a saved report without measuring (`benchmarks.readme`).
``--breakdown`` says where each chosen cell's time goes, stage by stage, and what it copies (`cli.bench_breakdown`).
``--mode decode`` times one KV-cache decode step per implementation and context length
(``--contexts``) against the copy bandwidth measured in the same run (`benchmarks.decode`);
its ``--write-docs DIR`` writes DIR/bench/decode.{json,md}, the plot, and the README's decode block.
Exit status: 0 when every cell was measured or is unsupported here, 1 when a cell failed,
2 for bad arguments, 130 when interrupted (finished cells kept).

Here: the options, the forward sweep's settings and its run. The decode mode is `cli.bench_decode`; what
bench writes (tables, files, ``--baseline``, ``--render``, ``--compare``) and its exit status, `cli.bench_outputs`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .bench_outputs import (
    compare_only,
    exit_status,
    load_baseline,
    publish,
    publish_questions,
    render_only,
)
from .options import repeat_policy


def _variant_list(text: str) -> list[str]:
    from mha_rosetta.benchmarks.variants import BENCH_VARIANTS  # plain data

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in BENCH_VARIANTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names among {', '.join(BENCH_VARIANTS)}; got {text!r}")
    return names


def _variants_example() -> str:
    """``--variants``' example: plain and the first registry variant timed against it (`benchmarks.variants`)."""
    from mha_rosetta.benchmarks.variants import BASELINES, BENCH_VARIANTS, PLAIN  # plain data

    first = next(name for name, (_, base) in BENCH_VARIANTS.items() if base == PLAIN and name not in BASELINES)
    return f"{PLAIN},{first}"


def _row_list(text: str) -> list[str]:
    """``--rows``' names, checked against the decode rows when the settings are made (`decode_settings.rows_left_out`)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []  # not integers: the same error as no values
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 64,256; got {text!r}")
    return values


class _PresetAction(argparse.Action):
    """``--preset NAME``; ``quick`` sets the quick flag instead (what the deprecated ``--quick`` sets), so that
    both spellings give the same settings, the forward's and ``--mode decode``'s alike."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == "quick":
            namespace.quick = True
        else:
            setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mha_rosetta.benchmarks.presets import PRESETS  # plain data: nothing measured or imported

    from .options import add_backend_classes, add_choice, add_json, add_list, add_markdown, deprecated, mark_deprecated

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  mha-rosetta bench --preset quick\n"
        "  mha-rosetta bench --preset reference --json ref.json --markdown ref.md --plot plots/\n"
        "  mha-rosetta bench --backends numpy,numpy:slicing,torch-sdpa --tokens 128,512 --threads 2\n"
        "  mha-rosetta bench --preset quick --json new.json --baseline old.json\n"
        "  mha-rosetta bench --questions-only\n"
        "  mha-rosetta bench --preset reference --rounds 3 --write-docs docs\n"
        "  mha-rosetta bench --render docs/bench/reference.json --write-docs docs\n"
        "  mha-rosetta bench --mode decode --contexts 1024,8192 --backends numpy,torch\n"
        "  mha-rosetta bench --mode decode --write-docs docs\n"
        "implementation names: registry backends (numpy, torch, torch-sdpa, ...), optionally\n"
        "':strategy' (numpy:slicing, torch:per_head), or the groups main, strategies, all.\n"
        "Lists take commas or repeated options: --backends numpy,torch --backends jax."
    )
    preset = parser.add_mutually_exclusive_group()
    quick = preset.add_argument("--quick", action="store_true", help=deprecated("--preset quick"))
    mark_deprecated(quick, "--preset quick")
    preset.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=None,
        action=_PresetAction,
        help="size preset (default: default); quick: every installed implementation at two small sizes (< 2 min); "
        "long: B=1, H=8, D=512, 1k..32k tokens, memory budget, slopes",
    )
    add_list(
        parser,
        "--backends",
        old=("--implementations",),
        help="implementations or groups to time (default from the preset)",
    )
    parser.add_argument(
        "--variants",
        type=_variant_list,
        metavar="LIST",
        help="attention variants to time, each with its baseline (benchmarks.variants; default from the preset: "
        f"none; --preset variants: all of them), e.g. {_variants_example()}",
    )
    parser.add_argument("--tokens", type=_int_list, metavar="LIST", help="token counts, e.g. 64,256,1024")
    parser.add_argument("--batch", type=_int_list, metavar="LIST", help="batch sizes")
    parser.add_argument("--d-model", type=_int_list, metavar="LIST", help="model widths")
    parser.add_argument("--heads", type=_int_list, metavar="LIST", help="head counts (d_k = d_model / heads)")
    add_list(parser, "--dtypes", help="float64,float32,float16,bfloat16 (default float32)")
    add_list(parser, "--devices", help="cpu,gpu (default cpu, plus gpu where a driver is present)")
    parser.add_argument(
        "--threads", type=int, default=1, help="cores per cell, the same for every framework (default 1)"
    )
    parser.add_argument(
        "--cpus", type=_int_list, metavar="LIST", help="which cores to pin to (default: the last --threads cores)"
    )
    parser.add_argument(
        "--malloc",
        choices=("keep", "default"),
        default="keep",
        help="allocator rule for every measured process: 'keep' raises glibc's mmap and trim thresholds "
        "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) to 4 GiB and keeps every thread in the main arena "
        "(MALLOC_ARENA_MAX=1) so that large buffers are reused instead "
        "of faulted in afresh on every call, the same for every framework; 'default' leaves the "
        "environment as it is (default: keep)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="R",
        help="visit every cell once per round, in a shuffled order, R rounds; a cell's median pools all its "
        "samples and the range of its round medians is its spread (default: 3 for default and reference, "
        "1 for quick)",
    )
    parser.add_argument(
        "--visits",
        type=int,
        metavar="V",
        help="visit every cell V times a round, each a fresh process, and pool them into the round's figure "
        "(a cell's speed changes from one process to the next: more processes narrow its median; default: 2 for "
        "reference, 1 for the others; not for --mode decode)",
    )
    parser.add_argument("--seed", type=int, metavar="S", help="the shuffle seed (default: drawn, and recorded)")
    add_choice(
        parser,
        "--mode",
        choices=("fwd", "grad", "both", "decode"),
        renamed={"grad": "fwdbwd"},  # the cells' and the JSON's name of forward+backward (`benchmarks.flops.MODES`)
        old={"fwdbwd": "grad"},
        default="fwd",
        help="time the forward pass (default), forward+backward (grad; run_vjp: a training step's attention, FLOPs "
        "counted as 3x the forward's matrix products), or both, side by side; decode: one KV-cache decode "
        "step per context length against the memory bandwidth (B=1, d_model 2048, 16 heads, 4 kv heads, "
        "d_k 128, no biases, float32, 1k..32k tokens and a windowed row; --preset quick: a small layer at 256 and "
        "1024)",
    )
    parser.add_argument(
        "--contexts",
        type=_int_list,
        metavar="LIST",
        help="--mode decode: the cached tokens of each timed step, e.g. 1024,4096, for the full and the windowed "
        "row alike (default from the preset)",
    )
    parser.add_argument(
        "--rows",
        type=_row_list,
        metavar="LIST",
        help="--mode decode: which rows to time, among main (always), window, paged, ragged and mla (default: all; "
        "the full preset runs 80-90 minutes on one core, the main and window rows about 20)",
    )
    add_backend_classes(
        parser,
        dest="plugin",
        old=("--plugin",),
        help="--mode decode: register the Backend subclass at this import path, here and in every cell's "
        "process (name it in --backends by its name)",
    )
    parser.add_argument("--repeats", type=int, metavar="N", help="minimum timed repeats per cell (per round)")
    parser.add_argument("--min-time", type=float, metavar="S", help="minimum timed seconds per cell")
    add_json(parser, help="write the versioned JSON report to PATH ('-' for stdout)")
    add_markdown(parser, what="the table")
    parser.add_argument(
        "--plot", metavar="DIR", help="write PNG plots (time vs tokens, GFLOP/s at the reference size) to DIR"
    )
    parser.add_argument(
        "--baseline",
        metavar="PATH",
        help="compare with a saved JSON report of the same kind (--mode decode: a decode report); a change "
        "counts when the medians differ by more than 10%% and the round ranges do not overlap",
    )
    parser.add_argument(
        "--write-docs",
        metavar="DIR",
        help="write DIR/bench/<preset>[-tN].json, .md and plots, and regenerate the benchmark block of "
        "DIR/benchmarks.md from DIR/bench/reference*.json",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="measure nothing: read a saved report and write its table, plots, --baseline and --write-docs output",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="measure nothing: do two saved runs agree? every cell's figure (drift-corrected where recorded) "
        "within 5%% between A and B, and each cell-run's round figures within 10%% on at least 36 of 38 "
        "cell-runs; exit 0 when both targets are met, 1 when not",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished cells of an interrupted sweep and run the rest (forward or --mode decode, each from "
        "its own partial file; a decode sweep resumes only on the machine that started it)",
    )
    parser.add_argument(
        "--partial", metavar="PATH", help="where finished cells are kept while running (default: <json>.partial.jsonl)"
    )
    parser.add_argument(
        "--questions", action="store_true", help="also answer the article's speed claims (benchmark questions)"
    )
    parser.add_argument("--questions-only", action="store_true", help="answer the speed questions only, no sweep")
    parser.add_argument(
        "--memory-budget",
        type=float,
        metavar="MB",
        help="skip cells whose predicted peak memory exceeds MB (default: half the available memory, at most 8192)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list", action="store_true", help="list the implementations a sweep would run, then exit")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="where each cell's time goes: every stage timed by cutting the program after it, and the copies, "
        "transposes, allocations and recompiles its framework reports (cli.bench_breakdown; --mode fwd or decode; "
        "needs --backends; the forward at the reference size unless sizes are given)",
    )


def _settings(args: argparse.Namespace):
    from mha_rosetta.benchmarks.sweep import preset_settings

    name = "quick" if args.quick else (args.preset or "default")
    policy = repeat_policy(args, preset_settings(name).policy)
    if args.visits is not None and args.visits < 1:
        raise ValueError(f"--visits must be a positive int, got {args.visits}")
    return preset_settings(
        name,
        implementations=args.backends,
        tokens=args.tokens,
        batch=args.batch,
        d_model=args.d_model,
        heads=args.heads,
        dtypes=args.dtypes,
        devices=args.devices,
        threads=args.threads,
        cpus=args.cpus,
        policy=policy,
        malloc=args.malloc,
        rounds=args.rounds,
        visits=args.visits,
        seed=args.seed,
        memory_budget_mb=args.memory_budget,
        modes=["fwd", "fwdbwd"] if args.mode == "both" else [args.mode],
        variants=args.variants,
    )


def _speed_questions(settings) -> list[dict]:
    """The speed questions (`benchmarks.questions`) at the sweep's threads and cores, quick with the quick preset."""
    from mha_rosetta.benchmarks.questions import run_speed_questions

    return run_speed_questions(threads=settings.threads, quick=settings.preset == "quick", cpus=settings.cpus)


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.benchmarks.partial import default_partial_path, partial_header
    from mha_rosetta.benchmarks.plan import resolve_implementations
    from mha_rosetta.benchmarks.progress import describe_estimate, estimate_seconds
    from mha_rosetta.benchmarks.report import assemble_report
    from mha_rosetta.benchmarks.sweep import expand_cells, run_sweep

    if args.render:
        return render_only(args)
    if args.compare:
        return compare_only(args)
    if args.breakdown:
        from .bench_breakdown import run_breakdown

        return run_breakdown(args, _settings)
    if args.mode == "decode":
        from .bench_decode import run_decode

        return run_decode(args)
    decode_only = [flag for flag, value in (("--contexts", args.contexts), ("--rows", args.rows)) if value]
    if decode_only:
        print(
            f"mha-rosetta bench: {', '.join(decode_only)} is for --mode decode, got --mode {args.mode}", file=sys.stderr
        )
        return 2
    try:
        settings = _settings(args)
        labels = resolve_implementations(settings.implementations)
        baseline = load_baseline(args, "forward")
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(labels))
        return 0
    if args.questions_only:
        return publish_questions(args, _speed_questions(settings))

    partial = Path(args.partial) if args.partial else default_partial_path(args.json)
    if args.resume and (partial_header(partial) or {}).get("kind") == "decode":
        print(
            f"mha-rosetta bench: --resume: {partial} holds a decode sweep's finished cells, not a forward sweep's "
            "(resume it with --mode decode, or run without --resume)",
            file=sys.stderr,
        )
        return 2
    estimate = estimate_seconds(settings, expand_cells(settings, labels))
    print(f"mha-rosetta bench: {describe_estimate(estimate)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    outcome = run_sweep(
        settings, partial_path=partial, resume=args.resume, progress=not args.no_progress, implementations=labels
    )
    report = assemble_report(
        outcome.settings.as_dict(), outcome.gemm_peaks, outcome.cells, complete=not outcome.interrupted,
        rounds=outcome.rounds,
    )  # fmt: skip
    report["settings"]["resumed_cells"] = outcome.resumed_cells
    report["sweep_time"] = {"estimated_s": estimate["total_s"], "wall_s": time.perf_counter() - started}
    if args.questions and not outcome.interrupted:
        try:
            report["questions"] = _speed_questions(settings)
        except KeyboardInterrupt:
            outcome.interrupted = True
            report["complete"] = False

    publish(args, report, baseline)
    kept = f"{len(outcome.cells)} finished cells kept in {partial}" if outcome.interrupted else None
    return exit_status(report, partial, kept)
