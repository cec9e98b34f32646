"""A benchmark report as PNG plots (matplotlib, imported when a plot is drawn).

Readable with 20 or more lines: every line gets its own (colour, marker) pair (`line_style`: the 20
colours of tab20 times 10 markers, 200 pairs before one repeats), and the time-against-tokens figure
has a second panel, each line's time over the fastest line's at the same size (`relative_to_fastest`),
where lines that crowd together on the log-time axis come apart.
"""

from __future__ import annotations

from pathlib import Path

from .report import REFERENCE_SIZE, cell_label, layer_biases
from .rounds import cell_interval, cell_time, is_corrected, published

MARKERS = "osD^v<>ph*"
DASHES = ("-", "--", ":")


def line_style(index: int) -> tuple[int, str, str]:
    """Line ``index``'s (tab20 colour index, marker, dash): distinct (colour, marker) pairs for 200 lines.

    Colours go dark shade first (0, 2, ..., 18), then the light ones (1, 3, ..., 19), so neighbours in the
    legend differ in hue. Lines 20 apart share a colour and take the marker ``index // 20`` places on.
    """
    colour = (2 * index) % 20 + (index // 10) % 2
    marker = MARKERS[(index + index // 20) % len(MARKERS)]
    return colour, marker, DASHES[(index // len(MARKERS)) % len(DASHES)]


def relative_to_fastest(series: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """``{label: {tokens: time}}`` as each time over the fastest label's time at the same tokens (1.0 = fastest)."""
    fastest: dict[int, float] = {}
    for points in series.values():
        for tokens, time in points.items():
            if time > 0:
                fastest[tokens] = min(time, fastest.get(tokens, time))
    return {
        label: {tokens: time / fastest[tokens] for tokens, time in points.items() if tokens in fastest}
        for label, points in series.items()
    }


def _size_group(cell: dict) -> tuple:
    return (cell["device"], cell["dtype"], cell["batch"], cell["d_model"], cell["heads"], cell["threads"])


def reference_cells(report: dict) -> list[dict]:
    """The measured cells at the reference size; failing that, at the largest size measured."""
    ok = [cell for cell in report["cells"] if cell.get("status") == "ok" and cell["device"] == "cpu"] or [
        cell for cell in report["cells"] if cell.get("status") == "ok"
    ]
    at_reference = [cell for cell in ok if all(cell.get(key) == value for key, value in REFERENCE_SIZE.items())]
    if at_reference or not ok:
        return at_reference
    largest = max(ok, key=lambda cell: (cell["batch"] * cell["tokens"] * cell["d_model"], cell["tokens"]))
    return [cell for cell in ok if _size_group(cell) == _size_group(largest) and cell["tokens"] == largest["tokens"]]


def pyplot_into(directory: str | Path):
    """matplotlib's pyplot, and ``directory`` as a Path (created where missing) for its figures."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window, works without a display
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return plt, directory


def save_figure(plt, figure, path: Path) -> Path:
    """Lay ``figure`` out, write it to ``path`` (PNG) and close it."""
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_report(report: dict, directory: str | Path) -> list[Path]:
    """time vs tokens (log-log, one line per implementation, over a panel of time / fastest) per size group, and a bar chart
    of GFLOP/s at the reference size. Returns the files written (PNG)."""
    plt, directory = pyplot_into(directory)
    written: list[Path] = []
    ok = [cell for cell in report["cells"] if cell.get("status") == "ok"]
    groups: dict[tuple, list[dict]] = {}
    for cell in ok:
        groups.setdefault(_size_group(cell), []).append(cell)
    for group, cells in groups.items():
        device, dtype, batch, d_model, heads, threads = group
        labels = sorted({cell_label(cell) for cell in cells})
        figure, (axes, ratio_axes) = plt.subplots(
            2, 1, figsize=(11, 9.5), sharex=True, gridspec_kw={"height_ratios": (3, 2)}
        )
        colors = plt.get_cmap("tab20").colors
        series: dict[str, dict[int, float]] = {}
        for index, label in enumerate(labels):
            points = sorted(
                (cell["tokens"], cell_time(cell), *cell_interval(cell)) for cell in cells if cell_label(cell) == label
            )
            series[label] = {p[0]: p[1] for p in points}
            medians = [p[1] * 1e3 for p in points]
            # Error bars: the range of the round medians (zero height with one round).
            below = [max(0.0, (p[1] - p[2]) * 1e3) for p in points]
            above = [max(0.0, (p[3] - p[1]) * 1e3) for p in points]
            colour, marker, dash = line_style(index)
            axes.errorbar(
                [p[0] for p in points], medians, yerr=[below, above], label=label, capsize=2,
                color=colors[colour], marker=marker, linestyle=dash,
            )  # fmt: skip
        for index, points in enumerate(relative_to_fastest(series).values()):
            colour, marker, dash = line_style(index)  # `series` keeps the order of `labels`
            ratio_axes.plot(list(points), list(points.values()), color=colors[colour], marker=marker, linestyle=dash)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        ratio_axes.set_yscale("log")
        from matplotlib.ticker import FuncFormatter

        times = FuncFormatter(lambda value, _: f"{value:g}×")  # 1×, 2×, 3× rather than 2 × 10^0
        ratio_axes.yaxis.set_major_formatter(times)
        ratio_axes.yaxis.set_minor_formatter(times)
        ratio_axes.set_xlabel("tokens N")
        ratio_axes.set_ylabel("time / fastest at this N (1 = fastest)")
        ratio_axes.axhline(1.0, color="black", linewidth=0.8)
        ratio_axes.grid(True, which="both", alpha=0.3)
        what = "drift-corrected median" if any(is_corrected(cell) for cell in cells) else "median"
        axes.set_ylabel(f"{what} time per call (ms; bars: range over rounds)")
        axes.set_title(f"{device} {dtype}, B={batch}, d_model={d_model}, heads={heads}, {threads} thread(s)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if len(labels) <= 24 else 2)
        name = f"time_vs_tokens_{device}_{dtype}_B{batch}_D{d_model}_H{heads}_T{threads}.png"
        written.append(save_figure(plt, figure, directory / name))
    at_reference = reference_cells(report)
    if at_reference:
        at_reference = sorted(at_reference, key=lambda cell: published(cell, "gflops") or 0, reverse=True)
        sample = at_reference[0]
        figure, axes = plt.subplots(figsize=(8, 0.4 * len(at_reference) + 1.8))
        labels = [cell_label(cell) for cell in at_reference]
        values = [published(cell, "gflops") or 0 for cell in at_reference]
        # Error bars: GFLOP/s at the slowest and fastest round median.
        slowest = [cell["flops"] / cell_interval(cell)[1] / 1e9 if cell.get("flops") else 0 for cell in at_reference]
        fastest = [cell["flops"] / cell_interval(cell)[0] / 1e9 if cell.get("flops") else 0 for cell in at_reference]
        xerr = [
            [max(0.0, value - low) for value, low in zip(values, slowest, strict=True)],
            [max(0.0, high - value) for value, high in zip(values, fastest, strict=True)],
        ]
        axes.barh(labels, values, xerr=xerr, capsize=3, color="tab:blue", ecolor="black")
        axes.invert_yaxis()
        peak = sample.get("gemm_peak_gflops")
        if peak:
            axes.axvline(peak, color="tab:red", linestyle="--", label=f"GEMM peak {peak:.0f}")
            axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        for index, cell in enumerate(at_reference):
            fraction = published(cell, "peak_fraction")
            if fraction is not None:
                end = values[index] + xerr[1][index]  # after the error bar
                axes.text(end, index, f" {100 * fraction:.0f}%", va="center", fontsize="small")
        peak_text = "of the GEMM peak" if is_corrected(sample) else "of each round's GEMM peak"
        what = "drift-corrected median" if is_corrected(sample) else "median"
        axes.set_xlabel(f"GFLOP/s (matmul FLOPs / {what} time; bars: range over rounds; %: {peak_text})")
        at_reference_size = all(sample.get(key) == value for key, value in REFERENCE_SIZE.items())
        axes.set_title(
            f"B={sample['batch']}, N={sample['tokens']}, d_model={sample['d_model']}, heads={sample['heads']}, "
            f"{sample['dtype']}, {sample['device']}, {sample['threads']} thread(s)"
            + ("" if at_reference_size else "\n(the reference size was not measured: largest size shown)")
        )
        written.append(save_figure(plt, figure, directory / "gflops_at_reference_size.png"))
    return written


DECODE_PLOT_NAME = "decode_step_vs_context.png"  # the one file `plot_decode` writes (benchmarks.decode links it)


def _decode_series_label(cell: dict) -> str:
    from .decode import row_label

    return cell["implementation"] + row_label(cell)  # the paged, windowed and ragged rows beside the main one


def plot_decode(report: dict, directory: str | Path) -> list[Path]:
    """``bench --mode decode``: the step time against the context (log-log, one line per implementation and
    window, bars: the range over rounds) with the bandwidth limit of the K and V reads as black lines (solid
    without a window, dotted with one), and below it each cache's memory (its O(W) with a window).
    Returns the file written (PNG), or [] without a measured cell."""
    ok = [cell for cell in report["cells"] if cell.get("status") == "ok" and cell.get("step_s")]
    if not ok:
        return []
    plt, directory = pyplot_into(directory)
    figure, (axes, memory_axes) = plt.subplots(
        2, 1, figsize=(11, 9.5), sharex=True, gridspec_kw={"height_ratios": (3, 2)}
    )
    colors = plt.get_cmap("tab20").colors
    labels = sorted({_decode_series_label(cell) for cell in ok})
    for index, label in enumerate(labels):
        cells = sorted((cell for cell in ok if _decode_series_label(cell) == label), key=lambda cell: cell["context"])
        contexts = [cell["context"] for cell in cells]
        medians = [cell["step_s"] * 1e3 for cell in cells]
        below = [max(0.0, (cell["step_s"] - cell["step_spread_s"][0]) * 1e3) for cell in cells]
        above = [max(0.0, (cell["step_spread_s"][1] - cell["step_s"]) * 1e3) for cell in cells]
        colour, marker, dash = line_style(index)
        axes.errorbar(
            contexts, medians, yerr=[below, above], label=label, capsize=2, color=colors[colour], marker=marker,
            linestyle=dash,
        )  # fmt: skip
        memory = [(cell["context"], cell["cache_mb"]) for cell in cells if cell.get("cache_mb") is not None]
        if memory:
            memory_axes.plot(
                [m[0] for m in memory], [m[1] for m in memory], color=colors[colour], marker=marker, linestyle=dash
            )
    main = [c for c in ok if c.get("batch") == report["settings"].get("batch")]  # the limit lines: the main batch's
    for window, style in ((None, "-"), *((w, ":") for w in sorted({c["window"] for c in ok if c.get("window")}))):
        limits = sorted({(c["context"], c["limit_s"]) for c in main if c.get("window") == window and c.get("limit_s")})
        if limits:
            name = "bandwidth limit (K, V reads)" + ("" if window is None else f", W={window}")
            axes.plot(
                [p[0] for p in limits], [p[1] * 1e3 for p in limits], color="black", linestyle=style, label=name,
            )  # fmt: skip
    weighted = sorted(
        {
            (c["context"], c["limit_with_weights_s"])
            for c in main
            if c.get("window") is None and c.get("limit_with_weights_s")
        }
    )
    if weighted:
        axes.plot(
            [p[0] for p in weighted], [p[1] * 1e3 for p in weighted], color="grey", linestyle="--",
            label="bandwidth limit with the projection weights",
        )  # fmt: skip
    settings = report["settings"]
    bandwidth = ", ".join(f"{b['gbps']:.1f} GB/s" for b in report.get("bandwidth", []) if b.get("gbps"))
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    what = "drift-corrected median" if any(is_corrected(cell) for cell in ok) else "median"
    axes.set_ylabel(f"{what} time per step (ms; bars: range over rounds)")
    axes.set_title(
        f"decode, B={settings['batch']}, {settings['step']} token/step, d_model={settings['d_model']}, "
        f"{settings['heads']}/{settings['kv_heads']} heads, d_k={settings['d_k']}, "
        f"{layer_biases(settings)}, {settings['dtype']},\n"
        f"{settings['threads']} thread(s); copy bandwidth {bandwidth or 'not measured'}"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    memory_axes.set_yscale("log")
    memory_axes.set_xlabel("context (cached tokens)")
    memory_axes.set_ylabel("KV cache (MiB, info['cache']['bytes'])")
    memory_axes.grid(True, which="both", alpha=0.3)
    return [save_figure(plt, figure, directory / DECODE_PLOT_NAME)]
