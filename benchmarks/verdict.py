"""One rule for comparing two runs of the benchmark: which cell is which, the figure and range it is read by, the verdict.

Three commands compare runs, and every one of them reads this module:

- ``bench --baseline OLD.json`` (`baseline.compare_to_baseline`): each cell against the same cell of a saved report;
- ``report NEW.json --baseline OLD.json --fail-on-regression PCT`` (`mha_rosetta.report.compare.regressions`):
  the gate, whose regressions are the cells this rule calls "slower";
- ``bench --compare A.json B.json`` (`rerun.compare_runs`): how far two runs agree, cell by cell, with the
  cells matched and read the same way.

The rule:

- **Identity** (`comparison_key`): a forward cell is its implementation, variant, device, dtype, shape
  (batch, tokens, kv_tokens, d_model, heads, kv_heads, causal), threads and mode; a decode cell its decode
  identity (`decode.DECODE_IDENTITY`) without the allocator rule. Only reports of one kind are compared
  (`check_same_kind`): a decode step and a forward share no cell.
- **Figure** (`cell_figure`): `rounds.cell_time`, the drift-corrected median where the cell has one, else the
  raw median; ``used`` says which.
- **Range**: `rounds.cell_interval`, ``[min, max]`` of the round medians of the figure used (the corrected
  ones for a corrected figure); a cell without round medians is its figure alone. Not median ± IQR/2: the
  samples of one visit are not independent draws (`rounds` says why), so their spread is no range of a
  run's figure, and a cell of one round already reads as its figure alone.
- **Verdict** (`verdict`): "slower" or "faster" when the two figures differ by more than the threshold *and*
  their ranges do not overlap, else "same"; a change beyond the threshold whose ranges overlap is within noise.
- **One host speed** (`host_scale`): two paired, corrected cells compared with the same reference product can
  also be read at one host speed, the second run's figures x (the first run's median reference / its own).

It reads records and measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decode import DECODE_IDENTITY
from .decode import KIND as DECODE_KIND
from .rounds import cell_interval, cell_time, is_corrected

FINISHED = ("ok",)  # a cell with another status has no figure
FORWARD_KEY = (
    "implementation", "variant", "device", "dtype", "batch", "tokens", "kv_tokens", "d_model", "heads", "kv_heads",
    "causal", "threads",
)  # fmt: skip
# A decode cell's identity (`decode.DECODE_IDENTITY`) without the allocator rule, which the forward key leaves out too.
DECODE_KEY = tuple(name for name in DECODE_IDENTITY if name != "malloc")
# The rule in one sentence (the ``rule`` of a `bench --baseline` comparison in its JSON).
RULE = "a change counts when the medians differ by more than the threshold and the intervals do not overlap"


def report_kind(report: dict) -> str:
    """``"decode"`` for a ``bench --mode decode`` report, ``"forward"`` for every other bench report."""
    return DECODE_KIND if report.get("kind") == DECODE_KIND else "forward"


def is_decode_cell(cell: dict) -> bool:
    return cell.get("mode") == DECODE_KIND


def comparison_key(cell: dict) -> tuple:
    """The cell's identity across runs (the module's rule): the same key in two reports is the same cell."""
    if is_decode_cell(cell):
        return (*(cell.get(name) for name in DECODE_KEY), DECODE_KIND)
    return (*(cell.get(name) for name in FORWARD_KEY), cell.get("mode", "fwd"))


def check_same_kind(report: dict, baseline: dict, option: str = "--baseline", names=("this report", "the baseline")):
    """ValueError naming ``option`` unless ``report`` and ``baseline`` are both decode reports or both forward ones."""
    mine, theirs = report_kind(report), report_kind(baseline)
    if mine != theirs:
        raise ValueError(
            f"{option}: {names[1]} is a {theirs} bench report and {names[0]} a {mine} one; only reports of one kind "
            "are compared (a decode step and a forward share no cell)"
        )


@dataclass(frozen=True)
class Figure:
    """One finished cell as a comparison reads it: seconds, its range, and which field gave them."""

    seconds: float
    lo: float
    hi: float
    used: str  # "corrected_median_s" or "median_s"
    range_rule: str  # "corrected round medians", "round medians" or "single figure"
    limit_fraction: float | None = None  # decode cells: the step's share of the K/V read limit

    @property
    def interval(self) -> list[float]:
        return [self.lo, self.hi]

    def scaled(self, factor: float) -> Figure:
        """The same figure and range x ``factor`` (a run put at another host's speed, `host_scale`)."""
        return Figure(self.seconds * factor, self.lo * factor, self.hi * factor, self.used, self.range_rule)


def cell_figure(cell: dict) -> Figure | None:
    """The cell's figure and range by the module's rule; None when it did not finish."""
    if cell.get("status") not in FINISHED or cell.get("median_s") is None:
        return None
    corrected = is_corrected(cell)
    seconds = float(cell_time(cell))
    lo, hi = (float(value) for value in cell_interval(cell))
    rounds = cell.get("corrected_spread_s" if corrected else "spread_s")
    rule = ("corrected round medians" if corrected else "round medians") if rounds else "single figure"
    used = "corrected_median_s" if corrected else "median_s"
    return Figure(seconds, min(lo, seconds), max(hi, seconds), used, rule, _limit_fraction(cell))


def _limit_fraction(cell: dict) -> float | None:
    value = cell.get("limit_fraction")  # benchmarks.bandwidth.enrich_decode_cell (decode cells only)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def overlaps(a: Figure, b: Figure) -> bool:
    """Whether two figures' ranges share a point (the two are then within noise of each other)."""
    return a.lo <= b.hi and b.lo <= a.hi


def ratio(a: Figure, reference: Figure) -> tuple[float, float, float]:
    """a / reference with its range [a.lo/ref.hi, a.hi/ref.lo]."""
    return a.seconds / reference.seconds, a.lo / reference.hi, a.hi / max(reference.lo, 1e-300)


def verdict(now: Figure, before: Figure, threshold: float) -> str:
    """``"slower"``, ``"faster"`` or ``"same"`` by the module's rule (``threshold``: 0.10 = 10%)."""
    change = now.seconds / before.seconds
    if abs(change - 1.0) > threshold and not overlaps(now, before):
        return "slower" if change > 1.0 else "faster"
    return "same"


def run_reference_s(cell: dict, report: dict) -> float | None:
    """The run's median time of the reference product ``cell`` was paired with (None: unpaired)."""
    from .gemm import reference_key

    if not cell.get("reference"):
        return None
    workloads = (report.get("reference") or {}).get("workloads") or {}
    return (workloads.get(reference_key(cell["reference"])) or {}).get("median_s")


def host_scale(cell: dict, report: dict, before: dict, baseline: dict) -> float | None:
    """The baseline's median reference over the report's, for two corrected cells paired with the same
    reference workload (`gemm.reference_key`): the factor that puts the report's figures at the baseline
    host's speed. None when either cell is raw or unpaired, or the two were paired with different products."""
    from .gemm import reference_key

    if not (is_corrected(cell) and is_corrected(before) and cell.get("reference") and before.get("reference")):
        return None
    if reference_key(cell["reference"]) != reference_key(before["reference"]):
        return None
    now, then = run_reference_s(cell, report), run_reference_s(before, baseline)
    return then / now if now and then else None
