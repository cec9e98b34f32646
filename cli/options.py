"""The option vocabulary every subcommand shares (``check``, ``bench``, ``explain``, ``diagnose``, ``report``).

Design rules:

- One spelling per option: ``--backends``, ``--devices``, ``--dtypes``, ``--json PATH|-`` and
  ``--markdown PATH|-`` (``-`` is standard output).
- Lists take commas, repeats or both: ``--backends a,b --backends c`` gives ``["a", "b", "c"]``
  (`ListAction`); an option not given stays ``None`` (the subcommand's default).
- Old spellings stay accepted, with the same destination, and ``--help`` marks them
  "old spelling of ..." (`add_list`'s ``old``); nothing that worked before stops working.
"""

from __future__ import annotations

import argparse

STDOUT = "-"  # the PATH of --json and --markdown that means standard output


class ListAction(argparse.Action):
    """Each occurrence adds its comma-separated names to the list: commas and repeats combine."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = [part.strip() for part in str(values).split(",") if part.strip()]
        if not names:
            parser.error(f"{option_string}: expected a comma-separated list of names such as a,b; got {values!r}")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *names])


def add_list(parser, name: str, *, help: str, old: tuple[str, ...] = (), metavar: str = "LIST") -> None:
    """``name`` as a list option (`ListAction`), and each of ``old`` as its old spelling."""
    dest = name.lstrip("-").replace("-", "_")
    parser.add_argument(name, dest=dest, action=ListAction, metavar=metavar, help=f"{help}; commas or repeats")
    for spelling in old:
        parser.add_argument(spelling, dest=dest, action=ListAction, metavar=metavar, help=f"old spelling of {name}")


def add_markdown(parser, *, what: str, bare_was: str | None = None) -> None:
    """``--markdown [PATH]``: write ``what`` as Markdown to PATH; ``-`` or the bare flag writes it to stdout.

    ``bare_was`` names what the bare flag did before it took a PATH (it still does the same).
    """
    old = f"; the bare flag is the old spelling ({bare_was})" if bare_was else ""
    parser.add_argument(
        "--markdown",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="PATH",
        help=f"write {what} as Markdown to PATH ('-', or the flag alone: stdout){old}",
    )
