"""What ``mha-rosetta bench`` writes and how it ends: the table on the terminal, the JSON, the Markdown, the
plots and the docs of a forward or decode report (written once, `write_outputs`), ``--baseline``'s comparison,
``--render`` and ``--compare`` (nothing measured), and the exit status of a sweep.

The argument parsing and the sweeps are `cli.bench`; everything here imports the benchmarks only when called.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def terminal(args: argparse.Namespace):
    """Where people read the table: stderr when the JSON or the Markdown goes to stdout, else stdout."""
    return sys.stderr if "-" in (args.json, args.markdown) else sys.stdout


def publish_questions(args: argparse.Namespace, answers: list[dict]) -> int:
    """``--questions-only``: the answers on the terminal, and as JSON (with provenance) where asked."""
    from mha_rosetta.benchmarks.provenance import provenance
    from mha_rosetta.benchmarks.questions import questions_markdown

    terminal(args).write(questions_markdown(answers))
    document = {"schema": 1, "questions": answers, "provenance": provenance()}
    emit(args.json, json.dumps(document, indent=2) + "\n", label="JSON")
    return 0


def emit(path: str | None, text: str, *, label: str) -> None:
    from mha_rosetta.core.files import write_output

    if path is None:
        return
    write_output(path, text)
    if path != "-":
        print(f"{label} written to {path}", file=sys.stderr)


def render_only(args: argparse.Namespace) -> int:
    """``--render JSON``: the outputs of a saved report, nothing measured."""
    from mha_rosetta.benchmarks.baseline import report_kind
    from mha_rosetta.benchmarks.report import load_report

    try:
        report = load_report(args.render)
        baseline = load_baseline(args, report_kind(report))
    except (ValueError, OSError, json.JSONDecodeError) as error:
        print(f"mha-rosetta bench: {error}", file=sys.stderr)
        return 2
    report.pop("baseline_comparison", None)  # compared again below when asked
    if report.get("kind") == "decode":
        publish_decode(args, report, baseline)
        return 0
    publish(args, report, baseline)
    return 0


def compare_only(args: argparse.Namespace) -> int:
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
    emit(args.json, json.dumps(comparison, indent=2) + "\n", label="JSON")
    return 0 if comparison["targets_met"] else 1


def publish(args: argparse.Namespace, report: dict, baseline: dict | None) -> str:
    """Print the table and write every file asked for (JSON, Markdown, plots, docs); returns the table."""
    from mha_rosetta.benchmarks import questions as speed_questions
    from mha_rosetta.benchmarks.markdown import markdown_table

    table = markdown_table(report) + baseline_text(report, baseline)
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
        from mha_rosetta.benchmarks.publish import write_docs

        return write_docs(report, directory, table=table)

    return write_outputs(args, report, table, plots, docs)


def baseline_text(report: dict, baseline: dict | None) -> str:
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


def write_outputs(args: argparse.Namespace, report: dict, table: str, plots, docs) -> str:
    """The output tail of a forward or decode report: the table on the terminal (stderr when the JSON or the
    Markdown goes to stdout), the JSON and the Markdown, then ``plots(DIR)`` and ``docs(DIR)`` (each yields the
    paths it wrote) for ``--plot`` and ``--write-docs``; returns the table."""
    terminal(args).write(table)
    emit(args.json, json.dumps(report, indent=2, allow_nan=True) + "\n", label="JSON")
    emit(args.markdown, table, label="Markdown")
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


def exit_status(report: dict, partial: Path, interrupted: str | None) -> int:
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


def load_baseline(args: argparse.Namespace, kind: str) -> dict | None:
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


def publish_decode(args: argparse.Namespace, report: dict, baseline: dict | None = None) -> str:
    """The decode table on the terminal (with the baseline comparison where one is given), and every file asked
    for (JSON, Markdown, the plot, the docs)."""
    from mha_rosetta.benchmarks.markdown import decode_markdown

    table = decode_markdown(report) + baseline_text(report, baseline)

    def plots(directory: str):
        from mha_rosetta.benchmarks.plots import plot_decode

        return plot_decode(report, directory)

    def docs(directory: str):
        from mha_rosetta.benchmarks.decode_docs import write_decode_docs

        return write_decode_docs(report, directory, table=table)

    return write_outputs(args, report, table, plots, docs)
