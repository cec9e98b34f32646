"""``mha-rosetta check``: argument parsing and printing around `checks.run_check` (``--grad``, ``--decode``: its kinds).

Exit status: 0 when every implementation agrees with the oracle and with every other
(or differs only by a named known difference) and every known mistake is caught;
1 on a disagreement or a mistake that went unnoticed; 2 on an error (a run that
raised, a bad option, or nothing checked at all); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import contextmanager
from functools import partial

# Seconds one run may take: the slowest run of the default check (a sharded backend's first
# run, which starts its processes, or a first JAX compilation) takes a few seconds.
DEFAULT_TIMEOUT = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_backend_classes, add_json, add_list, add_markdown, add_plain, add_switch

    parser.epilog = (
        "Lists take commas or repeated options: --dtypes float32,float16 or --dtypes float32 --dtypes float16."
    )
    add_list(parser, "--backends", help="backends to run (default: every installed one)")
    add_backend_classes(
        parser,
        help="your own adapter, a Backend subclass by import path (e.g. mypkg.attention:MyBackend); repeatable. "
        "Without --backends only these run (against the oracle); add --backends to compare with ours too",
    )
    add_list(
        parser,
        "--strategies",
        help="head-split strategies to keep: standard, per_head, slicing, direct_reshape (default: all of each backend's)",
    )
    add_list(parser, "--devices", help="cpu, gpu (or cuda), or all (default: cpu)")
    add_list(
        parser,
        "--dtypes",
        help="float64, float32, float16, bfloat16: each case runs those of them it lists, or the first one an "
        "implementation supports (default: all four); 'all' runs every case in every dtype",
    )
    add_list(parser, "--cases", help="spec cases to run (default: all; see --list)")
    add_json(parser, help="write the machine-readable result to PATH ('-' for stdout), atomically")
    add_markdown(parser, what="the report")
    add_plain(parser)
    parser.add_argument(
        "--per-case", action="store_true", help="one agreement matrix per case instead of the worst over all cases"
    )
    parser.add_argument("--quiet", action="store_true", help="print only problems, skips and the summary")
    parser.add_argument("--list", action="store_true", help="list the spec cases and the backends, then exit")
    parser.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="worker processes that run the runs (default: the cores this process may use); 0 runs everything in "
        "this process, without time limits",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds one run may take before its worker is killed and the run reported as an error "
        f"(default: {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--timings",
        action="store_true",
        help="print where the time went: per backend, import, compile and run seconds (also in --json)",
    )
    parser.add_argument(
        "--no-jax-cache",
        action="store_true",
        help="do not keep compiled JAX programs between checks ($XDG_CACHE_HOME/mha-rosetta/: the project's "
        "programs as executables, JAX's persistent cache for the rest; also off with MHA_ROSETTA_JAX_CACHE=0)",
    )
    parser.add_argument(
        "--no-fast-compile",
        action="store_true",
        help="compile with XLA's default settings in the workers (the check sets "
        "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0 "
        "--xla_cpu_parallel_codegen_split_count=1, which halve its JAX compile time; "
        "off with MHA_ROSETTA_FAST_COMPILE=0 and with --devices gpu; your own XLA_FLAGS always win)",
    )
    add_switch(
        parser,
        "--grad",
        help="also check every implementation's backward pass (gradients of inputs and parameters) against the "
        "float64 backward oracle and each other; adds a 'grad' section to --json",
    )
    add_switch(
        parser,
        "--decode",
        help="check KV-cache decoding instead: every implementation x cache kind x decode case x dtype, its prefill "
        "and steps against the full causal forward and each other; --cases then names decode cases (see --list)",
    )


def _executor(args, jobs: int):
    """The check's executor for these options (`checks.engine.executor_for`)."""
    from mha_rosetta.checks.engine import executor_for

    return executor_for(
        jobs,
        timeout=args.timeout,
        cache=False if args.no_jax_cache else None,
        # The fast settings are for XLA:CPU; a check that asks for a GPU compiles with XLA's defaults.
        fast_compile=False if args.no_fast_compile or _asks_for_gpu(args.devices) else None,
    )


def _asks_for_gpu(devices) -> bool:
    from mha_rosetta.checks.selection import _resolve_devices  # "cuda" and "all" as the check reads them

    return "gpu" in _resolve_devices(devices)


def _list(out, decode: bool) -> int:
    """``--list``: the spec cases (``--decode``: the decode cases) and every backend, installed or not."""
    from mha_rosetta.backends import available_backends, get_backend, missing_backends

    if decode:
        from mha_rosetta.checks.decode_cases import DECODE_CASES as cases

        title, width = "decode cases", 20
    else:
        from mha_rosetta.checks import SPEC_CASES as cases

        title, width = "spec cases", 18
    print(f"{title}:", file=out)
    for case in cases.values():
        print(f"  {case.name:{width}} {case.description}", file=out)
        print(f"  {'':{width}} {case.describe()}; dtypes {', '.join(case.dtypes)}", file=out)
    print("installed backends:", file=out)
    for name in available_backends():
        backend = get_backend(name)
        if decode:
            caches = ", ".join(backend.decode_caches) or "none: " + (
                backend.decode_unsupported or "no KV-cache decoding"
            )
            what = f"decode caches {caches}"
        else:
            what = f"strategies {', '.join(backend.strategies)}"
        print(f"  {name:20} {backend.kind:14} {what}", file=out)
    for name, reason in missing_backends().items():
        print(f"  {name:20} not installed: {reason}", file=out)
    return 0


def run(args: argparse.Namespace) -> int:
    from mha_rosetta.checks import run_check
    from mha_rosetta.checks.json_report import write_decode_json, write_json

    # With the JSON on stdout, the human-readable report moves to stderr.
    out = sys.stderr if args.json == "-" else sys.stdout
    if args.list:
        return _list(out, args.decode)
    if args.decode and args.grad:
        print("mha-rosetta check: error: --decode and --grad are separate checks: run one at a time", file=sys.stderr)
        return 2
    progress = None
    if not args.quiet and sys.stderr.isatty():

        def progress(message: str) -> None:
            print(f"\r\033[Kchecking {message} ...", end="", file=sys.stderr, flush=True)

    backends = args.backends
    if args.backend:
        from mha_rosetta.backends.registry import register_path

        sys.path.insert(0, "")  # like `python -m`: the current directory's modules can be named
        try:
            plugins = [register_path(path) for path in args.backend]
        except Exception as error:  # the user's module may raise anything while importing
            print(f"mha-rosetta check: error: --backend: {type(error).__name__}: {error}", file=sys.stderr)
            return 2
        backends = [*(backends or []), *plugins]
    # The same selection for every kind of check (--backend classes included).
    selection = dict(
        backends=backends, strategies=args.strategies, devices=args.devices, dtypes=args.dtypes, cases=args.cases
    )
    jobs = len(os.sched_getaffinity(0)) if args.jobs is None else args.jobs
    if jobs < 0 or not args.timeout > 0:
        what = f"--jobs: expected 0 or more, got {jobs}" if jobs < 0 else f"--timeout: expected > 0, got {args.timeout}"
        print(f"mha-rosetta check: error: {what}", file=sys.stderr)
        return 2
    # The kinds of check, in order, on the same selection and workers (`checks.facade.CHECKS`).
    kinds = ["decode"] if args.decode else ["forward", "grad"] if args.grad else ["forward"]
    results: dict = {}  # kind -> its finished result

    def write(found: dict, interim: bool = False) -> None:
        if "decode" in found:
            write_decode_json(found["decode"], args.json, partial=interim)
        else:
            write_json(found["forward"], args.json, found.get("grad"), partial=interim)

    # --json is rewritten as results arrive (atomically), marked interrupted until the check ends,
    # so a check stopped by anything (Ctrl-C, SIGTERM, SIGKILL) leaves a valid JSON of what finished.
    def save(kind: str, result) -> None:
        if args.json and args.json != "-":
            write({**results, kind: result}, interim=True)

    try:
        with _executor(args, jobs) as executor:
            with _sigterm_as_interrupt():
                for kind in kinds:
                    if any(result.interrupted for result in results.values()):
                        break  # the gradient check runs only after a whole forward check
                    update = partial(save, kind)
                    results[kind] = run_check(
                        **selection, kind=kind, progress=progress, executor=executor, on_update=update
                    )
                    _clear_progress(progress)
    except ValueError as error:
        print(f"mha-rosetta check: error: {error}", file=sys.stderr)
        return 2
    _print_report(args, out, *_report(args, results))
    if args.json:
        write(results)
        if args.json != "-":
            print(f"wrote {args.json}", file=out)
    if args.markdown and args.markdown != "-":
        print(f"wrote {args.markdown}", file=out)
    # The worst of them: INTERRUPTED (130) outranks 2 (error), 1 (failure) and 0.
    return max(result.exit_code for result in results.values())


def _report(args: argparse.Namespace, results: dict) -> tuple[list, list[str]]:
    """The report's blocks and summary lines for the checks that ran (``results``: kind -> result)."""
    from mha_rosetta.checks.report import timing_blocks

    if "decode" in results:
        from mha_rosetta.checks.decode_report import decode_report_blocks, decode_summary_lines

        result = results["decode"]
        blocks = decode_report_blocks(result, per_case=args.per_case, quiet=args.quiet)
        timings = timing_blocks(result, title="decode check") if args.timings else []
        return blocks + timings, decode_summary_lines(result)
    from mha_rosetta.checks.grad_report import grad_report_blocks, grad_summary_lines
    from mha_rosetta.checks.report import report_blocks, summary_lines

    result, grad = results["forward"], results.get("grad")
    blocks = report_blocks(result, per_case=args.per_case, quiet=args.quiet)
    summary = summary_lines(result)
    if grad is not None:
        blocks += grad_report_blocks(grad, quiet=args.quiet)
        summary += grad_summary_lines(grad)
    if args.timings:
        blocks += timing_blocks(result, grad)
    return blocks, summary


def _print_report(args: argparse.Namespace, out, blocks: list, summary: list[str]) -> None:
    """Markdown to ``--markdown``'s file (the terminal report is printed as well) or to stdout, else tables."""
    from mha_rosetta.checks.report import output_width, print_rich, render_markdown, render_plain, rich_available

    if args.markdown and args.markdown != "-":
        from mha_rosetta.core.files import write_output

        write_output(args.markdown, render_markdown(blocks, summary))
    if args.markdown == "-":
        out.write(render_markdown(blocks, summary))
    elif rich_available() and not args.plain:
        print_rich(blocks, summary, file=out)
    else:
        out.write(render_plain(blocks, summary, width=output_width(out)))


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM stops the check as Ctrl-C does (the engine keeps what finished and stops the workers)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _clear_progress(progress) -> None:
    """Clear the progress line from the terminal (when there is one)."""
    if progress:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
