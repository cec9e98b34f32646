"""The one rule that compares two runs (`benchmarks.verdict`), pinned on hand-made cells: `bench --baseline`,
`report --fail-on-regression` and `bench --compare` match, read and judge the same cells the same way."""

from __future__ import annotations

import json

from mha_rosetta.benchmarks.baseline import compare_to_baseline
from mha_rosetta.benchmarks.decode import DECODE_IDENTITY
from mha_rosetta.benchmarks.rerun import compare_runs
from mha_rosetta.benchmarks.verdict import DECODE_KEY, cell_figure, comparison_key, verdict
from mha_rosetta.report.compare import regressions
from mha_rosetta.report.runs import load_runs

SHAPE = {"device": "cpu", "dtype": "float32", "batch": 4, "tokens": 512, "d_model": 512, "heads": 8, "threads": 1}


def cell(name: str, median: float, spread=None, **extra) -> dict:
    """A finished cell: ``median`` seconds, ``spread`` its round medians' [min, max] (None: no rounds)."""
    record = {**SHAPE, "implementation": name, "status": "ok", "median_s": median, "iqr_s": median / 10, **extra}
    return record if spread is None else {**record, "spread_s": spread}


# The baseline and the new run, each cell chosen to sit on one side of one part of the rule (ms):
BEFORE = [
    cell("moved", 0.010, [0.009, 0.011]),  # 10 ms, rounds 9-11
    cell("noisy", 0.010, [0.009, 0.011]),
    cell("small", 0.010, [0.0099, 0.0101]),
    cell("alone", 0.020),  # no rounds: the figure alone, not median ± IQR/2 (which would be 19-21 ms)
    cell("corrected", 0.010, [0.0095, 0.0125], corrected_median_s=0.010),  # corrected, without a corrected range
    cell("v", 0.010, [0.0099, 0.0101], variant="plain"),
    cell("v", 0.010, [0.0099, 0.0101], variant="softcap"),
]
AFTER = [
    cell("moved", 0.0125, [0.012, 0.013]),  # +25%, ranges apart: slower
    cell("noisy", 0.0125, [0.0105, 0.014]),  # +25%, ranges overlap: within noise
    cell("small", 0.0105, [0.0104, 0.0106]),  # +5%, ranges apart: under a 10% threshold
    cell("alone", 0.0230),  # +15%: two points never overlap, so it is slower (an IQR band would have called it noise)
    cell("corrected", 0.0112, [0.0095, 0.0125], corrected_median_s=0.0112),  # +12% corrected; the raw ranges overlap
    cell("v", 0.0101, [0.0100, 0.0102], variant="plain"),  # +1%: the same
    cell("v", 0.0150, [0.0149, 0.0151], variant="softcap"),  # +50%: slower, told apart from plain by its variant
    cell("moved", 0.0125, [0.012, 0.013], threads=2),  # another thread count: another cell, never matched
]
SLOWER_AT_10 = {"moved", "alone", "corrected", "v [softcap]"}


def report(cells: list[dict]) -> dict:
    return {"schema": 3, "settings": {"threads": 1}, "cells": cells}


def name(row: dict) -> str:
    return row["implementation"] + (f" [{row['variant']}]" if row.get("variant") else "")


def test_a_baseline_row_names_the_mode_and_the_variant():
    from mha_rosetta.benchmarks.baseline import baseline_markdown

    text = baseline_markdown(compare_to_baseline(report(AFTER), report(BEFORE)))
    assert "- `v [softcap]` cpu float32 B=4 N=512: slower by 50% (10.000 ms -> 15.000 ms)" in text
    assert "- `moved` cpu float32 B=4 N=512: slower by 25%" in text


def test_the_verdict_by_hand():
    moved, noisy, small, alone, corrected, *_ = (cell_figure(c) for c in AFTER)
    before = [cell_figure(c) for c in BEFORE]
    assert verdict(moved, before[0], 0.10) == "slower" and verdict(before[0], moved, 0.10) == "faster"
    assert verdict(noisy, before[1], 0.10) == "same"  # beyond the threshold, within noise
    assert verdict(small, before[2], 0.10) == "same" and verdict(small, before[2], 0.04) == "slower"
    assert (alone.lo, alone.hi, alone.range_rule) == (0.023, 0.023, "single figure")
    assert verdict(alone, before[3], 0.10) == "slower"
    # A corrected figure is read with its own range: without corrected round medians, the corrected figure alone.
    assert (corrected.seconds, corrected.lo, corrected.hi) == (0.0112, 0.0112, 0.0112)
    assert verdict(corrected, before[4], 0.10) == "slower"
    assert cell_figure({**BEFORE[0], "status": "failed"}) is None


def test_bench_baseline_and_the_report_gate_call_the_same_cells_slower(tmp_path):
    comparison = compare_to_baseline(report(AFTER), report(BEFORE), threshold=0.10)
    assert {name(row) for row in comparison["flagged"] if row["change"] == "slower"} == SLOWER_AT_10
    assert {name(row) for row in comparison["within_noise"]} == {"noisy"}
    assert len(comparison["compared"]) == 7 and len(comparison["only_in_report"]) == 1  # the 2-thread cell

    paths = []
    for label, cells in (("before", BEFORE), ("after", AFTER)):
        paths.append(tmp_path / f"{label}.json")
        paths[-1].write_text(json.dumps(report(cells)))
    base, new = load_runs([paths[0]]), load_runs([paths[1]])
    gate = regressions(base, new, 10)
    assert {found["cell"].split(" fwd ")[0] for found in gate["regressions"]} == SLOWER_AT_10
    assert gate["compared"] == 7 and len(gate["unmatched"]) == 1 and " · 1t" in gate["unmatched"][0]
    assert {found["cell"].split(" fwd ")[0] for found in regressions(base, new, 4)["regressions"]} == {
        *SLOWER_AT_10,
        "small",
    }


def test_bench_compare_matches_cells_by_the_same_identity():
    compared = compare_runs(report(BEFORE), report(AFTER))
    assert compared["compared"] == 7 and compared["only_in_one"] == 1
    softcap = [row for row in compared["cells"] if row["label"] == "v [softcap]"]
    assert [row["figures_s"] for row in softcap] == [[0.010, 0.015]]


def test_the_identity_of_a_cell():
    assert comparison_key(AFTER[0]) != comparison_key(AFTER[-1])  # threads
    assert comparison_key(AFTER[5]) != comparison_key(AFTER[6])  # variant
    assert comparison_key({**AFTER[0], "causal": True}) != comparison_key(AFTER[0])
    assert comparison_key({**AFTER[0], "mode": "fwdbwd"}) != comparison_key(AFTER[0])
    assert comparison_key({**AFTER[0], "malloc": "default"}) == comparison_key(AFTER[0])  # not part of it
    # A decode cell: its decode identity without the allocator rule.
    assert DECODE_KEY == tuple(field for field in DECODE_IDENTITY if field != "malloc")
