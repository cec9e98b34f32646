"""The ``mha-rosetta`` command line: ``check``, ``bench``, ``explain``, ``diagnose`` and ``report``.

Each subcommand lives in its own module (`cli.check`, `cli.bench`, `cli.explain`, `cli.report` ...)
exposing ``add_arguments(parser)`` and ``run(args) -> int`` (the exit status). The
modules are imported only when their subcommand runs, so ``mha-rosetta --help``
imports no framework.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "check": "agreement of every installed implementation with the float64 oracle and with each other",
    "bench": "fair timings side by side (fresh process per cell, pinned threads)",
    "explain": "shapes, strides and weight layouts of every convention; the column/row-sample article's claims",
    "diagnose": "name the convention error in your own attention (MODULE:CALLABLE), with evidence and the fix",
    "compare": "two real attention modules (package.module:factory) side by side: differences, agreement, cause",
    "report": "merge check, bench and explain JSON files: runs side by side, an HTML page, a regression gate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mha-rosetta",
        description="Multi-head attention written once; checked, timed and explained across NumPy, PyTorch, JAX and einops.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, help_text in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        _subcommand_module(name).add_arguments(sub)
    return parser


def _version() -> str:
    from mha_rosetta import __version__

    return __version__


def _subcommand_module(name: str):
    return importlib.import_module(f"mha_rosetta.cli.{name}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from mha_rosetta.benchmarks.provenance import forget_start, remember_start

    remember_start()  # the JSON's git state is the code this command runs, however long it runs
    try:
        return _subcommand_module(args.command).run(args)
    except KeyboardInterrupt:
        from mha_rosetta.core.errors import INTERRUPTED

        print("interrupted; finished results were kept", file=sys.stderr)
        return INTERRUPTED
    finally:
        forget_start()  # a caller that runs several commands in one process gets each one's own start


if __name__ == "__main__":
    sys.exit(main())
