"""``mha-rosetta bench``: fair timings of every installed implementation, side by side.

Each cell runs in a fresh process pinned to ``--threads`` cores (default 1) by CPU
affinity and every thread knob, and is checked afterwards by CPU time / wall time.
``--malloc keep`` (the default) gives every cell and GEMM-peak process the same allocator
rule (`pinning.malloc_env`), so large temporaries cost the same in every framework.
A preset picks the sizes (``--quick``: under two minutes; ``default``: about ten;
``reference``: B=4, N=512, D=512, H=8, float32); any size option overrides the preset.
Finished cells go to a partial file as they end, so an interrupted sweep can ``--resume``.
Exit status: 0 when every cell was measured or is unsupported here, 1 when a cell failed,
2 for bad arguments, 130 when interrupted (finished cells kept).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 64,256; got {text!r}"
        ) from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 64,256; got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  mha-rosetta bench --quick\n"
        "  mha-rosetta bench --preset reference --json ref.json --markdown ref.md --plot plots/\n"
        "  mha-rosetta bench --implementations numpy,numpy:slicing,torch-sdpa --tokens 128,512 --threads 2\n"
        "  mha-rosetta bench --quick --json new.json --baseline old.json\n"
        "  mha-rosetta bench --questions-only\n"
        "implementation names: registry backends (numpy, torch, torch-sdpa, ...), optionally\n"
        "':strategy' (numpy:slicing, torch:per_head), or the groups main, strategies, all."
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        action="store_true",
        help="the quick preset: every installed implementation at two small sizes (< 2 min)",
    )
    preset.add_argument(
        "--preset", choices=("quick", "default", "reference", "gpu"), default=None, help="size preset (default: default)"
    )
    parser.add_argument(
        "--implementations",
        type=_name_list,
        metavar="LIST",
        help="comma-separated implementations or groups (default from the preset)",
    )
    parser.add_argument("--tokens", type=_int_list, metavar="LIST", help="token counts, e.g. 64,256,1024")
    parser.add_argument("--batch", type=_int_list, metavar="LIST", help="batch sizes")
    parser.add_argument("--d-model", type=_int_list, metavar="LIST", help="model widths")
    parser.add_argument("--heads", type=_int_list, metavar="LIST", help="head counts (d_k = d_model / heads)")
    parser.add_argument(
        "--dtypes", type=_name_list, metavar="LIST", help="float64,float32,float16,bfloat16 (default float32)"
    )
    parser.add_argument(
        "--devices", type=_name_list, metavar="LIST", help="cpu,gpu (default cpu, plus gpu where a driver is present)"
    )
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
        "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) to 4 GiB so that large buffers are reused instead "
        "of faulted in afresh on every call, the same for every framework; 'default' leaves the "
        "environment as it is (default: keep)",
    )
    parser.add_argument("--repeats", type=int, metavar="N", help="minimum timed repeats per cell")
    parser.add_argument("--min-time", type=float, metavar="S", help="minimum timed seconds per cell")
    parser.add_argument("--json", metavar="PATH", help="write the versioned JSON report to PATH ('-' for stdout)")
    parser.add_argument("--markdown", metavar="PATH", help="write the Markdown table to PATH")
    parser.add_argument(
        "--plot", metavar="DIR", help="write PNG plots (time vs tokens, GFLOP/s at the reference size) to DIR"
    )
    parser.add_argument(
        "--baseline", metavar="PATH", help="compare with a saved JSON report; flags changes beyond 10%%"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the finished cells of an interrupted sweep and run the rest"
    )
    parser.add_argument(
        "--partial", metavar="PATH", help="where finished cells are kept while running (default: <json>.partial.jsonl)"
    )
    parser.add_argument(
        "--questions", action="store_true", help="also answer the seed's speed claims (benchmark questions)"
    )
    parser.add_argument("--questions-only", action="store_true", help="answer the speed questions only, no sweep")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list", action="store_true", help="list the implementations a sweep would run, then exit")


def _settings(args: argparse.Namespace):
    from mha_rosetta.benchmarks.sweep import preset_settings

    name = "quick" if args.quick else (args.preset or "default")
    base = preset_settings(name)
    policy = dict(base.policy)
    if args.repeats is not None:
        policy["min_repeats"] = args.repeats
        policy["max_repeats"] = max(policy.get("max_repeats", args.repeats), args.repeats)
    if args.min_time is not None:
        policy["min_time"] = args.min_time
        policy["max_time"] = max(policy.get("max_time", args.min_time), args.min_time)
    return preset_settings(
        name,
        implementations=args.implementations,
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
    )


def _emit(path: str | None, text: str, *, label: str) -> None:
    from mha_rosetta.core.files import write_output

    if path is None:
        return
    write_output(path, text)
    if path != "-":
        print(f"{label} written to {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.benchmarks import questions as speed_questions
    from mha_rosetta.benchmarks.report import (
        assemble_report,
        baseline_markdown,
        compare_to_baseline,
        failed_cells,
        load_report,
        markdown_table,
        plot_report,
    )
    from mha_rosetta.benchmarks.sweep import default_partial_path, resolve_implementations, run_sweep

    try:
        settings = _settings(args)
        labels = resolve_implementations(settings.implementations)
        baseline = load_report(args.baseline) if args.baseline else None
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(labels))
        return 0
    # With the JSON on stdout, everything for people goes to stderr.
    human = sys.stderr if args.json == "-" else sys.stdout

    if args.questions_only:
        answers = speed_questions.run_speed_questions(
            threads=settings.threads, quick=settings.preset == "quick", cpus=settings.cpus
        )
        human.write(speed_questions.questions_markdown(answers))
        _emit(args.json, json.dumps({"schema": 1, "questions": answers}, indent=2) + "\n", label="JSON")
        return 0

    partial = Path(args.partial) if args.partial else default_partial_path(args.json)
    outcome = run_sweep(
        settings, partial_path=partial, resume=args.resume, progress=not args.no_progress, implementations=labels
    )
    report = assemble_report(settings.as_dict(), outcome.gemm_peaks, outcome.cells, complete=not outcome.interrupted)
    report["settings"]["resumed_cells"] = outcome.resumed_cells
    if args.questions and not outcome.interrupted:
        try:
            report["questions"] = speed_questions.run_speed_questions(
                threads=settings.threads, quick=settings.preset == "quick", cpus=settings.cpus
            )
        except KeyboardInterrupt:
            outcome.interrupted = True
            report["complete"] = False

    table = markdown_table(report)
    if baseline is not None:
        try:
            report["baseline_comparison"] = compare_to_baseline(report, baseline)
            table += "\n" + baseline_markdown(report["baseline_comparison"])
        except ValueError as error:
            print(f"mha-rosetta bench: baseline not compared: {error}", file=sys.stderr)
    if report.get("questions"):
        table += "\nSpeed questions (the seed's claims):\n\n" + speed_questions.questions_markdown(report["questions"])

    human.write(table)
    _emit(args.json, json.dumps(report, indent=2, allow_nan=True) + "\n", label="JSON")
    _emit(args.markdown, table, label="Markdown")
    if args.plot:
        try:
            for path in plot_report(report, args.plot):
                print(f"plot written to {path}", file=sys.stderr)
        except ImportError:
            print(
                "mha-rosetta bench: no plots: matplotlib is not installed (pip install 'mha-rosetta[bench]')",
                file=sys.stderr,
            )

    if outcome.interrupted:
        print(
            f"interrupted: {len(outcome.cells)} finished cells kept in {partial}; rerun with --resume to finish",
            file=sys.stderr,
        )
        return 130
    partial.unlink(missing_ok=True)  # the report holds everything now
    failures = failed_cells(report)
    if failures:
        print(f"mha-rosetta bench: {len(failures)} cell(s) failed (see the status column)", file=sys.stderr)
        return 1
    return 0
