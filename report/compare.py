"""One comparison of bench runs, and the regression gate against a baseline.

The rules (also in ``mha-rosetta report --help`` and docs/report.md):
- **Figure**: a cell's ``corrected_median_s`` (drift-corrected, bench schema 2) when present, else its ``median_s``;
  each cell says which it used.
- **Range** (the cell's own spread): ``[min, max]`` of its round medians (``spread_s``) when
  it had rounds, else ``median ± iqr/2`` (``iqr_s``), else the figure alone; scaled by
  for ``corrected_median_s`` the range is ``corrected_spread_s`` (its corrected round medians).
- **Ratio** of a cell to the same cell in the first column (the reference), with its range
  ``[lo/hi_ref, hi/lo_ref]``; **within noise** when the two ranges overlap.
- **Regression** (``--baseline FILE --fail-on-regression PCT``): a cell is a regression when
  its range lies wholly above the baseline cell's range (slower beyond noise) *and* its
  figure is more than PCT % above the baseline's figure. Cells are matched by
  implementation, mode, dtype, shape and device; unmatched cells are listed, never failed.
- **Decode cells** (``bench --mode decode``, ``"mode": "decode"``): the same rules, on the time of one
  decode step; a cell's shape is its context, window and tokens per step besides the layer
  (`decode_shape_label`, in the words of the decode table: ``context=32768 W=4096``), so each
  context and window is its own table; a cache kind chosen explicitly joins the implementation's
  name (``torch[static]``); each figure carries the cell's share of the K/V read limit
  (``limit_fraction``: the K and V bytes a step reads over the copy bandwidth of its own run).
"""

from __future__ import annotations

from dataclasses import dataclass

from .runs import Run

FINISHED = ("ok",)
SHAPE_FIELDS = ("batch", "tokens", "kv_tokens", "d_model", "heads", "kv_heads", "causal")


@dataclass(frozen=True)
class Figure:
    """One bench cell as the report reads it: seconds, its range, and which field gave them."""

    seconds: float
    lo: float
    hi: float
    used: str  # "corrected_median_s" or "median_s"
    range_rule: str  # "round medians", "median ± iqr/2" or "single figure"
    limit_fraction: float | None = None  # decode cells: the step's share of the K/V read limit


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


DECODE = "decode"  # the mode of a `bench --mode decode` cell (benchmarks.decode.KIND)


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
    """The row name: the implementation, with a decode cell's explicitly chosen cache kind (``torch[static]``)."""
    name = str(cell.get("implementation"))
    return f"{name}[{cell['cache']}]" if cell.get("mode") == DECODE and cell.get("cache") else name


def cell_figure(cell: dict) -> Figure | None:
    """The cell's figure and range by the module's rules; None when it did not finish."""
    if cell.get("status") not in FINISHED or cell.get("median_s") is None:
        return None
    median = float(cell["median_s"])
    corrected = cell.get("corrected_median_s")  # bench schema 2 (benchmarks.report.correct_cell)
    if corrected is not None:
        figure, spread = float(corrected), cell.get("corrected_spread_s")
        if spread and len(spread) == 2 and None not in spread:
            lo, hi, rule = float(spread[0]), float(spread[1]), "corrected round medians"
        else:
            lo, hi, rule = figure, figure, "single figure"
        return Figure(figure, min(lo, figure), max(hi, figure), "corrected_median_s", rule, _limit_fraction(cell))
    figure, used, scale = median, "median_s", 1.0
    spread, iqr = cell.get("spread_s"), cell.get("iqr_s")
    if spread and len(spread) == 2 and None not in spread:
        lo, hi, rule = float(spread[0]), float(spread[1]), "round medians"
    elif iqr is not None:
        lo, hi, rule = median - float(iqr) / 2, median + float(iqr) / 2, "median ± iqr/2"
    else:
        lo, hi, rule = median, median, "single figure"
    return Figure(figure, min(lo, median) * scale, max(hi, median) * scale, used, rule, _limit_fraction(cell))


def _limit_fraction(cell: dict) -> float | None:
    value = cell.get("limit_fraction")  # benchmarks.bandwidth.enrich_decode_cell (decode cells only)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def columns(runs: list[Run]) -> list[Column]:
    return [Column(run, device) for run in runs if run.kind == "bench" for device in run.devices()]


def column_cells(column: Column) -> dict[tuple, Figure]:
    """``{(group key, implementation): Figure}`` of a column's finished cells."""
    out = {}
    for cell in column.run.data.get("cells", []):
        if str(cell.get("device", "cpu")) != column.device:
            continue
        figure = cell_figure(cell)
        if figure is not None:
            out[(group_key(cell), implementation_name(cell))] = figure
    return out


def overlaps(a: Figure, b: Figure) -> bool:
    return a.lo <= b.hi and b.lo <= a.hi


def ratio(a: Figure, reference: Figure) -> tuple[float, float, float]:
    """a / reference with its range [a.lo/ref.hi, a.hi/ref.lo]."""
    return a.seconds / reference.seconds, a.lo / reference.hi, a.hi / max(reference.lo, 1e-300)


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
            "Range: min–max of the round medians, else median ± IQR/2. "
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
    """The gate: ``{"regressions": [...], "compared": n, "unmatched": [...]}`` by the module's rule."""
    if threshold_pct < 0:
        raise ValueError(f"--fail-on-regression: expected a percentage >= 0, got {threshold_pct}")
    base: dict[tuple, tuple[Figure, str]] = {}
    for column in columns(baseline):
        for key, figure in column_cells(column).items():
            base.setdefault((column.device, *key), (figure, column.label))
    found, unmatched, compared = [], [], 0
    for column in columns(runs):
        for (group, name), figure in column_cells(column).items():
            reference = base.get((column.device, group, name))
            where = f"{name} {' '.join(group)} on {column.label}"
            if reference is None:
                unmatched.append(where)
                continue
            compared += 1
            ref, ref_label = reference
            change = figure.seconds / ref.seconds - 1
            if figure.lo > ref.hi and change * 100 > threshold_pct:
                found.append(
                    {
                        "cell": where,
                        "baseline": ref_label,
                        "baseline_s": ref.seconds,
                        "seconds": figure.seconds,
                        "change_pct": 100 * change,
                        "range": [figure.lo, figure.hi],
                        "baseline_range": [ref.lo, ref.hi],
                        "used": figure.used,
                    }
                )
    return {"threshold_pct": threshold_pct, "compared": compared, "regressions": found, "unmatched": unmatched}
