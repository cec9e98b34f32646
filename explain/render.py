"""Three renderings of an `Explanation`: rich terminal tables, plain text, Markdown.

The renderers only lay out what the explanation measured; they compute nothing.
Rich is optional: without it (or with ``plain=True``) the same content prints as
fixed-width text.
"""

from __future__ import annotations

import sys

from mha_rosetta.backends import installed
from mha_rosetta.core import STAGE_BY_NAME, STAGE_NAMES
from mha_rosetta.core.tables import (
    Table,
    fill_lines,
    markdown_table,
    output_width,
    plain_lines,
    rich_console,
    rich_escape,
    rich_tables,
)

from .forms import FORMS_INTRO, form_tables
from .head_split import SPLIT_LABELS, grid_text, head_summary
from .real_checkpoints import CHECKPOINTS_INTRO, checkpoint_tables
from .stages_table import AXIS_MEANING
from .variants import VARIANTS_INTRO, variant_tables

# --- the tables, as (title, headers, rows) so that every renderer shows the same thing -------------


def _config_line(explanation) -> str:
    cfg, setup = explanation.cfg, explanation.setup
    return (
        f"batch {setup.batch}, tokens {setup.tokens}, d_model {cfg.d_model}, heads {cfg.n_heads}, "
        f"d_k {cfg.d_k}, d_v {cfg.d_v}; stage tensors in {explanation.dtype}"
    )


def backend_table(explanation) -> tuple[str, list[str], list[list[str]]]:
    headers = ["backend", "samples", "where the weights' scorers are", "convention"]
    rows = []
    for summary in explanation.backends:
        if summary.skipped:
            rows.append([summary.backend, "skipped", summary.skipped, ""])
        else:
            rows.append([summary.backend, summary.samples, summary.scorers, summary.convention])
    return "Backends at a glance (read off each backend's query projection)", headers, rows


def stage_tables(explanation) -> list[tuple[str, list[str], list[list[str]]]]:
    headers = ["backend", "shape", "axes", "strides (elements)", "contiguous", "memory", "note"]
    tables = []
    for stage_name in STAGE_NAMES:
        rows = [
            [row.backend, str(row.shape), " x ".join(row.axes), row.strides_text, row.contiguous, row.memory, row.note]
            for row in explanation.stages
            if row.stage == stage_name
        ]
        if rows:
            stage = STAGE_BY_NAME[stage_name]
            title = f"{stage_name} ({stage.step}; canonical {' x '.join(stage.shape)}): {stage.meaning}"
            tables.append((title, headers, rows))
    return tables


def axis_legend(explanation) -> tuple[str, list[str], list[list[str]]]:
    used = []
    for row in explanation.stages:
        used += [symbol for symbol in row.axes if symbol not in used]
    return "Axis symbols", ["symbol", "meaning"], [[symbol, AXIS_MEANING.get(symbol, symbol)] for symbol in used]


def weights_table(explanation) -> tuple[str, list[str], list[list[str]]]:
    headers = [
        "layout",
        "shape",
        "scorers",
        "from canonical",
        "back to canonical",
        "scorer j of head h",
        "verified",
        "evidence",
    ]
    rows = []
    for layout in explanation.weights:
        verified = {True: "yes", False: "NO", None: "n/a"}[layout.verified]
        rows.append(
            [
                layout.layout,
                str(layout.shape),
                layout.scorers,
                layout.from_canonical,
                layout.to_canonical,
                layout.head_scorer,
                verified,
                layout.evidence,
            ]
        )
    h = min(1, explanation.cfg.n_heads - 1)
    return f"One layer's weights in every layout (scorer j=0 of head h={h} located in each)", headers, rows


def claims_table(explanation) -> tuple[str, list[str], list[list[str]]]:
    rows = [[str(c.claim), c.title, c.verdict] for c in explanation.claims]
    return "The column/row-sample article's claims", ["#", "claim", "verdict"], rows


def difference_tables(explanation) -> list[tuple[str, str, list[str], list[list[str]], str]]:
    return [
        (d.title, d.status, ["run", "result"], [[run, result] for run, result in d.rows], d.takeaway)
        for d in explanation.differences
    ]


# --- plain text ------------------------------------------------------------------------------


def render_text(explanation, width: int | None = None) -> str:
    """Plain text fitted to ``width`` (None: every line as long as it needs): the tables' text cells wrap
    (`core.tables.plain_lines`), the head-split grid splits into parts that keep the token labels, and
    the remaining long lines wrap with their indent."""
    parts = [f"mha-rosetta explain: {_config_line(explanation)}"]
    for section in explanation.sections:
        parts += _text_section(explanation, section, width)
    lines = "\n\n".join(parts).splitlines()
    fitted = [out for line in lines for out in fill_lines(line, width, line[: len(line) - len(line.lstrip())])]
    return "\n".join(fitted) + "\n"


def _text_section(explanation, section: str, width: int | None = None) -> list[str]:
    def _text_table(headers: list[str], rows: list[list[str]]) -> str:
        return "\n".join(plain_lines(Table("", headers, rows), width))

    def titled(mark: str, table: tuple[str, list[str], list[list[str]]]) -> str:
        return f"{mark} {table[0]}\n{_text_table(*table[1:])}"

    if section == "stages":
        tables = [*stage_tables(explanation), axis_legend(explanation)]
        return [titled("==", backend_table(explanation))] + [titled("--", table) for table in tables]
    if section == "weights":
        return [titled("==", weights_table(explanation))]
    if section == "head_split":
        parts = []
        for split in explanation.head_split.values():
            parts.append(
                f"== Head split, {SPLIT_LABELS[split.name]}: {split.chain}\n{grid_text(split, width=width)}\n"
                + "\n".join(head_summary(split))
            )
        return parts
    if section == "checkpoints":
        return [f"== {CHECKPOINTS_INTRO}"] + [titled("--", table) for table in checkpoint_tables(explanation)]
    if section == "differences":
        parts = []
        for title, status, headers, rows, takeaway in difference_tables(explanation):
            body = _text_table(headers, rows) if rows else ""
            parts.append(f"== {title} [{status}]\n{body}" + (f"\n=> {takeaway}" if takeaway else ""))
        return parts
    if section == "variants":
        intro = f"== {VARIANTS_INTRO}\n{explanation.variants_pipeline}"
        return [intro] + [titled("--", table) for table in variant_tables(explanation.variants)]
    if section == "forms":
        return [f"== {FORMS_INTRO}"] + [titled("--", table) for table in form_tables(explanation.forms)]
    if section == "claims":
        parts = []
        for claim in explanation.claims:
            evidence = "\n".join(f"    - {line}" for line in claim.evidence)
            parts.append(f"claim {claim.claim}: {claim.title}\n  verdict: {claim.verdict}\n  evidence:\n{evidence}")
        return ["== The column/row-sample article's claims", *parts]
    return []


# --- rich --------------------------------------------------------------------------------------


def _rich_table(title: str, headers: list[str], rows: list[list[str]]):
    return rich_tables(Table(title, headers, rows), show_lines=False, expand=False)[0]


def _verdict_style(verdict: str) -> str:
    if verdict == "confirmed":
        return "bold green"
    if verdict.startswith("refuted"):
        return "bold red"
    if verdict.startswith("skipped"):
        return "dim"
    return "bold yellow"


def print_rich(explanation, file=None) -> None:
    from rich.panel import Panel

    # COLUMNS or the terminal's width; piped without COLUMNS, 160: wide lines read better than tables folded at 80.
    console = rich_console(file)
    console.rule(f"mha-rosetta explain: {rich_escape(_config_line(explanation))}")
    for section in explanation.sections:
        if section == "stages":
            for table in [backend_table(explanation), *stage_tables(explanation), axis_legend(explanation)]:
                console.print(_rich_table(*table))
        elif section == "weights":
            console.print(_rich_table(*weights_table(explanation)))
        elif section == "head_split":
            for split in explanation.head_split.values():
                title = rich_escape(f"Head split, {SPLIT_LABELS[split.name]}: {split.chain}")
                body = (
                    grid_text(split, colour=True, width=console.width - 4)
                    + "\n\n"
                    + rich_escape("\n".join(head_summary(split)))
                )
                console.print(Panel(body, title=title, expand=False))
        elif section == "checkpoints":
            console.print(rich_escape(CHECKPOINTS_INTRO))
            for table in checkpoint_tables(explanation):
                console.print(_rich_table(*table))
        elif section == "differences":
            for title, status, headers, rows, takeaway in difference_tables(explanation):
                console.print(_rich_table(f"{title} [{status}]", headers, rows))
                if takeaway:
                    console.print(f"  => {rich_escape(takeaway)}")
        elif section == "variants":
            console.print(rich_escape(VARIANTS_INTRO))
            console.print(rich_escape(explanation.variants_pipeline))
            for table in variant_tables(explanation.variants):
                console.print(_rich_table(*table))
        elif section == "forms":
            console.print(rich_escape(FORMS_INTRO))
            for table in form_tables(explanation.forms):
                console.print(_rich_table(*table))
        elif section == "claims":
            from rich.table import Table

            title = "The column/row-sample article's claims"
            table = Table(title=title, title_justify="left", show_lines=True, expand=True)
            for header, ratio in (("#", None), ("claim", 3), ("evidence", 6), ("verdict", 2)):
                table.add_column(header, overflow="fold", ratio=ratio)
            for claim in explanation.claims:
                evidence = "\n".join(f"- {rich_escape(line)}" for line in claim.evidence)
                table.add_row(
                    str(claim.claim),
                    rich_escape(claim.title),
                    evidence,
                    f"[{_verdict_style(claim.verdict)}]{rich_escape(claim.verdict)}[/]",
                )
            console.print(table)


def print_explanation(explanation, plain: bool = False, file=None) -> None:
    if plain or not installed("rich"):
        (file or sys.stdout).write(render_text(explanation, output_width(file)))
    else:
        print_rich(explanation, file=file)


# --- Markdown ------------------------------------------------------------------------------------


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    return "\n".join(markdown_table(headers, rows))


def _md_titled(heading: str, table: tuple[str, list[str], list[list[str]]]) -> list[str]:
    return [f"{heading} {table[0]}", "", _md_table(*table[1:]), ""]


def render_markdown(explanation, png_name: str | None = None) -> str:
    settings = explanation.settings
    lines = [
        "# Convention explainer",
        "",
        "Generated by `mha-rosetta explain --write-docs docs` (do not edit by hand; rerun the command).",
        f"Configuration: {_config_line(explanation)}. Generated {settings.get('generated', '')} on {settings.get('machine', '')}.",
        "Every shape, stride and verdict below comes from tensors of a real run on that machine.",
        "",
    ]
    for section in explanation.sections:
        lines += _md_section(explanation, section, png_name)
    return "\n".join(lines).rstrip() + "\n"


def _md_section(explanation, section: str, png_name: str | None) -> list[str]:
    out: list[str] = []
    if section == "stages":
        out += [*_md_titled("##", backend_table(explanation)), "## Stage by stage, backend by backend", ""]
        out += [
            "Strides are counted in elements. *memory* says whether a stage shares memory with the stage it was",
            "made from (a view costs nothing) or had to be copied; JAX arrays are immutable and XLA places them.",
            "",
        ]
        for table in [*stage_tables(explanation), axis_legend(explanation)]:
            out += _md_titled("###", table)
    elif section == "weights":
        out += _md_titled("##", weights_table(explanation))
    elif section == "head_split":
        out += ["## The head split: which cells of Q each head receives", ""]
        if png_name:
            out += [f"![head split]({png_name})", ""]
        for split in explanation.head_split.values():
            label = "Correct split" if split.name == "correct" else "The direct-reshape mistake"
            out += [f"### {label}: {split.chain}", "", "```", grid_text(split), "```", ""]
            out += [f"- {line}" for line in head_summary(split)] + [""]
    elif section == "checkpoints":
        from .real_checkpoints import PACKING_PNG

        out += ["## Real checkpoints", "", CHECKPOINTS_INTRO, ""]
        if png_name:
            out += [f"![three packings of q, k, v]({PACKING_PNG})", ""]
        for table in checkpoint_tables(explanation):
            out += _md_titled("###", table)
    elif section == "differences":
        out += ["## Framework differences, demonstrated", ""]
        for title, status, headers, rows, takeaway in difference_tables(explanation):
            out += [f"### {title}", "", f"Status: {status}.", ""]
            if rows:
                out += [_md_table(headers, rows), ""]
            if takeaway:
                out += [f"Takeaway: {takeaway}.", ""]
    elif section == "variants":
        out += ["## Variants", "", VARIANTS_INTRO, "", f"`{explanation.variants_pipeline}`", ""]
        for table in variant_tables(explanation.variants):
            out += _md_titled("###", table)
    elif section == "forms":
        out += ["## Forms in each convention", "", FORMS_INTRO, ""]
        for table in form_tables(explanation.forms):
            out += _md_titled("###", table)
    elif section == "claims":
        speed = explanation.settings.get("speed", {})
        title, headers, rows = claims_table(explanation)
        out += [f"## {title}", ""]
        if speed.get("run"):
            preset = "quick preset" if speed.get("quick") else "default preset"
            out += [
                f"Speed parts measured by the benchmark questions ({preset}, {speed.get('threads')} thread(s)) on the",
                "machine above; ratios move with the machine and its load, so rerun the command on yours.",
                "",
            ]
        out += [_md_table(headers, rows), ""]
        for claim in explanation.claims:
            out += [f"### Claim {claim.claim}: {claim.title}", "", f"Verdict: **{claim.verdict}**", ""]
            out += [f"- {line}" for line in claim.evidence] + [""]
    return out
