"""``mha-rosetta explain``: shapes, strides and weight layouts of every convention; the claims of the
column/row-sample article.

    mha-rosetta explain                       # the column/row-sample article's 6 tokens, d_model 12, 3 heads of d_k 4
    mha-rosetta explain --claims              # every claim with its evidence and verdict
    mha-rosetta explain --claims --json -     # the claims as JSON: [{"claim", "title", "verdict", "evidence"}, ...]
    mha-rosetta explain --markdown -          # the same tables as Markdown
    mha-rosetta explain --png head_split.png  # the head split as a picture
    mha-rosetta explain --write-docs docs     # regenerate docs/explainer.md, docs/head_split.png and docs/packings.png
    mha-rosetta explain --sharding --world 2 --heads 4   # which weight axis tensor parallelism cuts, and the all-reduce
    mha-rosetta explain --decode              # KV-cache decoding: each cache's layout, where keys are cached, masks
    mha-rosetta explain --ragged              # one ragged batch in every spelling, and its block table drawn

Exit status: 0 when every check holds, 1 when a non-speed claim is refuted or a weight
layout fails its verification (a refuted speed claim is a finding, not a failure), 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mha_rosetta.explain.seed_setup import DEFAULT_BATCH, SEED_D_K, SEED_D_MODEL, SEED_HEADS, SEED_TOKENS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_json, add_list, add_markdown, add_plain, add_switch

    size = parser.add_argument_group("configuration (defaults: the column/row-sample article's example)")
    size.add_argument(
        "--tokens", type=_positive_int, default=SEED_TOKENS, help=f"tokens per sequence (default {SEED_TOKENS})"
    )
    size.add_argument(
        "--d-model", type=_positive_int, default=SEED_D_MODEL, help=f"model width (default {SEED_D_MODEL})"
    )
    size.add_argument("--heads", type=_positive_int, default=SEED_HEADS, help=f"number of heads (default {SEED_HEADS})")
    size.add_argument(
        "--d-k",
        type=_positive_int,
        default=None,
        help=f"head width (default d_model / heads, {SEED_D_K} for the article)",
    )
    size.add_argument(
        "--batch", type=_positive_int, default=DEFAULT_BATCH, help=f"batch size (default {DEFAULT_BATCH})"
    )
    size.add_argument("--seed", type=int, default=0, help="seed of the parameters and inputs (default 0)")
    add_list(
        parser, "--backends", help="backends for the stage and forms tables (default: every installed implementation)"
    )
    add_list(
        parser,
        "--sections",
        help="parts to show: stages, weights, head_split, checkpoints, differences, variants, forms, claims "
        "(default: all but forms and claims)",
    )
    switches = {  # the on/off options (store_true); --grad was --backward
        "--grad": (
            "the backward pass: weight gradients in both conventions and a GQA backward-only bug caught by check --grad"
        ),
        "--claims": "run the article's 12 claims and print claim, evidence and verdict",
        "--no-speed": "with --claims: skip the benchmark questions (speed claims show as skipped)",
        "--full-speed": "run the speed questions at full size instead of the quick preset",
        "--sharding": (
            "tensor parallelism instead: which axis of each stored weight is cut, and where the one all-reduce is"
        ),
        "--decode": (
            "KV-cache decoding instead: each implementation's cache layout and bytes per token, where keys are "
            "cached (computed), and the bottom-right vs top-left mask of a decode step"
        ),
        "--ragged": (
            "ragged batches instead: one small batch in every spelling (cu_seqlens, position_ids, document mask, "
            "seq_lens, block table, FlashInfer) with their round trips, and the block table drawn"
        ),
    }
    for flag, text in switches.items():
        add_switch(parser, flag, help=text, old=("--backward",) if flag == "--grad" else ())
    parser.add_argument("--threads", type=_positive_int, default=1, help="threads for the speed questions (default 1)")
    parser.add_argument(
        "--world",
        type=_positive_int,
        default=None,
        help="with --sharding: ranks (default: the most, up to 4, that split the heads)",
    )
    out = parser.add_argument_group("output")
    add_markdown(out, what="the tables")
    add_plain(out)
    add_json(
        out,
        help="write JSON to PATH ('-' for stdout); with --claims alone the list of claims, otherwise the whole explanation",
    )
    out.add_argument("--png", metavar="PATH", help="draw the head split (correct vs direct reshape) to PATH")
    out.add_argument(
        "--write-docs",
        metavar="DIR",
        help="regenerate DIR/explainer.md, DIR/head_split.png and DIR/packings.png (everything, claims with quick speed questions)",
    )


def _names(given: list[str] | None, known, option: str, what: str, listed: str) -> tuple[str, ...] | None:
    """The names given to ``option`` (None when not given; `options.ListAction` split them), each one of ``known``."""
    if not given:
        return None
    names = tuple(given)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{option}: unknown {what}(s) {', '.join(unknown)}; {listed}: {', '.join(known)}")
    return names


def _write_json(target: str, payload) -> None:
    from mha_rosetta.benchmarks.provenance import provenance
    from mha_rosetta.core.files import write_output

    write_output(target, json.dumps({**payload, "provenance": provenance()}, indent=2, default=str) + "\n")
    if target != "-":
        print(f"wrote {target}", file=sys.stderr)


def _failures(explanation) -> list[str]:
    """What makes the exit status non-zero: a refuted fact, or a weight layout that fails its check.

    A refuted speed claim is a finding about the column/row-sample article, not a failure of this run: the
    article's speed claims (3, 7) are allowed to be wrong, and timings move with the machine.
    """
    from mha_rosetta.explain.claims import CLAIMS

    problems = [
        f"claim {c.claim} refuted"
        for c in explanation.claims
        if c.verdict == "refuted" and not CLAIMS[c.claim].speed_only
    ]
    problems += [
        f"weight layout '{w.layout}' failed its verification" for w in explanation.weights if w.verified is False
    ]
    problems += [
        f"checkpoint layout '{c.layout}' failed on its real module"
        for c in explanation.checkpoints
        if c.verified is False
    ]
    return problems


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.backends import REGISTRY
    from mha_rosetta.core import MHAConfig
    from mha_rosetta.core.files import write_output
    from mha_rosetta.explain import SECTIONS, explain

    try:
        cfg = MHAConfig(d_model=args.d_model, n_heads=args.heads, d_k=args.d_k)
        backends = _names(args.backends, REGISTRY, "--backends", "backend", "registered")
        chosen_sections = _names(args.sections, SECTIONS, "--sections", "section", "choose from")
    except (ValueError, TypeError) as error:
        print(f"mha-rosetta explain: {error}", file=sys.stderr)
        return 2

    if args.sharding:
        return _run_sharding(args, cfg)
    if args.decode:
        return _run_decode(args, cfg)
    if args.ragged:
        from mha_rosetta.explain.ragged import explain_ragged

        return _write_section(args, explain_ragged(seed=args.seed))
    if args.grad:
        return _backward(args, cfg)
    write_docs = args.write_docs is not None
    if write_docs:
        sections, claims = None, True  # everything
    elif chosen_sections is not None:
        sections = chosen_sections + (("claims",) if args.claims and "claims" not in chosen_sections else ())
        claims = "claims" in sections
    elif args.claims:
        sections, claims = ("claims",), True
    else:
        sections, claims = None, False
    explanation = explain(
        cfg,
        backends,
        claims,
        tokens=args.tokens,
        batch=args.batch,
        seed=args.seed,
        sections=sections,
        speed=not args.no_speed,
        threads=args.threads,
        quick=not args.full_speed,
    )

    if write_docs:
        from mha_rosetta.core.files import write_text_atomic

        folder = Path(args.write_docs)
        folder.mkdir(parents=True, exist_ok=True)
        from mha_rosetta.explain.real_checkpoints import PACKING_PNG, save_packing_png

        png = explanation.save_png(folder / "head_split.png")
        packings = save_packing_png(folder / PACKING_PNG)
        write_text_atomic(folder / "explainer.md", explanation.to_markdown(png_name="head_split.png"))
        print(f"wrote {folder / 'explainer.md'}, {png} and {packings}", file=sys.stderr)
    if args.png:
        print(f"wrote {explanation.save_png(args.png)}", file=sys.stderr)
    if args.json:
        claims_only = explanation.sections == ("claims",)
        # --claims alone: {"schema": 1, "claims": [...]} (a bare list before provenance was added)
        claims_json = {"schema": 1, "claims": explanation.claims_json()}
        _write_json(args.json, claims_json if claims_only else explanation.to_dict())
    if args.markdown and args.markdown != "-":  # a file: the terminal tables are printed as well
        write_output(args.markdown, explanation.to_markdown())
        print(f"wrote {args.markdown}", file=sys.stderr)
    if args.json != "-" and not write_docs:
        if args.markdown == "-":
            sys.stdout.write(explanation.to_markdown())
        else:
            explanation.print(plain=args.plain)

    problems = _failures(explanation)
    for problem in problems:
        print(f"mha-rosetta explain: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _run_sharding(args: argparse.Namespace, cfg) -> int:
    """``--sharding``: the head-parallel cut of every weight in both conventions (Markdown tables)."""
    from mha_rosetta.explain.sharding import explain_sharding

    try:
        result = explain_sharding(cfg, args.world, tokens=args.tokens, batch=args.batch, seed=args.seed)
    except (ValueError, TypeError) as error:
        print(f"mha-rosetta explain --sharding: {error}", file=sys.stderr)
        return 2
    return _write_section(args, result)


def _run_decode(args: argparse.Namespace, cfg) -> int:
    """``--decode``: the KV-cache decoding section alone (`explain.decode`), as Markdown (and JSON with --json)."""
    from mha_rosetta.explain.decode import explain_decode

    return _write_section(args, explain_decode(cfg, seed=args.seed))


def _write_section(args: argparse.Namespace, result) -> int:
    """One section alone (``--sharding``, ``--decode``): its JSON with --json, its Markdown unless the JSON has stdout."""
    from mha_rosetta.core.files import write_output

    if args.json:
        _write_json(args.json, result.to_dict())
    if args.json != "-" or args.markdown not in (None, "-"):
        write_output(args.markdown or "-", result.to_markdown())
    return 0


def _backward(args: argparse.Namespace, cfg) -> int:
    """``--grad``: the backward section alone (`explain.backward`); exit 1 if the demonstrated bug went unseen."""
    from mha_rosetta.checks.report import render_markdown, render_plain
    from mha_rosetta.core.files import write_output
    from mha_rosetta.core.tables import output_width
    from mha_rosetta.explain.backward import backward_blocks

    blocks, caught = backward_blocks(cfg, args.batch, args.tokens, args.seed)
    summary = [
        "the GQA backward bug: "
        + ("caught by the gradient check, missed by the forward check" if caught else "NOT caught")
    ]
    text = render_markdown(blocks, summary) if args.markdown else render_plain(blocks, summary, output_width())
    text = text.replace("# mha-rosetta check", "# mha-rosetta explain --grad", 1)
    write_output(args.markdown if args.markdown else "-", text)
    return 0 if caught else 1
