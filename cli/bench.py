"""``mha-rosetta bench``: fair timings of every installed implementation, side by side.

Each cell runs in a fresh process pinned to ``--threads`` cores (default 1) by CPU
affinity and every thread knob, and is checked afterwards by CPU time / wall time.
``--malloc keep`` (the default) gives every cell and GEMM-peak process the same allocator
rule (`pinning.malloc_env`), so large temporaries cost the same in every framework.
A preset picks the sizes (``--quick``: under two minutes; ``default``: about ten;
``reference``: B=4, N=512, D=512, H=8, float32); any size option overrides the preset.
``--rounds R`` visits every cell once per round in a shuffled order (3 rounds for default
and reference, 1 for quick): medians pool every round, the range of the round medians is
the spread. ``--visits V`` visits every cell V times a round, each a fresh process, pooled
into the round's figure (2 for reference, 1 for the others: `benchmarks.rounds` says why).
The estimated duration is printed before the sweep starts.
Finished visits go to a partial file as they end, so an interrupted sweep can ``--resume``.
``--write-docs DIR`` writes DIR/bench/ and regenerates the benchmark block of DIR/benchmarks.md;
``--render JSON`` does the same from a saved report without measuring (`benchmarks.readme`).
``--mode decode`` times one KV-cache decode step per implementation and context length
(``--contexts``) against the copy bandwidth measured in the same run (`benchmarks.decode`);
its ``--write-docs DIR`` writes DIR/bench/decode.{json,md}, the plot, and the README's decode block.
Exit status: 0 when every cell was measured or is unsupported here, 1 when a cell failed,
2 for bad arguments, 130 when interrupted (finished cells kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _variant_list(text: str) -> list[str]:
    from mha_rosetta.benchmarks.variants import BENCH_VARIANTS  # plain data

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in BENCH_VARIANTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names among {', '.join(BENCH_VARIANTS)}; got {text!r}")
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []  # not integers: the same error as no values
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 64,256; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mha_rosetta.benchmarks.presets import PRESETS  # plain data: nothing measured or imported

    from .options import add_list, add_markdown

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  mha-rosetta bench --quick\n"
        "  mha-rosetta bench --preset reference --json ref.json --markdown ref.md --plot plots/\n"
        "  mha-rosetta bench --backends numpy,numpy:slicing,torch-sdpa --tokens 128,512 --threads 2\n"
        "  mha-rosetta bench --quick --json new.json --baseline old.json\n"
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
    preset.add_argument(
        "--quick",
        action="store_true",
        help="the quick preset: every installed implementation at two small sizes (< 2 min)",
    )
    preset.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=None,
        help="size preset (default: default); long: B=1, H=8, D=512, 1k..32k tokens, memory budget, slopes",
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
        "none; --preset variants: all of them), e.g. plain,softcap",
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
    parser.add_argument(
        "--mode",
        choices=("fwd", "fwdbwd", "both", "decode"),
        default="fwd",
        help="time the forward pass (default), forward+backward (run_vjp: a training step's attention, FLOPs "
        "counted as 3x the forward's matrix products), or both, side by side; decode: one KV-cache decode "
        "step per context length against the memory bandwidth (B=1, d_model 2048, 16 heads, 4 kv heads, "
        "d_k 128, no biases, float32, 1k..32k tokens and a windowed row; --quick: a small layer at 256 and 1024)",
    )
    parser.add_argument(
        "--contexts",
        type=_int_list,
        metavar="LIST",
        help="--mode decode: the cached tokens of each timed step, e.g. 1024,4096, for the full and the windowed "
        "row alike (default from the preset)",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE:CLASS",
        help="--mode decode: register the Backend subclass at this import path, here and in every cell's "
        "process (name it in --backends by its name)",
    )
    parser.add_argument("--repeats", type=int, metavar="N", help="minimum timed repeats per cell (per round)")
    parser.add_argument("--min-time", type=float, metavar="S", help="minimum timed seconds per cell")
    parser.add_argument("--json", metavar="PATH", help="write the versioned JSON report to PATH ('-' for stdout)")
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


def _policy(args: argparse.Namespace, preset: dict) -> dict:
    """The preset's repeat policy with ``--repeats`` and ``--min-time`` (each raising its maximum to match),
    after ``--rounds`` is checked: the same for the forward and the decode sweep."""
    policy = dict(preset)
    if args.repeats is not None:
        policy["min_repeats"] = args.repeats
        policy["max_repeats"] = max(policy.get("max_repeats", args.repeats), args.repeats)
    if args.min_time is not None:
        policy["min_time"] = args.min_time
        policy["max_time"] = max(policy.get("max_time", args.min_time), args.min_time)
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(f"--rounds must be a positive int, got {args.rounds}")
    return policy


def _settings(args: argparse.Namespace):
    from mha_rosetta.benchmarks.sweep import preset_settings

    name = "quick" if args.quick else (args.preset or "default")
    policy = _policy(args, preset_settings(name).policy)
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


def _emit(path: str | None, text: str, *, label: str) -> None:
    from mha_rosetta.core.files import write_output

    if path is None:
        return
    write_output(path, text)
    if path != "-":
        print(f"{label} written to {path}", file=sys.stderr)


def _render_only(args: argparse.Namespace) -> int:
    """``--render JSON``: the outputs of a saved report, nothing measured."""
    from mha_rosetta.benchmarks.baseline import report_kind
    from mha_rosetta.benchmarks.report import load_report

    try:
        report = load_report(args.render)
        baseline = _load_baseline(args, report_kind(report))
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    report.pop("baseline_comparison", None)  # compared again below when asked
    if report.get("kind") == "decode":
        _publish_decode(args, report, baseline)
        return 0
    _publish(args, report, baseline)
    return 0


def _compare_only(args: argparse.Namespace) -> int:
    """``--compare A B``: the run and round agreement of two saved reports (`benchmarks.rerun`)."""
    from mha_rosetta.benchmarks.report import load_report
    from mha_rosetta.benchmarks.rerun import compare_markdown, compare_runs

    try:
        first, second = (load_report(path) for path in args.compare)
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    try:
        comparison = compare_runs(first, second)
    except ValueError as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    (sys.stderr if args.json == "-" else sys.stdout).write(compare_markdown(comparison))
    _emit(args.json, json.dumps(comparison, indent=2) + "\n", label="JSON")
    return 0 if comparison["targets_met"] else 1


def _publish(args: argparse.Namespace, report: dict, baseline: dict | None) -> str:
    """Print the table and write every file asked for (JSON, Markdown, plots, docs); returns the table."""
    from mha_rosetta.benchmarks import questions as speed_questions
    from mha_rosetta.benchmarks.markdown import markdown_table

    table = markdown_table(report) + _baseline_text(report, baseline)
    if len({cell.get("tokens") for cell in report["cells"]}) > 1:
        from mha_rosetta.benchmarks.long import long_markdown

        table += "\n" + long_markdown(report["cells"])
    if report.get("questions"):
        questions = speed_questions.questions_markdown(report["questions"])
        table += "\nSpeed questions (the column/row-sample article's claims):\n\n" + questions

    def plots(directory: str):
        from mha_rosetta.benchmarks.plots import plot_report

        yield from plot_report(report, directory)
        if report["settings"].get("preset") == "long":
            from mha_rosetta.benchmarks.long import plot_long

            yield from plot_long(report["cells"], directory)

    def docs(directory: str):
        from mha_rosetta.benchmarks.readme import write_docs

        return write_docs(report, directory, table=table)

    return _write_outputs(args, report, table, plots, docs)


def _baseline_text(report: dict, baseline: dict | None) -> str:
    """``--baseline``'s comparison (`benchmarks.baseline`), kept in the report, as the lines the table ends with."""
    from mha_rosetta.benchmarks.baseline import baseline_markdown, compare_to_baseline

    if baseline is None:
        return ""
    try:
        report["baseline_comparison"] = compare_to_baseline(report, baseline)
    except ValueError as error:
        print(f"mha-rosetta bench: baseline not compared: {error}", file=sys.stderr)
        return ""
    return "\n" + baseline_markdown(report["baseline_comparison"])


def _write_outputs(args: argparse.Namespace, report: dict, table: str, plots, docs) -> str:
    """The output tail of a forward or decode report: the table on the terminal (stderr when the JSON or the
    Markdown goes to stdout), the JSON and the Markdown, then ``plots(DIR)`` and ``docs(DIR)`` (each yields the
    paths it wrote) for ``--plot`` and ``--write-docs``; returns the table."""
    human = (
        sys.stderr if "-" in (args.json, args.markdown) else sys.stdout
    )  # with the JSON on stdout, people read stderr
    human.write(table)
    _emit(args.json, json.dumps(report, indent=2, allow_nan=True) + "\n", label="JSON")
    _emit(args.markdown, table, label="Markdown")
    try:
        if args.plot:
            for path in plots(args.plot):
                print(f"plot written to {path}", file=sys.stderr)
        if args.write_docs:
            for path in docs(args.write_docs):
                print(f"written: {path}", file=sys.stderr)
    except ImportError:
        print(
            "mha-rosetta bench: no plots: matplotlib is not installed (pip install 'mha-rosetta[bench]')",
            file=sys.stderr,
        )
    return table


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.benchmarks import questions as speed_questions
    from mha_rosetta.benchmarks.partial import default_partial_path, partial_header
    from mha_rosetta.benchmarks.plan import resolve_implementations
    from mha_rosetta.benchmarks.progress import describe_estimate, estimate_seconds
    from mha_rosetta.benchmarks.report import assemble_report
    from mha_rosetta.benchmarks.sweep import expand_cells, run_sweep

    if args.render:
        return _render_only(args)
    if args.compare:
        return _compare_only(args)
    if args.mode == "decode":
        return _run_decode(args)
    try:
        settings = _settings(args)
        labels = resolve_implementations(settings.implementations)
        baseline = _load_baseline(args, "forward")
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(labels))
        return 0
    human = sys.stderr if "-" in (args.json, args.markdown) else sys.stdout

    if args.questions_only:
        from mha_rosetta.benchmarks.provenance import provenance

        answers = speed_questions.run_speed_questions(
            threads=settings.threads, quick=settings.preset == "quick", cpus=settings.cpus
        )
        human.write(speed_questions.questions_markdown(answers))
        _emit(
            args.json,
            json.dumps({"schema": 1, "questions": answers, "provenance": provenance()}, indent=2) + "\n",
            label="JSON",
        )
        return 0

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
            report["questions"] = speed_questions.run_speed_questions(
                threads=settings.threads, quick=settings.preset == "quick", cpus=settings.cpus
            )
        except KeyboardInterrupt:
            outcome.interrupted = True
            report["complete"] = False

    _publish(args, report, baseline)
    kept = f"{len(outcome.cells)} finished cells kept in {partial}" if outcome.interrupted else None
    return _exit_status(report, partial, kept)


def _exit_status(report: dict, partial: Path, interrupted: str | None) -> int:
    """How a sweep ends, forward or decode: interrupted (``interrupted`` says what was kept where), or the partial
    file removed (the report holds everything now) and 1 when a cell failed, else 0."""
    from mha_rosetta.benchmarks.report import failed_cells
    from mha_rosetta.core.errors import INTERRUPTED

    if interrupted is not None:
        print(f"interrupted: {interrupted}; rerun with --resume to finish", file=sys.stderr)
        return INTERRUPTED
    partial.unlink(missing_ok=True)
    failures = failed_cells(report)
    if failures:
        print(f"mha-rosetta bench: {len(failures)} cell(s) failed (see the status column)", file=sys.stderr)
        return 1
    return 0


def _load_baseline(args: argparse.Namespace, kind: str) -> dict | None:
    """``--baseline``'s report, refused before anything is measured when it is not a ``kind`` report."""
    from mha_rosetta.benchmarks.baseline import report_kind
    from mha_rosetta.benchmarks.report import load_report

    if not args.baseline:
        return None
    baseline = load_report(args.baseline)
    if report_kind(baseline) != kind:
        raise ValueError(
            f"--baseline: {args.baseline} is a {report_kind(baseline)} bench report and this is a {kind} one, "
            f"which is compared only with a {kind} baseline (a decode step and a forward share no cell)"
        )
    return baseline


# Options of the forward sweep that a decode sweep does not take: named in the error, never ignored.
_NOT_FOR_DECODE = (
    ("tokens", "--tokens (decode: --contexts)"), ("variants", "--variants"), ("questions", "--questions"),
    ("questions_only", "--questions-only"), ("memory_budget", "--memory-budget"), ("preset", "--preset"),
    ("visits", "--visits"),
)  # fmt: skip


def _decode_settings(args: argparse.Namespace):
    from mha_rosetta.benchmarks.decode_sweep import decode_settings
    from mha_rosetta.benchmarks.presets import DECODE_PRESETS

    given = [flag for name, flag in _NOT_FOR_DECODE if getattr(args, name, None)]
    if given:
        raise ValueError(
            f"--mode decode does not take {', '.join(given)} (it has --quick, --contexts and the shared options)"
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
    policy = _policy(args, DECODE_PRESETS[name]["policy"])
    first = lambda values: None if values is None else values[0]  # noqa: E731
    return decode_settings(
        name, implementations=args.backends, contexts=args.contexts, window_contexts=args.contexts,
        dtype=first(args.dtypes), devices=args.devices, threads=args.threads, cpus=args.cpus, policy=policy,
        malloc=args.malloc, rounds=args.rounds, seed=args.seed, batch=first(args.batch), d_model=first(args.d_model),
        heads=first(args.heads), plugins=args.plugin,
    )  # fmt: skip


def _publish_decode(args: argparse.Namespace, report: dict, baseline: dict | None = None) -> str:
    """The decode table on the terminal (with the baseline comparison where one is given), and every file asked
    for (JSON, Markdown, the plot, the docs)."""
    from mha_rosetta.benchmarks.markdown import decode_markdown

    table = decode_markdown(report) + _baseline_text(report, baseline)

    def plots(directory: str):
        from mha_rosetta.benchmarks.plots import plot_decode

        return plot_decode(report, directory)

    def docs(directory: str):
        from mha_rosetta.benchmarks.decode_docs import write_decode_docs

        return write_decode_docs(report, directory, table=table)

    return _write_outputs(args, report, table, plots, docs)


def _run_decode(args: argparse.Namespace) -> int:
    """``--mode decode``: the decode sweep (`benchmarks.decode_sweep.run_decode_sweep`) and its outputs."""
    from mha_rosetta.backends.registry import register_path
    from mha_rosetta.benchmarks.decode_sweep import (
        check_decode_partial,
        estimate_decode_seconds,
        expand_decode_cells,
        run_decode_sweep,
    )
    from mha_rosetta.benchmarks.partial import default_partial_path
    from mha_rosetta.benchmarks.plan import resolve_implementations
    from mha_rosetta.benchmarks.provenance import host_id

    partial = Path(args.partial) if args.partial else default_partial_path(args.json)
    try:
        plugins = [register_path(path) for path in args.plugin or []]
        settings = _decode_settings(args)
        labels = resolve_implementations(settings.implementations)
        baseline = _load_baseline(args, "decode")
        if args.resume:
            check_decode_partial(partial, host_id())  # refused before anything is measured
    except (ValueError, ImportError, TypeError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    del plugins  # registered here (for the names) and again in every cell's process (settings.plugins)
    if args.list:
        print("\n".join(labels))
        return 0
    cells = expand_decode_cells(settings, labels)
    total = estimate_decode_seconds(settings, cells)
    when = f"{total / 60:.1f} min" if total >= 90 else f"{total:.0f} s"
    print(
        f"mha-rosetta bench: decode, {len(cells)} cells x {settings.rounds} round(s) after each round's copy "
        f"bandwidth: about {when} (estimated from the repeat policy and typical start-up times)",
        file=sys.stderr,
        flush=True,
    )
    report = run_decode_sweep(settings, labels, progress=not args.no_progress, partial_path=partial, resume=args.resume)
    _publish_decode(args, report, baseline)
    kept = None if report["complete"] else f"the finished cells are in the report and in {partial}"
    return _exit_status(report, partial, kept)
