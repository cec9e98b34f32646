"""``mha-rosetta report``: merge check, bench and explain JSON files into one comparison.

The rules it applies are `mha_rosetta.report.compare`'s (its comparison of two runs is
`mha_rosetta.benchmarks.verdict`'s, as for ``bench --baseline``), and the epilog says them.
"""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """\
Each bench cell's figure is its corrected_median_s (drift-corrected, with the corrected round spread) when present, else its median_s;
its range is [min, max] of its round medians, else the figure alone. Each column is one run and
device, labelled machine @ commit · device · threads (files without provenance: by file name).
Ratios are to the first column; 'within noise' means the two ranges overlap.

Regression gate: with --baseline FILE and --fail-on-regression PCT, the exit status is 1 when
any cell's whole range is above the matching baseline cell's range (slower beyond noise) AND
its figure is more than PCT % slower; else 0 (the rule of bench --baseline). Cells match by
implementation, variant, mode, dtype, shape, threads and device; cells without a baseline cell
are listed, not failed. Bad input: exit 2.

Decode files read the same way: a bench --mode decode file gives one table per context, window
and step (context=32768 W=4096), each figure one decode step with its % of the K/V read limit;
a check --decode file adds each implementation and cache kind against the full causal forward
(worst case, worst error, where it first parts)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("files", nargs="+", metavar="FILE", help="check, bench or explain JSON files (any number)")
    parser.add_argument("--html", metavar="PATH", help="write the self-contained HTML page (no network needed)")
    parser.add_argument("--markdown", metavar="PATH", help="write the Markdown report to PATH ('-' for stdout)")
    parser.add_argument(
        "--json", metavar="PATH", help="write the comparison as JSON (with provenance) to PATH ('-' for stdout)"
    )
    parser.add_argument("--baseline", metavar="FILE", action="append", help="bench JSON to gate against (repeatable)")
    parser.add_argument(
        "--fail-on-regression",
        metavar="PCT",
        type=float,
        help="with --baseline: exit 1 when a cell is slower beyond noise and by more than PCT %%",
    )


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.core.files import write_output
    from mha_rosetta.report.build import build_report

    if args.fail_on_regression is not None and not args.baseline:
        print("mha-rosetta report: error: --fail-on-regression needs --baseline FILE", file=sys.stderr)
        return 2
    try:
        report = build_report(args.files, baseline=args.baseline, threshold_pct=args.fail_on_regression)
    except ValueError as error:
        print(f"mha-rosetta report: error: {error}", file=sys.stderr)
        return 2
    markdown = report.markdown()
    if args.markdown:
        write_output(args.markdown, markdown)
    if args.json:
        write_output(args.json, json.dumps(report.to_json(), indent=2, allow_nan=True) + "\n")
    if args.html:
        write_output(args.html, report.html())
        print(f"wrote {args.html}", file=sys.stderr)
    if not (args.markdown or args.json or args.html):
        sys.stdout.write(markdown)
    gate = report.gate
    if gate is not None:
        for found in gate["regressions"]:
            print(
                f"mha-rosetta report: regression: {found['cell']}: {found['change_pct']:+.1f} % "
                f"({found['seconds'] * 1e3:.3g} ms vs {found['baseline_s'] * 1e3:.3g} ms, beyond noise)",
                file=sys.stderr,
            )
        if args.fail_on_regression is not None and gate["regressions"]:
            return 1
    return 0
