"""``mha-rosetta check``: being built (see the open issue)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable result to PATH ('-' for stdout)")


def run(args: argparse.Namespace) -> int:
    print("mha-rosetta check: not implemented yet")
    return 1
