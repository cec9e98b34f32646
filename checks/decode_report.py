"""The decode check's report: agreement matrices, the caches, who cannot decode and why, where runs part.

Renders a `results.DecodeCheckResult` as the forward check's neutral blocks (`checks.report.Block`),
reusing its matrices (`checks.report.matrix_block`) and summary; its JSON form is
`checks.json_report.decode_to_json`.
"""

from __future__ import annotations

from collections import defaultdict

from .matrices import build_matrices
from .report import Block, matrix_block, problem_blocks, summary_lines
from .results import DecodeCheckResult, Status


def _matrices(result: DecodeCheckResult, per_case: bool) -> list[Block]:
    blocks = []
    for matrix in build_matrices(result, per_case):
        block = matrix_block(matrix)
        block.title = f"decode, {block.title} (against the full causal forward)"
        blocks.append(block)
    return blocks


def _cache_block(result: DecodeCheckResult) -> Block | None:
    caches: dict[str, dict] = {}
    for run in result.runs:
        cache = run.info.get("cache") if run.compared else None
        if not cache:
            continue
        entry = caches.setdefault(run.label, {"layout": cache.get("layout", "-"), "slots": [], "ring": set()})
        entry["slots"].append(int(cache.get("slots", 0)))
        case = next(c for c in result.cases if c.name == run.case)
        if case.cfg.window is not None:
            entry["ring"].add(f"{case.name} {cache.get('slots')}/{case.tokens}")
    if not caches:
        return None
    block = Block(
        "Decode caches: each implementation's layout and slots per sequence",
        ["implementation", "layout", "slots", "with a window (slots/tokens)"],
    )
    for label, entry in caches.items():
        slots = f"{min(entry['slots'])}..{max(entry['slots'])}"
        block.rows.append([label, entry["layout"], slots, ", ".join(sorted(entry["ring"])) or "-"])
    block.notes.append("a window's cache is a ring buffer of W - 1 + step slots (core.decode.ring_capacity): O(W)")
    return block


def _grouped_unsupported(result: DecodeCheckResult) -> Block | None:
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for run in result.runs:
        if run.status is Status.UNSUPPORTED:
            where[(run.label, run.reason)].append(f"{run.case}/{run.dtype}")
    others = result.settings.get("not_decode_paths") or {}
    if not where and not others:
        return None
    block = Block("Decode: unsupported (the implementation cannot decode this)", ["implementation", "where", "reason"])
    for (label, reason), items in where.items():
        shown = ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")
        block.rows.append([label, shown, reason])
    for name, strategies in others.items():
        block.rows.append([name, ", ".join(strategies), "forward strategies only: not decode paths (not run)"])
    return block


def _problem_blocks(result: DecodeCheckResult) -> list[Block]:
    return problem_blocks(
        result,
        ("Decode: problems against the full forward", "Decode: problems between implementations"),
        "where",
        lambda item: item.where or "-",
        _details,
    )


def _details(item) -> str:
    """The reason without the ``where`` it starts with (the column beside it says that)."""
    return item.reason[len(item.where) + 2 :] if item.where and item.reason.startswith(item.where) else item.reason


def decode_report_blocks(result: DecodeCheckResult, per_case: bool = False, quiet: bool = False) -> list[Block]:
    """The matrices (unless ``quiet``), the caches, the unsupported, skipped and broken backends, the problems."""
    blocks = [] if quiet else _matrices(result, per_case)
    for title, texts in (
        ("Problems: backends that failed to load", result.broken_backends),
        ("Skipped (library not installed)", result.skipped_backends),
    ):
        if texts:
            blocks.append(Block(title, ["backend", "reason"], [[name, text] for name, text in texts.items()]))
    if not quiet:
        blocks += [b for b in (_cache_block(result), _grouped_unsupported(result)) if b is not None]
    return blocks + _problem_blocks(result)


def decode_summary_lines(result: DecodeCheckResult) -> list[str]:
    """The forward check's summary lines for the decode runs, each saying it is the decode check's."""
    lines = summary_lines(result)
    return [line if line.startswith("decode: ") else f"decode: {line}" for line in lines]
