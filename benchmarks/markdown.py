"""A benchmark report as Markdown: the settings that matter, the rounds, and one row per cell."""

from __future__ import annotations

from mha_rosetta.core.tables import markdown_table as table_lines

from .report import FORWARD_SIZE, cell_label, layer_biases
from .rounds import cell_interval, cell_time, is_corrected, raw_interval
from .variants import VARIANT_COLUMNS, variant_pivot, variant_rows


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def _fmt(value, pattern: str) -> str:
    return "" if value is None else format(value, pattern)


MARKDOWN_COLUMNS = (
    "implementation", "device", "dtype", "B", "N", "D", "H", "median ms", "rounds ms", "IQR ms", "min ms", "n",
    "compile s", "GFLOP/s", "% peak", "cores", "mem MB", "status",
)  # fmt: skip
# With paired references (schema 2): the corrected figure and its round range first, the raw ones beside.
CORRECTED_COLUMNS = (
    *MARKDOWN_COLUMNS[:7], "corrected ms", "rounds ms", "raw ms", "raw rounds ms", *MARKDOWN_COLUMNS[9:],
)  # fmt: skip


def round_range_text(cell: dict, digits: int = 3, *, raw: bool = False) -> str:
    """``"84.032-88.100"``: the lowest and highest round figure in ms ("" with fewer than two rounds): of the
    corrected figures where the cell has them (`rounds.cell_interval`), of the raw medians with ``raw``."""
    measured = [value for value in cell.get("round_medians_s") or [] if value is not None]
    if len(measured) < 2:
        return ""
    low, high = raw_interval(cell) if raw else cell_interval(cell)
    return f"{low * 1e3:.{digits}f}-{high * 1e3:.{digits}f}"


def status_text(cell: dict, limit: int) -> str:
    """A table row's status column: the status, then a failed cell's error (made table-safe: no pipe, no line
    break; ``: error`` cut at ``limit`` characters), or ``(drift)`` / ``(!)`` where a measured cell has warnings."""
    status = cell.get("status", "")
    if status != "ok":
        return status + f": {cell.get('error', '')}".replace("|", "/").replace("\n", " ")[:limit]
    if cell.get("warnings"):
        return status + (" (drift)" if cell.get("drift") else " (!)")
    return status


def markdown_row(cell: dict, corrected: bool = False) -> list[str]:
    """One table row; ``corrected``: the `CORRECTED_COLUMNS` layout (GFLOP/s and % peak from the corrected time)."""
    ok = cell.get("status") == "ok"
    paired = corrected and is_corrected(cell)
    fraction = cell.get("corrected_peak_fraction" if paired else "peak_fraction")
    gflops = cell.get("corrected_gflops" if paired else "gflops")
    status = status_text(cell, 120)
    return [
        f"`{cell_label(cell)}`", cell["device"], cell["dtype"], str(cell["batch"]), str(cell["tokens"]),
        str(cell["d_model"]), str(cell["heads"]),
        _ms(cell_time(cell)) if ok else "", round_range_text(cell) if ok else "",
        *([_ms(cell.get("median_s")) if ok else "", round_range_text(cell, raw=True) if ok else ""] if corrected else []),
        _ms(cell.get("iqr_s")) if ok else "", _ms(cell.get("min_s")) if ok else "",
        str(cell.get("repeats", "")) if ok else "", _fmt(cell.get("compile_s"), ".2f"), _fmt(gflops, ".1f"),
        "" if fraction is None else f"{100 * fraction:.0f}%", _fmt(cell.get("cpu_util"), ".2f"),
        _fmt(cell.get("peak_mem_mb"), ".1f"), status,
    ]  # fmt: skip


def rounds_lines(report: dict) -> list[str]:
    """The rounds, their seed, each round's GEMM peak and the rounds flagged busy ([] without rounds)."""
    rounds = report.get("rounds")
    if not rounds:
        return []
    visits = rounds.get("visits", 1)
    each = "once" if visits == 1 else f"{visits} times (each a fresh process, pooled into the round's median)"
    lines = [
        f"Rounds: {rounds['count']} (seed {rounds['seed']}), each visiting every cell {each} in a shuffled order; "
        "a cell's median pools every round's samples, \"rounds ms\" is the range of its round medians  "
    ]
    for key, values in rounds.get("gemm_peaks_gflops", {}).items():
        shown = ", ".join("-" if value is None else f"{value:.1f}" for value in values)
        lines.append(f"GEMM peak {key} per round: {shown} GFLOP/s  ")
    for index in rounds.get("busy_rounds", []):
        lines.append(
            f"(!) round {index + 1}: its GEMM peak is more than {rounds['busy_threshold']:.0%} below the best "
            "other round's: the machine was busy  "
        )
    return lines


def reference_lines(report: dict) -> list[str]:
    """How the corrected figures were made: the reference workloads, their run medians, their time share."""
    reference = report.get("reference")
    if not reference:
        return []
    lines = [
        'Drift-corrected: every sample was followed by one sample of a fixed reference product; "corrected ms" '
        "is the median of the cell's samples x (the run's median reference time / the sample's reference) ^ beta, "
        "beta the cell's own slope of log(sample) on log(reference) in [0, 1] (0: the reference did not track it), "
        '"raw ms" the plain median; rankings and comparisons use the corrected figure  '
    ]
    for key, workload in reference.get("workloads", {}).items():
        median = workload.get("median_s")
        shown = (
            "not measured" if median is None else f"{median * 1e3:.3f} ms, the median of {workload['visits']} visits"
        )
        lines.append(f"Reference {key} ({workload['n']}³ {workload['dtype']} product): {shown}  ")
    if reference.get("time_share") is not None:
        lines.append(f"The reference took {reference['time_share']:.0%} of the timed work  ")
    return lines


def best_column(columns: tuple, rows: list[list[str]], cells: list[dict]) -> tuple[tuple, list[list[str]]]:
    """The table with an "x its best" column after the time's (`best_gap.mark_over_best`'s ``over_best``)."""
    at = columns.index("rounds ms")
    marked = [[*row[:at], _fmt(cell.get("over_best"), ".2f"), *row[at:]] for row, cell in zip(rows, cells, strict=True)]
    return (*columns[:at], "x its best", *columns[at:]), marked


def gap_cause_lines(cells: list[dict], same: tuple, time_of, row_of) -> list[str]:
    """Under a table: each gap to a framework's best path with its cause (`best_gap.gap_lines`) and each pair of best
    paths over 1.3x apart with the limit that explains it (`best_gap.peer_lines`); [] where the run shows none."""
    from .best_gap import NOISE_BELOW, PEER_TARGET, gap_lines, peer_lines

    lines = []
    gaps = gap_lines(cells, row_of)
    if gaps:
        lines += [
            "",
            f"Why each implementation at {NOISE_BELOW:.2f}x its best or more takes longer (the range over this run's "
            "sizes; the cause its backend class declares, `gap_causes`, from measurements, the code or the compiled "
            "program):",
            "",
            *gaps,
        ]
    peers = peer_lines(cells, same, time_of, row_of)
    if peers:
        lines += [
            "",
            f"Best paths more than {PEER_TARGET}x apart (issue 43's target between them), with the library limit that "
            "keeps the slower one from its peers (`peer_limits`):",
            "",
            *peers,
        ]
    return lines


def decode_gap_lines(cells: list[dict]) -> list[str]:
    """`gap_cause_lines` of a decode run: the step times, each row named as the tables name it (`decode.row_label`)."""
    from .best_gap import DECODE_SIZE
    from .decode import row_label

    return gap_cause_lines(cells, DECODE_SIZE, lambda cell: cell.get("step_s"), row_label)


def variant_row(cell: dict) -> str:
    """What sets a forward cell apart beside its implementation for the gap lines: its variant, "" for the plain one."""
    return "" if cell.get("variant") is None else f" [{cell['variant']}]"


def markdown_table(report: dict) -> str:
    """The cells as a Markdown table, preceded by the GEMM peaks and the settings that matter."""
    lines = []
    headline = report.get("gemm_peak_key")
    for peak in report.get("gemm_peaks", []):
        gflops = peak.get("gflops")
        text = f"{gflops:.1f} GFLOP/s ({peak.get('library')}, n={peak.get('n')})" if gflops else "not measured"
        measured = [value for value in peak.get("round_gflops") or [] if value is not None]
        if gflops and len(measured) > 1:
            text += f", the median of {len(measured)} rounds"
        key = f"{peak['device']}/{peak['dtype']}"
        marker = " (the headline gemm_peak_gflops)" if key == headline and len(report["gemm_peaks"]) > 1 else ""
        lines.append(f"GEMM peak {key}, {peak['threads']} thread(s): {text}{marker}  ")
    machine = report.get("machine", {})
    if machine:
        lines.append(
            f"Machine: {machine.get('cpu_model')}, {machine.get('cores')} cores, Python {machine.get('python')}  "
        )
    lines += rounds_lines(report)
    malloc = report.get("settings", {}).get("malloc")
    if malloc:
        rule = "glibc mmap/trim thresholds raised to 4 GiB" if malloc == "keep" else "the environment as it was"
        # Reports before 2026-12-03 kept the threads' own arenas (pinning.malloc_env): their line says less.
        one_arena = any((cell.get("malloc_env") or {}).get("MALLOC_ARENA_MAX") for cell in report["cells"])
        if malloc == "keep" and one_arena:
            rule += ", one arena for every thread"
        lines.append(f"Allocator: malloc={malloc} ({rule}), the same for every cell  ")
    if lines:
        lines.append("")
    lines += reference_lines(report)
    corrected = any(is_corrected(cell) for cell in report["cells"])
    columns = CORRECTED_COLUMNS if corrected else MARKDOWN_COLUMNS
    rows = [markdown_row(cell, corrected) for cell in report["cells"]]
    if any(cell.get("over_best") is not None for cell in report["cells"]):  # a run that timed the best paths
        from mha_rosetta.backends.best import BEST_BY_LIBRARY  # plain data: imports no framework

        columns, rows = best_column(columns, rows, report["cells"])
        lines.append(
            '"x its best": the cell over its framework\'s best path (' + ", ".join(BEST_BY_LIBRARY.values())
            + ") at the same size in this run: compare frameworks on the best paths  "
        )  # fmt: skip
    lines += table_lines(columns, rows)
    lines += gap_cause_lines(report["cells"], FORWARD_SIZE, cell_time, variant_row)
    if any(cell.get("variant") is not None for cell in report["cells"]):
        lines += ["", "What each variant costs (its time over its baseline's, the same implementation and size):", ""]
        lines += table_lines(VARIANT_COLUMNS, variant_rows(report["cells"], cell_time))
        columns, rows = variant_pivot(report["cells"], cell_time)
        lines += ["", "The same, one column per implementation (ms, and the cost over the baseline):", ""]
        lines += table_lines(columns, rows)
    warned = [cell for cell in report["cells"] if cell.get("warnings")]
    if warned:
        lines.append("")
        lines.append("(!) warnings:")
        for cell in warned:
            for warning in cell["warnings"]:
                lines.append(f"- `{cell_label(cell)}` N={cell['tokens']}: {warning}")
    return "\n".join(lines) + "\n"


# ``bench --mode decode`` (benchmarks.decode): one row per (implementation, window, context).
DECODE_COLUMNS = (
    "implementation", "cache", "W", "context", "step ms", "rounds ms", "x its best", "% of read limit", "KV MiB read",
    "KV limit ms", "% of KV limit", "% with weights", "tokens/s", "prefill ms", "prefill / step", "cache slots",
    "cache MiB", "cores", "status",
)  # fmt: skip


def percent(fraction: float | None, digits: int = 0) -> str:
    """``42%`` (``digits`` decimals), or "" without a figure: the generated blocks (0) and the full tables (1)."""
    return "" if fraction is None else f"{100 * fraction:.{digits}f}%"


def decode_row(cell: dict) -> list[str]:
    """One decode table row (`DECODE_COLUMNS`); the figures are those `bandwidth.enrich_decode_cell` added."""
    ok = cell.get("status") == "ok"
    cache = cell.get("cache_info") if isinstance(cell.get("cache_info"), dict) else {}
    status = status_text(cell, 160)
    if ok and cell.get("prefill_status") not in (None, "ok"):
        status += f"; prefill {cell['prefill_status']}" + (
            f": {cell['prefill_error'][:80]}" if cell.get("prefill_error") else ""
        )
    fraction = cell.get("limit_fraction")
    with_weights = cell.get("limit_fraction_with_weights")
    from .decode import RAGGED_ROW, row_label

    kind = str(cache.get("kind") or cell.get("cache") or "")
    if cell.get("row") == RAGGED_ROW:  # the ragged row: its batches beside the rectangular one, in the cache column
        kind = (
            kind + row_label({"lengths": cell.get("lengths"), "row": RAGGED_ROW, "batch": cell.get("batch")})
        ).strip()
    return [
        f"`{cell['implementation']}`", kind,
        "" if cell.get("window") is None else str(cell["window"]), str(cell["context"]),
        _ms(cell.get("step_s")) if ok else "", round_range_text(cell) if ok else "",
        _fmt(cell.get("over_best"), ".2f"), percent(cell.get("read_limit_fraction"), 1),
        f"{cell['kv_read_bytes'] / 2**20:.2f}" if cell.get("kv_read_bytes") is not None else "",
        _ms(cell.get("limit_s")),
        percent(fraction, 1), percent(with_weights, 1),
        _fmt(cell.get("tokens_per_s"), ".0f"), _ms(cell.get("prefill_median_s")),
        _fmt(cell.get("prefill_over_step"), ".0f"), str(cache.get("slots", "")),
        _fmt(cell.get("cache_mb"), ".2f"), _fmt(cell.get("cpu_util"), ".2f"), status,
    ]  # fmt: skip


def ratio_lines(cells: list[dict], field: str, label, sentence: str) -> list[str]:
    """A paragraph of each cell's ratio ``field`` (``paged_over_contiguous``, ``ragged_over_rectangular``) after
    ``sentence``, each cell named by its implementation and ``label(cell)``; none without one."""
    shown = [cell for cell in cells if cell.get(field) is not None]
    if not shown:
        return []
    return [
        "",
        sentence + ", ".join(f"`{c['implementation']}`{label(c)} {c['context']}: {c[field]:.2f}x" for c in shown),
    ]


def read_kernel_text(record: dict) -> str:
    """Which reader gave the read bandwidth: the fastest of `limits.READ_KERNELS`, each one's figure beside it; a
    report from before the three readers names its one (``np.sum``)."""
    read = (record.get("read") or {}).get("read") or {}
    kernels = read.get("kernels")
    if not kernels:
        return "np.sum"
    others = ", ".join(f"{name} {gbps:.2f}" for name, gbps in kernels.items() if gbps)
    return f"{read.get('kernel')}, the fastest of {len(kernels)} readers: {others}; each"


def decode_markdown(report: dict) -> str:
    """A decode report as Markdown: the bandwidth, the layer, the rounds, one row per cell, the cache layouts."""
    settings = report["settings"]
    lines = []
    for record in report.get("bandwidth", []):
        gbps = record.get("gbps")
        measured = [value for value in record.get("round_gbps") or [] if value is not None]
        text = f"{gbps:.2f} GB/s ({record.get('library')}" if gbps else "not measured"
        if gbps:
            text += f", {record.get('array_mb', 0):.0f} MiB arrays, {record.get('array_rule', '')}"
            low, high = record.get("spread_gbps") or (gbps, gbps)
            text += f"; the median of {len(measured)} rounds, {low:.2f}-{high:.2f})" if len(measured) > 1 else ")"
        lines.append(f"Copy bandwidth {record['device']}, {record['threads']} thread(s): {text}  ")
        if record.get("read_gbps"):
            cache = record.get("measured_llc_bytes")
            lines.append(
                f"Read bandwidth {record['device']}: {record['read_gbps']:.2f} GB/s ({read_kernel_text(record)} over "
                f"arrays larger than the last-level cache as measured, "
                f"{'not found' if not cache else f'{cache / 2**20:.0f} MiB'})  "
            )
        lines += [f"(!) {warning}  " for warning in record.get("warnings") or []]
    machine = report.get("machine", {})
    if machine:
        lines.append(
            f"Machine: {machine.get('cpu_model')}, {machine.get('cores')} cores, Python {machine.get('python')}  "
        )
    window = f"; the windowed row W={settings['window']}" if settings.get("window") else ""
    lines.append(
        f"Layer: d_model {settings['d_model']}, {settings['heads']} heads, {settings['kv_heads']} kv heads, "
        f"d_k {settings['d_k']}, rope {settings.get('rope')}, "
        f"{layer_biases(settings)}, {settings['dtype']}, B={settings['batch']}, "
        f"{settings['step']} token(s) per step{window}  "
    )
    from mha_rosetta.backends.best import BEST_BY_LIBRARY  # plain data: imports no framework

    lines.append(
        '"% of read limit": every byte a step reads (K, V and the four projection matrices) over the read '
        f'bandwidth; "x its best": the step over its framework\'s best path ({", ".join(BEST_BY_LIBRARY.values())}) '
        "at the same context, where this run timed it  "
    )
    lines.append(
        "KV limit: the K and V bytes a step reads (B x slots x Hkv x (Dk + Dv) x itemsize; slots = the context, "
        'at most the ring\'s W - 1 + step) over the copy bandwidth; "% with weights" adds the four projection '
        "matrices the step also reads. Prefill: one forward of the context through the decode path "
        "(prefill=context), raw median  "
    )
    rounds = report.get("rounds")
    if rounds:
        lines.append(
            f"Rounds: {rounds['count']} (seed {rounds['seed']}), each visiting every cell once in a shuffled order  "
        )
    lines.append("")
    lines += reference_lines(report)
    lines += table_lines(DECODE_COLUMNS, [decode_row(cell) for cell in report["cells"]])
    from .decode import row_label

    lines += ratio_lines(
        report["cells"], "paged_over_contiguous", lambda cell: row_label({**cell, "cache": None}),
        "Paged over contiguous (the same step with K and V read through a block table of 16-token pages, over "
        "the implementation's contiguous cache at that context: the gather's cost): ",
    )  # fmt: skip
    lines += ratio_lines(
        report["cells"], "ragged_over_rectangular", row_label,
        "Ragged over rectangular (continuous batching: rows at different lengths holding as many tokens as the "
        "rectangular batch, each at its own position, over that batch through the same cache; a contiguous "
        "cache reads every row to the longest): ",
    )  # fmt: skip
    from .decode_mla import mla_lines

    lines += mla_lines(report["cells"])  # the MLA row: the latent's bytes a token, absorbed over naive
    lines += decode_gap_lines(report["cells"])
    from .cache_flags import cache_flag_lines

    lines += cache_flag_lines(report)  # the steps a cache fed, as measured or as their speed shows
    layouts = {}
    for cell in report["cells"]:
        cache = cell.get("cache_info")
        if isinstance(cache, dict) and cache.get("layout"):
            layouts.setdefault((cell["implementation"], cache.get("kind")), cache["layout"])
    if layouts:
        lines += ["", "Cache layouts:", ""]
        lines += [f"- `{label}` {kind}: {layout}" for (label, kind), layout in layouts.items()]
    warned = [cell for cell in report["cells"] if cell.get("warnings")]
    if warned:
        lines += ["", "(!) warnings:"]
        for cell in warned:
            lines += [
                f"- `{cell['implementation']}` context={cell['context']}: {warning}" for warning in cell["warnings"]
            ]
    return "\n".join(lines) + "\n"
