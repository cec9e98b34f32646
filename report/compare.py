"""One comparison of bench runs, and the regression gate against a baseline.

The rules (also in ``mha-rosetta report --help`` and docs/report.md) are those of every comparison of two
runs, ``bench --baseline`` and ``bench --compare`` included: `mha_rosetta.benchmarks.verdict`.
- **Figure**: a cell's ``corrected_median_s`` (drift-corrected, bench schema 2) when present, else its ``median_s``;
  each cell says which it used.
- **Range** (the cell's own spread): ``[min, max]`` of the round medians of the figure used
  (``corrected_spread_s`` for ``corrected_median_s``, ``spread_s`` for ``median_s``), else the figure alone.
- **Ratio** of a cell to the same cell in the first column (the reference), with its range
  ``[lo/hi_ref, hi/lo_ref]``; **within noise** when the two ranges overlap.
- **Regression** (``--baseline FILE --fail-on-regression PCT``): a cell is a regression when
  `verdict.verdict` calls it slower at PCT %: its range lies wholly above the baseline cell's range
  (slower beyond noise) *and* its figure is more than PCT % above the baseline's figure. Cells are
  matched by `verdict.comparison_key` (implementation, variant, mode, dtype, shape, threads and
  device); unmatched cells are listed, never failed.
- **Decode cells** (``bench --mode decode``, ``"mode": "decode"``): the same rules, on the time of one
  decode step; a cell's shape is its context, window and tokens per step besides the layer
  (`decode_shape_label`, in the words of the decode table: ``context=32768 W=4096``), so each
  context and window is its own table; a cache kind chosen explicitly joins the implementation's
  name (``torch[static]``); each figure carries the cell's share of the K/V read limit
  (``limit_fraction``: the K and V bytes a step reads over the copy bandwidth of its own run).
"""

from __future__ import annotations

from dataclasses import dataclass

from mha_rosetta.benchmarks.verdict import DECODE_KIND as DECODE
from mha_rosetta.benchmarks.verdict import Figure, cell_figure, comparison_key, overlaps, ratio, verdict

from .runs import Run

__all__ = ["DECODE", "Comparison", "Figure", "cell_figure", "compare", "overlaps", "ratio", "regressions"]


@dataclass(frozen=True)
class Column:
    run: Run
    device: str

    @property
    def label(self) -> str:
        threads = (self.run.data.get("settings") or {}).get("threads")
        return f"{self.run.label} · {self.device}" + (f" · {threads}t" if threads else "")


def shape_label(cell: dict) -> str:
    parts = [f"B{cell.get('batch')}", f"N{cell.get('tokens')}"]
    if cell.get("kv_tokens"):
        parts.append(f"Nk{cell['kv_tokens']}")
    parts += [f"d{cell.get('d_model')}", f"h{cell.get('heads')}"]
    if cell.get("kv_heads"):
        parts.append(f"hkv{cell['kv_heads']}")
    if cell.get("causal"):
        parts.append("causal")
    return " ".join(parts)


def decode_shape_label(cell: dict) -> str:
    """A decode cell's shape: ``B1 context=32768 W=4096 step=1 d2048 h16 hkv4 dk128 rope=half``.

    Context and window are spelled as the decode table and its warnings spell them (``context=``, ``W=``).
    """
    parts = [f"B{cell.get('batch')}", f"context={cell.get('context')}"]
    if cell.get("window") is not None:
        parts.append(f"W={cell['window']}")
    parts += [f"step={cell.get('step')}", f"d{cell.get('d_model')}", f"h{cell.get('heads')}"]
    parts += [f"hkv{cell.get('kv_heads')}", f"dk{cell.get('d_k')}"]
    if cell.get("rope"):
        parts.append(f"rope={cell['rope']}")
    if cell.get("bias"):
        parts.append("bias")  # a biased layer (schema-1 files, or a run that asked for one)
    return " ".join(parts)


def group_key(cell: dict) -> tuple[str, str, str]:
    """(mode, dtype, shape): the cells of one table, where ratios to the fastest make sense."""
    mode = str(cell.get("mode") or "fwd")
    return (mode, str(cell.get("dtype")), decode_shape_label(cell) if mode == DECODE else shape_label(cell))


def implementation_name(cell: dict) -> str:
    """The row name: the implementation, with a decode cell's explicitly chosen cache kind (``torch[static]``)
    or a forward cell's variant (``numpy [softcap]``, as `benchmarks.report.cell_label` names it)."""
    name = str(cell.get("implementation"))
    if cell.get("mode") == DECODE:
        return f"{name}[{cell['cache']}]" if cell.get("cache") else name
    return name if cell.get("variant") is None else f"{name} [{cell['variant']}]"


def columns(runs: list[Run]) -> list[Column]:
    return [Column(run, device) for run in runs if run.kind == "bench" for device in run.devices()]


def column_figures(column: Column) -> list[tuple[dict, Figure]]:
    """(cell, `cell_figure`) of each of a column's finished cells, in the run's order."""
    cells = (cell for cell in column.run.data.get("cells", []) if str(cell.get("device", "cpu")) == column.device)
    return [(cell, figure) for cell in cells if (figure := cell_figure(cell)) is not None]


def column_cells(column: Column) -> dict[tuple, Figure]:
    """``{(group key, implementation): Figure}`` of a column's finished cells."""
    return {(group_key(cell), implementation_name(cell)): figure for cell, figure in column_figures(column)}


@dataclass
class Comparison:
    """Every bench column side by side: ``cells[column index][(group, implementation)]``."""

    columns: list[Column]
    cells: list[dict[tuple, Figure]]

    def reading_rules(self) -> str:
        """How to read the benchmark tables (the figure, its range, the ratios), in the words both report formats print;
        the range is `cell_figure`'s."""
        used = ", ".join(sorted({figure.used for cells in self.cells for figure in cells.values()}))
        text = (
            f"Milliseconds per call [range]; figure used: {used} (corrected_median_s when a cell has it, else median_s). "
            "Range: min–max of the round medians, else the figure alone. "
            "Ratios ×r [range] are to the first column; within noise: the two ranges overlap."
        )
        if any(group[0] == DECODE for group in self.groups()):
            text += (
                " Decode tables (bench --mode decode): milliseconds per decode step at that context (W: the window); "
                "% of KV limit: the K and V bytes the step reads over the copy bandwidth measured in its run, "
                "divided by the step's time."
            )
        return text

    def bandwidth_text(self) -> str:
        """The copy bandwidth of each decode column (the yardstick of its % of KV limit), or "" without one."""
        shown = [
            f"{column.label}: {gbps:.2f} GB/s"
            for column in self.columns
            if (gbps := (column.run.data.get("bandwidth_gbps_by") or {}).get(column.device))
        ]
        return "Copy bandwidth (the K/V limit's yardstick), per column: " + "; ".join(shown) + "." if shown else ""

    def groups(self) -> list[tuple[str, str, str]]:
        return list(dict.fromkeys(key[0] for cells in self.cells for key in cells))

    def implementations(self, group) -> list[str]:
        names = dict.fromkeys(key[1] for cells in self.cells for key in cells if key[0] == group)
        return sorted(names, key=lambda name: min(c[(group, name)].seconds for c in self.cells if (group, name) in c))

    def fastest(self, index: int, group) -> float | None:
        times = [figure.seconds for (g, _), figure in self.cells[index].items() if g == group]
        return min(times) if times else None


def compare(runs: list[Run]) -> Comparison:
    cols = columns(runs)
    return Comparison(cols, [column_cells(column) for column in cols])


def regressions(baseline: list[Run], runs: list[Run], threshold_pct: float) -> dict:
    """The gate: ``{"regressions": [...], "compared": n, "unmatched": [...]}``: the cells `verdict.verdict` calls
    slower at ``threshold_pct`` % against the cell of the same `verdict.comparison_key` in ``baseline`` (the first
    baseline file that has it)."""
    if threshold_pct < 0:
        raise ValueError(f"--fail-on-regression: expected a percentage >= 0, got {threshold_pct}")
    base: dict[tuple, tuple[Figure, str]] = {}
    for column in columns(baseline):
        for cell, figure in column_figures(column):
            base.setdefault(comparison_key(cell), (figure, column.label))
    found, unmatched, compared = [], [], 0
    for column in columns(runs):
        for key, (cell, figure) in {
            comparison_key(cell): (cell, figure) for cell, figure in column_figures(column)
        }.items():
            reference = base.get(key)
            where = f"{implementation_name(cell)} {' '.join(group_key(cell))} on {column.label}"
            if reference is None:
                unmatched.append(where)
                continue
            compared += 1
            ref, ref_label = reference
            if verdict(figure, ref, threshold_pct / 100) == "slower":
                found.append(
                    {
                        "cell": where,
                        "baseline": ref_label,
                        "baseline_s": ref.seconds,
                        "seconds": figure.seconds,
                        "change_pct": 100 * (figure.seconds / ref.seconds - 1),
                        "range": [figure.lo, figure.hi],
                        "baseline_range": [ref.lo, ref.hi],
                        "used": figure.used,
                    }
                )
    return {"threshold_pct": threshold_pct, "compared": compared, "regressions": found, "unmatched": unmatched}
