"""A benchmark report as PNG plots (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path

from .report import REFERENCE_SIZE, cell_label
from .rounds import cell_interval, cell_time, is_corrected, published


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
    """time vs tokens (log-log, one line per implementation) per size group, and a bar chart
    of GFLOP/s at the reference size. Returns the files written (PNG)."""
    plt, directory = pyplot_into(directory)
    written: list[Path] = []
    ok = [cell for cell in report["cells"] if cell.get("status") == "ok"]
    groups: dict[tuple, list[dict]] = {}
    for cell in ok:
        groups.setdefault(_size_group(cell), []).append(cell)
    for group, cells in groups.items():
        device, dtype, batch, d_model, heads, threads = group
        figure, axes = plt.subplots(figsize=(10, 5.5))
        colors = plt.get_cmap("tab20").colors  # 20 distinct colours; markers and dashes tell repeats apart
        markers, dashes = "osD^v<>ph*", ("-", "--", ":")
        for index, label in enumerate(sorted({cell_label(cell) for cell in cells})):
            points = sorted(
                (cell["tokens"], cell_time(cell), *cell_interval(cell)) for cell in cells if cell_label(cell) == label
            )
            medians = [p[1] * 1e3 for p in points]
            # Error bars: the range of the round medians (zero height with one round).
            below = [max(0.0, (p[1] - p[2]) * 1e3) for p in points]
            above = [max(0.0, (p[3] - p[1]) * 1e3) for p in points]
            axes.errorbar(
                [p[0] for p in points], medians, yerr=[below, above], label=label, capsize=2,
                color=colors[(2 * index) % 20 + (index // 10) % 2], marker=markers[index % len(markers)],
                linestyle=dashes[(index // len(markers)) % len(dashes)],
            )  # fmt: skip
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("tokens N")
        what = "drift-corrected median" if any(is_corrected(cell) for cell in cells) else "median"
        axes.set_ylabel(f"{what} time per call, forward (or fwd+bwd) (ms; bars: range over rounds)")
        axes.set_title(f"{device} {dtype}, B={batch}, d_model={d_model}, heads={heads}, {threads} thread(s)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
