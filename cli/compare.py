"""``mha-rosetta compare MODULE_A MODULE_B``: two real attention modules side by side (`diagnose.compare`).

Each module is given as ``package.module:factory``, a callable with no arguments that returns the module
(Hugging Face, mlx-lm, ``nn.MultiheadAttention``... any class `from_module` reads). A is the original, B the
port: B is loaded with A's parameters, both run on the same input, and the configurations' differences, the
agreement and the likeliest cause are printed. Exit status 0 when they agree, 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_json, add_switch

    parser.add_argument("module_a", metavar="MODULE_A", help="package.module:factory of the original module")
    parser.add_argument("module_b", metavar="MODULE_B", help="package.module:factory of the port")
    parser.add_argument(
        "--dtype", default="float64", help="the input's dtype and the tolerance floor (default float64)"
    )
    add_switch(parser, "--decode", help="also step both through their own KV caches, token by token")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input (default 0)")
    add_json(parser, help="write the comparison as JSON to PATH ('-' for stdout)")


def _module(path: str):
    from mha_rosetta.diagnose.isolated import resolve_object

    factory = resolve_object(path)
    if not callable(factory):
        raise ValueError(f"{path} is a {type(factory).__name__}, not a factory callable as factory() -> module")
    return factory()


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models import LayoutError

    sys.path.insert(0, "")  # like `python -m`: the current directory's modules can be named
    try:
        result = compare(
            _module(args.module_a), _module(args.module_b), dtype=args.dtype, decode=args.decode, seed=args.seed
        )
    except (ValueError, LayoutError, ImportError) as error:
        print(f"mha-rosetta compare: {error}", file=sys.stderr)
        return 2
    if args.json:
        from mha_rosetta.core.files import write_output

        write_output(args.json, json.dumps(result.as_dict(), indent=2, default=repr) + "\n")
    if args.json != "-":
        print(result.summary())
    return 0 if result.agrees and result.first_decode_step is None else 1
