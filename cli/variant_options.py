"""The variants' options of ``mha-rosetta diagnose`` (``core.VARIANTS``; each off by default).

``add_variant_arguments`` adds them in a group of their own; ``with_variants(cfg, args)`` returns the
configuration with the variants given switched on (`MHAConfig` validates each and names the field).
They describe the configuration as the size options do, so ``--like`` (which reads the whole
configuration from a real module) refuses them. Each option is its entry's (`Variant.cli` in
`core.variants`): the flag, its type and help, the fields it sets and the option it is a part of.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from mha_rosetta.core.variants import VARIANT_REGISTRY, CliOption

# Every entry's options once (the two QK-norm variants share theirs), in the help's order.
OPTIONS: tuple[CliOption, ...] = tuple(
    sorted(
        {option.flag: option for entry in VARIANT_REGISTRY.values() for option in entry.cli}.values(),
        key=lambda option: option.rank,
    )
)


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("variants (each off by default; the formulas in mha_rosetta.core.variants)")
    for option in OPTIONS:
        group.add_argument(option.flag, **option.kwargs)


def given(args: argparse.Namespace) -> list[str]:
    """The variant options given on the command line, as typed."""
    return [option.flag for option in OPTIONS if _given(getattr(args, option.dest, None))]


def _given(value) -> bool:
    """An option given: not its default None or False (0 is given: `MHAConfig` then says why it is wrong)."""
    return value is not None and value is not False


def readers(option: CliOption, value) -> list[str]:
    """The options that switch on a variant reading a field ``option`` sets (given ``value``), ``option.needs`` first:
    one of them must be given with it (`Variant.fields` of every entry, so a new norm's option is one with no edit)."""
    fields = set(option.fields(value))
    switches = [
        other.flag
        for entry in VARIANT_REGISTRY.values()
        if fields & set(entry.fields)
        for other in entry.cli
        if other.needs is None and other.flag != option.flag
    ]
    return list(dict.fromkeys(([option.needs] if option.needs else []) + switches))


def _alternatives(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} or {flags[-1]}"


def with_variants(cfg, args: argparse.Namespace):
    """``cfg`` with the variant options switched on; ValueError for a combination that contradicts itself.

    `MHAConfig` resolves d_k, the scale and rope at construction, so a form that sets them (MLA) must be given to
    the constructor: build ``MHAConfig(**sizes, **variant_fields(args))`` for it instead.
    """
    fields = variant_fields(args)
    return replace(cfg, **fields) if fields else cfg


def variant_fields(args: argparse.Namespace) -> dict:
    """The `MHAConfig` fields the variant options given set; ValueError for a combination that contradicts itself."""
    options = given(args)
    if not options:
        return {}
    if getattr(args, "like", None):
        raise ValueError(f"--like gives the whole configuration; drop {', '.join(options)}")
    chosen = [option for option in OPTIONS if option.flag in options]
    for option in chosen:
        for other, meaning in option.conflicts.items():
            if getattr(args, other.lstrip("-").replace("-", "_"), False):
                raise ValueError(f"{option.flag} ({meaning}) contradicts {other}: give one")
    for option in chosen:
        value = getattr(args, option.dest)
        alternatives = readers(option, value) if option.needs is not None else []
        if alternatives and not set(alternatives) & set(options):
            if len(alternatives) == 1:
                raise ValueError(f"{option.flag} needs {option.needs} (it sets a part of that variant)")
            raise ValueError(
                f"{option.flag} needs {_alternatives(alternatives)}: it sets {', '.join(option.fields(value))}, "
                "which only those variants read (given alone it would change nothing)"
            )
    fields: dict = {}
    for option in chosen:
        fields |= option.fields(getattr(args, option.dest))
    return fields
