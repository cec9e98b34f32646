"""``mha-rosetta diagnose``: name the convention error in your own attention.

``mha-rosetta diagnose mypkg.mod:my_attention --d-model 12 --heads 3`` imports
``my_attention`` (a callable ``(params, query, key, value, mask) -> output``), runs
`diagnose.diagnose` and prints the verdict, or the ranked causes with their evidence and
fixes. ``--like mypkg.ref:module`` takes the configuration from a real attention module instead
of the size options (`models.from_module`: a Hugging Face attention layer, ``nn.MultiheadAttention``,
Keras, Flax or Equinox; a function there is called with no arguments to build it).
``--confusion`` prints the confusion table of the injected bugs instead.

``mha-rosetta diagnose --decode mypkg.mod:my_decode --d-model 16 --heads 4 --kv-heads 2 --rope half``
diagnoses a KV-cache decode loop instead (`diagnose.decode.diagnose_decode`): a callable
``(params, x, prefill, step, mask, positions) -> output`` (B, N, d_model), against the full causal
forward (``--decode`` implies ``--causal``). ``--prefill`` / ``--step``: the one prefill length or
tokens per step the loop supports (default: the probes choose; ``--step 1`` leaves top-left causality
on multi-query steps unseen, and a note says so).

``mha-rosetta diagnose --ragged packed|padded|paged mypkg.mod:fn ...`` diagnoses a ragged batch or a paged
read instead (`diagnose.ragged`, issue 47): ``packed`` a callable ``(params, x (T, d_model), cu_seqlens)``
(``--ragged packed`` implies ``--causal``: documents leaking, positions not restarting), ``padded``
``(params, x (B, N, d_model), seq_lens)`` (padding keys attended; a bidirectional cfg shows it), ``paged`` a
decode kernel ``(q, k_pool, v_pool, block_table, seq_lens, scale) -> (B, H, Dv)`` on the probe's own sizes,
so it takes no size options (the physical page as the logical one, the last page's length off by one).

Exit status: 0 the candidate agrees with the oracle; 1 it disagrees (causes printed);
2 it cannot be diagnosed (an import path that does not resolve, not callable, raised,
timed out, crashed its process, wrong shape or dtype, NaN everywhere) or a bad option.

The candidate runs in a child process (`diagnose.isolated`), so that a crash or a hang in
native code is reported with its exit status or signal instead of ending ``diagnose``.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mha_rosetta.diagnose.ragged import RAGGED_FORMS

    from .options import add_json, add_list, add_switch
    from .variant_options import add_variant_arguments

    add_variant_arguments(parser)  # --window, --softcap, --qk-norm, ... (core.VARIANTS)

    parser.add_argument(
        "candidate",
        nargs="?",
        metavar="MODULE:CALLABLE",
        help="your attention: a callable (params, query, key, value, mask) -> output, by import path",
    )
    parser.add_argument(
        "--like",
        metavar="MODULE:OBJECT",
        help="take the configuration from this real attention module (from_module: a Hugging Face attention layer, "
        "nn.MultiheadAttention, Keras, Flax or Equinox; a function is called to build it) instead of the size options",
    )
    parser.add_argument("--d-model", type=int, help="model width (required with a candidate, unless --like)")
    parser.add_argument("--heads", type=int, help="query heads (required with a candidate, unless --like)")
    parser.add_argument("--kv-heads", type=int, help="kv heads (fewer: GQA, one: MQA; default: --heads)")
    parser.add_argument("--d-k", type=int, help="query/key width per head (default d_model / heads)")
    parser.add_argument("--d-v", type=int, help="value width per head (default d_k)")
    parser.add_argument("--kdim", type=int, help="key input width (default d_model)")
    parser.add_argument("--vdim", type=int, help="value input width (default d_model)")
    parser.add_argument("--no-bias", action="store_true", help="the candidate's projections have no bias")
    parser.add_argument("--causal", action="store_true", help="the candidate applies a causal mask itself")
    parser.add_argument("--scale", type=float, help="score scale (default 1/sqrt(d_k))")
    parser.add_argument(
        "--rope",
        choices=("half", "interleaved"),
        help="the candidate applies rotary embeddings: half (rotate_half, Hugging Face) or interleaved (Meta)",
    )
    parser.add_argument("--rope-base", type=float, help="rotary base (default 10000)")
    parser.add_argument("--rope-dims", type=int, help="rotated features per head (default d_k)")
    add_list(
        parser,
        "--dtypes",
        old=("--dtype",),
        help="dtypes of the arrays fed to the candidate, one diagnosis each (default float64)",
    )
    add_switch(
        parser,
        "--decode",
        help="the candidate is a KV-cache decode loop (params, x, prefill, step, mask, positions) -> output; "
        "implies --causal",
    )
    parser.add_argument(
        "--prefill", type=int, help="with --decode: the prefill length the loop supports (default: the probes')"
    )
    parser.add_argument(
        "--step", type=int, help="with --decode: the tokens per step the loop supports (default: the probes')"
    )
    parser.add_argument(
        "--ragged",
        choices=tuple(RAGGED_FORMS),
        help="the candidate takes a ragged batch or paged keys: "
        + "; ".join(f"{form}: {text}" for form, text in RAGGED_FORMS.items())
        + " (packed implies --causal)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per probe (default 30)")
    add_json(parser, help="write the diagnosis as JSON to PATH ('-' for stdout)")
    parser.add_argument(
        "--confusion",
        action="store_true",
        help="print the confusion table of the injected bugs (NumPy and torch candidates) instead",
    )


# The options that describe the configuration: --like replaces all of them.
CONFIG_OPTIONS = (
    "d_model", "heads", "kv_heads", "d_k", "d_v", "kdim", "vdim", "no_bias", "causal", "scale", "rope", "rope_base",
    "rope_dims",
)  # fmt: skip


def _given(args: argparse.Namespace) -> list[str]:
    """The configuration options given, as flags."""
    return [
        "--" + name.replace("_", "-")
        for name in CONFIG_OPTIONS
        if getattr(args, name) is not None and getattr(args, name) is not False
    ]


def _config(args: argparse.Namespace):
    """The configuration the options describe: the sizes and the variants' fields in one `MHAConfig` (a form such as
    MLA resolves d_k, the scale and rope itself, so its fields go to the constructor, not to a replace after it)."""
    from mha_rosetta.core import MHAConfig

    from .variant_options import variant_fields

    if getattr(args, "ragged", None) == "paged":  # the kernel's probe has its own sizes: no configuration
        from mha_rosetta.diagnose.ragged import PAGED_SIZES_TEXT

        from .variant_options import given as variants_given

        given = _given(args) + variants_given(args) + (["--like"] if args.like is not None else [])
        if given:
            raise ValueError(
                f"--ragged paged probes a decode kernel on its own sizes ({PAGED_SIZES_TEXT}); drop {', '.join(given)}"
            )
        return None
    if args.like is not None:
        given = _given(args)
        if given:
            raise ValueError(f"--like gives the whole configuration; drop {', '.join(given)}")
        variant_fields(args)  # refuses the variant options: --like gives those too
        from mha_rosetta.diagnose.isolated import resolve_like
        from mha_rosetta.models import LayoutError, from_module

        try:
            return from_module(resolve_like(args.like)).cfg
        except LayoutError as error:
            raise ValueError(f"--like {args.like}: {error}") from error
    missing = [flag for flag, value in (("--d-model", args.d_model), ("--heads", args.heads)) if value is None]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} required: the sizes the candidate's module was built for (or --like MODULE:OBJECT)"
        )
    sizes = dict(
        d_model=args.d_model,
        n_heads=args.heads,
        d_k=args.d_k,
        d_v=args.d_v,
        n_kv_heads=args.kv_heads,
        kdim=args.kdim,
        vdim=args.vdim,
        bias=not args.no_bias,
        # A decode loop is causal, and so are packed documents.
        causal=args.causal or bool(getattr(args, "decode", False)) or getattr(args, "ragged", None) == "packed",
        scale=args.scale,
        rope=args.rope,
        rope_base=10000.0 if args.rope_base is None else args.rope_base,
        rope_dims=args.rope_dims,
    )
    return MHAConfig(**{**sizes, **variant_fields(args)})  # a variant's field wins (--qkv-bias sets bias)


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.benchmarks.provenance import provenance
    from mha_rosetta.core.files import write_output
    from mha_rosetta.diagnose import DEFAULT_TIMEOUT_S, DiagnoseError
    from mha_rosetta.diagnose.isolated import diagnose_import_path

    if args.confusion and (args.decode or args.ragged):
        drop = "--decode" if args.decode else "--ragged"
        print(f"mha-rosetta diagnose: error: --confusion is the forward's table; drop {drop}", file=sys.stderr)
        return 2
    if args.confusion:
        from mha_rosetta.diagnose.confusion import (
            confusion,
            render_evidence,
            render_separation,
            render_tables,
            separating_probes,
        )

        outcomes = confusion()
        print(render_tables(outcomes))
        print(
            "The simplest probe that tells each pair of causes apart (max abs difference of their simulated outputs):\n"
        )
        print(render_separation(separating_probes()))
        print("One diagnosis per bug, its evidence:\n")
        print(render_evidence(outcomes), end="")
        return 0 if all(o.correct for o in outcomes) else 1
    if not args.decode and (args.prefill is not None or args.step is not None):
        print("mha-rosetta diagnose: error: --prefill and --step need --decode (a decode loop)", file=sys.stderr)
        return 2
    if args.ragged is not None and args.decode:
        print(
            "mha-rosetta diagnose: error: --ragged and --decode are different candidates (a paged decode kernel is "
            "--ragged paged); give one",
            file=sys.stderr,
        )
        return 2
    if args.candidate is None:
        print("mha-rosetta diagnose: error: give the candidate as MODULE:CALLABLE (or --confusion)", file=sys.stderr)
        return 2
    sys.path.insert(0, "")  # like `python -m`: the current directory's modules can be named (the child inherits it)
    try:
        cfg = _config(args)
        timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
        # In a child process: a candidate that crashes or hangs in native code is reported, not fatal here.
        dtypes = args.dtypes or ["float64"]
        decode = {"prefill": args.prefill, "step": args.step} if args.decode else None
        results = [
            diagnose_import_path(args.candidate, cfg, dtype=dtype, timeout=timeout, decode=decode, ragged=args.ragged)
            for dtype in dtypes
        ]
    except (DiagnoseError, ValueError, TypeError) as error:
        print(f"mha-rosetta diagnose: error: {error}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout
    for dtype, result in zip(dtypes, results, strict=True):
        like = f", like {args.like}" if args.like else ""
        loop = ", decode loop" if args.decode else f", {args.ragged}" if args.ragged else ""
        described = cfg.describe() if cfg is not None else "paged decode kernel, the probe's own sizes"
        print(f"{args.candidate} ({described}{loop}{like}{f', {dtype}' if len(dtypes) > 1 else ''}):", file=out)
        print(result.summary(), file=out)
    if args.json:
        head = {"candidate": args.candidate, "config": None if cfg is None else cfg.describe()}
        head.update({"like": args.like} if args.like else {})
        if args.decode:
            head["decode"] = {"prefill": args.prefill, "step": args.step}
        if args.ragged:
            head["ragged"] = args.ragged
        # One dtype: the diagnosis' fields at the top level (as before --dtypes took a list); several: one each.
        body = results[0].as_dict() if len(results) == 1 else {
            "agrees": all(result.agrees for result in results),
            "diagnoses": [result.as_dict() for result in results],
        }  # fmt: skip
        write_output(args.json, json.dumps({**head, **body, "provenance": provenance()}, indent=2))
    return 0 if all(result.agrees for result in results) else 1
