"""The option vocabulary every subcommand shares (``check``, ``bench``, ``explain``, ``diagnose``, ``report``).

Design rules:

- One spelling per concept, added here so that the subcommands cannot drift apart: the lists
  ``--backends``, ``--devices``, ``--dtypes`` (`add_list`), ``--json PATH|-`` (`add_json`),
  ``--markdown PATH|-`` (`add_markdown`; ``-`` is standard output), ``--plain`` (`add_plain`),
  ``--backend MODULE:CLASS`` (your own adapter, `add_backend_classes`), and the on/off switches
  ``--grad`` (the backward pass) and ``--decode`` (KV-cache decoding) (`add_switch`). Each
  subcommand says in its own help what it writes or does with them.
- Lists take commas, repeats or both: ``--backends a,b --backends c`` gives ``["a", "b", "c"]``
  (`ListAction`); an option not given stays ``None`` (the subcommand's default).
- Old spellings stay accepted, with the same destination and the same result, and ``--help``
  says "deprecated: use X" (`deprecated`); nothing that worked before stops working. Each
  helper marks the argparse action it adds (`mark_deprecated`), and `deprecated_spellings` lists
  them from a parser, so that the README and docs can be held to the new spellings.
  The choice of each spelling: the one most callers, the docs and the README already used.
"""

from __future__ import annotations

import argparse

STDOUT = "-"  # the PATH of --json and --markdown that means standard output
BARE = ""  # `mark_deprecated`'s key for an option given without its value (``--markdown`` alone)


def deprecated(new: str) -> str:
    """The help of an old spelling: ``"deprecated: use NEW"``."""
    return f"deprecated: use {new}"


def mark_deprecated(action: argparse.Action, new: str, value: str | None = None) -> argparse.Action:
    """Record on ``action`` that it is an old spelling of ``new``: the whole option (``value`` None), one of
    its values, or the option alone (`BARE`). `deprecated_spellings` reads the marks."""
    marks = getattr(action, "deprecated", {})
    marks[value] = new
    action.deprecated = marks
    return action


class ListAction(argparse.Action):
    """Each occurrence adds its comma-separated names to the list: commas and repeats combine."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = [part.strip() for part in str(values).split(",") if part.strip()]
        if not names:
            parser.error(f"{option_string}: expected a comma-separated list of names such as a,b; got {values!r}")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *names])


def add_list(parser, name: str, *, help: str, old: tuple[str, ...] = (), metavar: str = "LIST") -> None:
    """``name`` as a list option (`ListAction`), and each of ``old`` as its deprecated spelling."""
    dest = name.lstrip("-").replace("-", "_")
    parser.add_argument(name, dest=dest, action=ListAction, metavar=metavar, help=f"{help}; commas or repeats")
    for spelling in old:
        action = parser.add_argument(spelling, dest=dest, action=ListAction, metavar=metavar, help=deprecated(name))
        mark_deprecated(action, name)


def add_switch(parser, name: str, *, help: str, old: tuple[str, ...] = ()) -> None:
    """An on/off option (``store_true``), and each of ``old`` as its deprecated spelling (the same destination)."""
    dest = name.lstrip("-").replace("-", "_")
    parser.add_argument(name, dest=dest, action="store_true", help=help)
    for spelling in old:
        mark_deprecated(parser.add_argument(spelling, dest=dest, action="store_true", help=deprecated(name)), name)


def add_json(parser, *, help: str) -> None:
    """``--json PATH``: ``help`` says what is written (``-``: stdout)."""
    parser.add_argument("--json", metavar="PATH", help=help)


def add_plain(parser) -> None:
    parser.add_argument("--plain", action="store_true", help="plain text even when rich is installed")


def add_markdown(parser, *, what: str, bare: bool = True) -> None:
    """``--markdown PATH``: write ``what`` as Markdown to PATH, ``-`` to stdout.

    ``bare``: the flag alone still means stdout, as it did before it took a PATH (deprecated: ``--markdown -``).
    """
    if not bare:
        parser.add_argument("--markdown", metavar="PATH", help=f"write {what} as Markdown to PATH ('-' for stdout)")
        return
    action = parser.add_argument(
        "--markdown",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="PATH",
        help=f"write {what} as Markdown to PATH ('-': stdout); the flag alone: {deprecated('--markdown -')}",
    )
    mark_deprecated(action, "--markdown -", BARE)


def add_backend_classes(parser, *, help: str, dest: str = "backend", old: tuple[str, ...] = ()) -> None:
    """``--backend MODULE:CLASS``: your own adapter, a Backend subclass by import path (repeatable)."""
    parser.add_argument("--backend", dest=dest, action="append", metavar="MODULE:CLASS", help=help)
    for spelling in old:
        action = parser.add_argument(
            spelling, dest=dest, action="append", metavar="MODULE:CLASS", help=deprecated("--backend")
        )
        mark_deprecated(action, "--backend")


class RenamedChoice(argparse.Action):
    """A choice whose spelling on the command line differs from the value the code reads (``renamed``)."""

    def __init__(self, *args, renamed: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = renamed

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.renamed.get(values, values))


def add_choice(parser, name: str, *, choices: tuple[str, ...], help: str, renamed=None, old=None, default=None) -> None:
    """``name {choices}``; ``renamed``: spelling -> the value stored; ``old``: deprecated spelling -> the new one.

    The old spellings are accepted (and store what the new one stores) but left out of the usage line; the
    help ends with "OLD: deprecated: use NEW".
    """
    renamed, old = dict(renamed or {}), dict(old or {})
    stored = {**renamed, **{spelling: renamed.get(new, new) for spelling, new in old.items()}}
    notes = "".join(f"; {spelling}: {deprecated(new)}" for spelling, new in old.items())
    action = parser.add_argument(
        name,
        choices=(*choices, *old),
        default=default,
        metavar="{" + ",".join(choices) + "}",
        action=RenamedChoice,
        renamed=stored,
        help=help + notes,
    )
    for spelling, new in old.items():
        mark_deprecated(action, f"{name} {new}", spelling)


def deprecated_spellings(parser: argparse.ArgumentParser) -> list[tuple[str, str, str | None, str]]:
    """Every old spelling of ``parser`` and its subcommands, as ``(subcommand, option, value, new spelling)``:
    ``value`` None for the whole option, `BARE` for the option given alone, else one of its values."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(name, *rest[1:]) for rest in deprecated_spellings(sub)]
        for value, new in getattr(action, "deprecated", {}).items():
            found.append(("", action.option_strings[0], value, new))
    return found


def repeat_policy(args: argparse.Namespace, preset: dict) -> dict:
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
