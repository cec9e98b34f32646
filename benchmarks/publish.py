"""The published files of a bench report: its JSON, its Markdown table and its plots under ``docs/bench/``, and the
generated block of the page that shows it (`publish_report`, the one rule of `write_docs` and of
`decode_docs.write_decode_docs`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .markdown import markdown_table
from .plots import plot_report
from .readme import (
    BEGIN,
    BENCH_FOLDER,
    END,
    block_page_path,
    load_reference_reports,
    readme_block,
    replace_block,
    report_name,
)


def write_docs(report: dict, docs: str | Path, *, table: str | None = None) -> list[Path]:
    """Write ``report``'s JSON, Markdown and plots under ``docs/bench/`` and regenerate the page's block.

    Returns the files written. The benchmarks page (`block_page_path`) is updated only where it holds the
    markers; the block is rendered from the reference reports now in ``docs/bench/``.
    """
    stem = Path(docs) / BENCH_FOLDER / report_name(report)
    return publish_report(
        report, stem, table if table is not None else markdown_table(report), plot_report,
        block_page_path(docs), lambda: readme_block(load_reference_reports(docs)),
    )  # fmt: skip


def publish_report(
    report: dict,
    stem: Path,
    table: str,
    plot: Callable[[dict, Path], list[Path]],
    page: Path,
    block: Callable[[], str],
    markers: tuple[str, str] = (BEGIN, END),
    what: str = "benchmark",
) -> list[Path]:
    """The published files of a report (`write_docs`' and `decode_docs.write_decode_docs`' one rule): ``report``
    as ``stem.json``, its Markdown ``table`` as ``stem.md``, its plots (``plot(report, stem)``; none without
    matplotlib: the caller says so), and the generated block between ``markers`` in ``page`` (rendered by
    ``block()``), only where ``page`` exists and holds them. Returns the files written."""
    from mha_rosetta.core.files import write_text_atomic

    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.md"
    write_text_atomic(json_path, json.dumps(report, indent=2, allow_nan=True) + "\n")
    write_text_atomic(md_path, table)
    written = [json_path, md_path]
    try:
        written += plot(report, stem)
    except ImportError:
        pass  # no matplotlib: the caller says so
    if page.exists():
        text = page.read_text(encoding="utf-8")
        if markers[0] in text:
            updated = replace_block(text, block(), markers, what)
            if updated != text:
                write_text_atomic(page, updated)
                written.append(page)
    return written
