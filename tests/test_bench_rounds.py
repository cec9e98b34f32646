"""Interleaved rounds: merging visits, spread, drift, busy rounds, per-round % of peak, the
interval rule of `--baseline`, and the benchmarks page's block generated from the committed JSON.

Hand-made records only (no processes, no timing): every figure below is computed by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mha_rosetta.benchmarks.baseline import baseline_markdown, compare_to_baseline
from mha_rosetta.benchmarks.markdown import markdown_table
from mha_rosetta.benchmarks.readme import (
    BEGIN,
    END,
    load_reference_reports,
    ranking_sentences,
    readme_block,
    replace_block,
    report_name,
)
from mha_rosetta.benchmarks.report import assemble_report
from mha_rosetta.benchmarks.rounds import busy_rounds, intervals_overlap, merge_peaks, merge_visits, relative_range

ROOT = Path(__file__).resolve().parents[1]


def _visit(median, samples=None, status="ok", **extra):
    record = {
        "implementation": "numpy", "device": "cpu", "dtype": "float32", "batch": 4, "tokens": 512, "d_model": 512,
        "heads": 8, "threads": 1, "status": status,
    }  # fmt: skip
    if status == "ok":
        record.update(median_s=median, samples_s=samples or [median], flops=8e9, warnings=[], cpu_util=1.0)
    else:
        record["error"] = "RuntimeError: boom"
    record.update(extra)
    return record


def test_merge_pools_every_sample_and_keeps_one_median_per_round():
    visits = [
        _visit(0.10, [0.09, 0.10, 0.11], compile_s=0.2, peak_mem_mb=5.0),
        _visit(0.12, [0.12, 0.12, 0.13], compile_s=0.4, peak_mem_mb=7.0),
        _visit(0.105, [0.10, 0.105, 0.30], compile_s=0.3, peak_mem_mb=6.0),
    ]
    cell = merge_visits(visits)
    # pooled, sorted: .09 .10 .10 .105 .11 .12 .12 .13 .30 -> the 5th of 9
    assert cell["median_s"] == 0.11 and cell["repeats"] == 9 and cell["min_s"] == 0.09
    assert cell["round_medians_s"] == [0.10, 0.12, 0.105]
    assert cell["spread_s"] == [0.10, 0.12]
    assert math.isclose(cell["round_drift"], 0.2) and cell["drift"] is True  # 0.12 / 0.10 - 1 = 20% > 10%
    assert any(w.startswith("drift: the round medians differ by 20%") for w in cell["warnings"])
    assert cell["compile_s"] == 0.3 and cell["peak_mem_mb"] == 7.0  # median over rounds; the largest memory
    assert math.isclose(cell["gflops"], 8e9 / 0.11 / 1e9)
    # Every sample is kept (schema 2, issue 27), in round order.
    assert cell["samples_s"] == [0.09, 0.10, 0.11, 0.12, 0.12, 0.13, 0.10, 0.105, 0.30]
    assert "paired_ratios" not in cell and "corrected_drift" not in cell  # visits without references: raw only


def test_merge_of_close_rounds_is_not_drift_and_one_round_is_the_visit_itself():
    close = merge_visits([_visit(0.100), _visit(0.105)])
    assert close["drift"] is False and math.isclose(close["round_drift"], 0.05)
    single = merge_visits([_visit(0.2, [0.19, 0.2, 0.25], warnings=["got only 0.70 of its core"])])
    assert single["median_s"] == 0.2 and single["spread_s"] == [0.2, 0.2] and single["round_drift"] == 0.0
    assert single["warnings"] == ["got only 0.70 of its core"]  # no round prefix with one round
    assert "round_status" not in single


def test_a_failed_round_makes_the_cell_fail_and_keeps_the_other_rounds():
    cell = merge_visits([_visit(0.1), _visit(None, status="error"), None])
    assert cell["status"] == "error" and cell["error"] == "round 2: RuntimeError: boom"
    assert cell["round_status"] == ["ok", "error", None]
    assert cell["round_medians_s"] == [0.1, None, None] and cell["spread_s"] == [0.1, 0.1]
    assert merge_visits([None, None]) is None
    unsupported = merge_visits([_visit(None, status="unsupported"), None])
    assert unsupported["status"] == "unsupported"


def test_busy_rounds_are_those_well_below_the_best_other_round():
    assert busy_rounds([100.0, 101.0, 90.0]) == [2]  # 90 < 0.95 * 101
    assert busy_rounds([100.0, 97.0, 103.0]) == [1]  # 97 < 0.95 * 103 = 97.85; 100 is not
    assert busy_rounds([100.0, 98.0, 101.0]) == []
    assert busy_rounds([100.0]) == [] and busy_rounds([None, 100.0]) == []
    assert relative_range([2.0, 1.0, None]) == 1.0 and relative_range([]) is None


def test_a_round_fraction_uses_the_same_rounds_peak():
    cells = [
        {**merge_visits([_visit(0.1), _visit(0.2)]), "flops": 2e9}  # 20 and 10 GFLOP/s in rounds 1 and 2
    ]
    peaks = [merge_peaks([{"device": "cpu", "dtype": "float32", "threads": 1, "n": 1024, "gflops": 40.0},
                          {"device": "cpu", "dtype": "float32", "threads": 1, "n": 1024, "gflops": 20.0}])]  # fmt: skip
    report = assemble_report({}, peaks, cells, machine={})
    cell = report["cells"][0]
    assert cell["round_peak_fractions"] == [0.5, 0.5]  # 20/40 and 10/20: each round against its own peak
    assert cell["peak_fraction"] == 0.5
    assert report["gemm_peaks"][0]["gflops"] == 30.0 and report["gemm_peaks"][0]["busy_rounds"] == [1]


def _report(medians: dict[str, tuple[float, float, float]], threads=1, peak_rounds=(100.0, 100.0, 100.0)):
    """A reference-size report whose cells have the given three round medians (seconds)."""
    flops = 8e9
    cells = []
    for label, rounds in medians.items():
        backend, _, strategy = label.partition(":")
        visits = [_visit(m, [m], implementation=label, backend=backend, strategy=strategy or "standard",
                         threads=threads, flops=flops, cpu_util=float(threads)) for m in rounds]  # fmt: skip
        cells.append(merge_visits(visits))
    peaks = [{"device": "cpu", "dtype": "float32", "threads": threads, "n": 1024, "gflops": p, "library": "numpy"}
             for p in peak_rounds]  # fmt: skip
    rounds = {"count": len(peak_rounds), "seed": 5, "orders": [], "busy_rounds": [], "busy_threshold": 0.05,
              "gemm_peaks_gflops": {"cpu/float32": list(peak_rounds)}}  # fmt: skip
    settings = {"preset": "reference", "threads": threads, "rounds": len(peak_rounds)}
    machine = {"cpu_model": "Test CPU", "cores": 2}
    return assemble_report(settings, [merge_peaks(peaks)], cells, machine=machine, rounds=rounds)


def test_baseline_counts_a_change_only_beyond_ten_percent_and_outside_the_noise():
    old = _report({"a": (0.100, 0.101, 0.102), "b": (0.100, 0.101, 0.102), "c": (0.100, 0.101, 0.102)})
    new = _report({"a": (0.120, 0.121, 0.122), "b": (0.095, 0.115, 0.130), "c": (0.104, 0.105, 0.106)})
    comparison = compare_to_baseline(new, old)
    verdicts = {row["implementation"]: row["change"] for row in comparison["compared"]}
    # a: +19%, ranges apart -> slower; b: +14% but its range 95-130 overlaps 100-102 -> within noise;
    # c: ranges apart but +4% -> same
    assert verdicts == {"a": "slower", "b": "same", "c": "same"}
    assert [row["implementation"] for row in comparison["within_noise"]] == ["b"]
    text = baseline_markdown(comparison)
    assert "`b` cpu float32 B=4 N=512: moved by +14% but within noise" in text
    assert "`a` cpu float32 B=4 N=512: slower by 20%" in text


def test_markdown_shows_the_round_range_and_the_rounds():
    report = _report({"a": (0.100, 0.120, 0.110)}, peak_rounds=(100.0, 90.0, 100.0))
    report["rounds"]["busy_rounds"] = [1]
    table = markdown_table(report)
    assert "| median ms | rounds ms |" in table
    assert "| 110.000 | 100.000-120.000 |" in table
    assert "Rounds: 3 (seed 5)" in table and "GEMM peak cpu/float32 per round: 100.0, 90.0, 100.0 GFLOP/s" in table
    assert "(!) round 2: its GEMM peak is more than 5% below the best other round's" in table
    assert "ok (drift)" in table  # 120 / 100 - 1 = 20%


def test_ranking_sentences_state_the_spread_and_the_noise():
    report = _report(
        {
            "numpy": (0.100, 0.102, 0.104),
            "torch": (0.103, 0.106, 0.108),
            "jax": (0.150, 0.152, 0.155),
            "numpy:slicing": (0.090, 0.091, 0.092),
        }
    )
    text = " ".join(ranking_sentences(report["cells"]))
    assert (
        "`numpy:slicing` 91.0 ms (90.0-92.0) < `numpy` 102.0 ms (100.0-104.0) ≈ `torch` 106.0 ms (103.0-108.0) "
        "< `jax` 152.0 ms (150.0-155.0)"
    ) in text
    assert "The 4 implementations sit within 1.67x of each other" in text
    assert "No other implementation's range overlaps the fastest's: `numpy:slicing` leads." in text
    assert "`numpy:slicing` 91.0 ms (90.0-92.0) against `numpy` 102.0 ms (100.0-104.0): 11% faster" in text
    tied = _report({"numpy": (0.100, 0.102, 0.104), "numpy:slicing": (0.101, 0.103, 0.105)})
    tied_text = " ".join(ranking_sentences(tied["cells"]))
    assert "Within noise of the fastest (their ranges overlap its range): `numpy:slicing`." in tied_text
    assert "against `numpy` 102.0 ms (100.0-104.0): within noise" in tied_text


def test_the_block_sets_two_threads_beside_one_and_replaces_only_itself():
    one = _report({"numpy": (0.100, 0.102, 0.104), "torch": (0.103, 0.106, 0.108)})
    two = _report({"numpy": (0.050, 0.051, 0.052), "torch": (0.060, 0.062, 0.064)}, threads=2)
    assert report_name(one) == "reference" and report_name(two) == "reference-t2"
    block = readme_block({1: one, 2: two})
    assert block.startswith(BEGIN) and block.rstrip().endswith(END)
    assert all(len(line) <= 100 for line in block.splitlines() if not line.startswith(("|", "<!--")))
    prose = " ".join(block.split())  # the prose is wrapped: compare with single spaces
    assert "| `numpy` | 102.0 | 100.0-104.0 | 78.4 | 78% | 1.00 | 51.0 | 50.0-52.0 | 157% | 2.00x |" in block
    assert (
        "Speedup from 1 to 2 threads (1-thread median / 2-thread median): from 1.71x (`torch`) to 2.00x (`numpy`); "
        "the GEMM peak's own ratio is 1.00x."
    ) in prose
    assert "other processes shared the machine" not in prose  # every cell had its core
    for cell in one["cells"]:
        cell["cpu_util"] = 0.4
    one["rounds"]["busy_rounds"] = [1, 2]
    only_one = " ".join(readme_block({1: one}).split())
    assert "Rounds 2 and 3 are flagged busy: the GEMM peak was more than 5% below the best other round's." in only_one
    assert "The cells got a median of 0.40 of their core (CPU time / wall time)" in only_one
    assert "`mha-rosetta bench --preset reference --threads 2 --write-docs docs`" in only_one
    # A flagged cell is named with the spread that flagged it: the corrected one where it has one.
    one["cells"][0].update(drift=True, round_drift=0.22, corrected_drift=0.14, corrected_median_s=0.102)
    one["cells"][1].update(drift=True, round_drift=0.04, corrected_drift=0.11, corrected_median_s=0.106)
    flagged = " ".join(readme_block({1: one}).split())
    assert "Flagged for drift (corrected round medians more than 10% apart): `numpy` (14%), `torch` (11%)." in flagged
    # Two machines' runs are never set side by side: a 1 -> 2 speedup across them would measure the machines.
    elsewhere = dict(two, machine={**two.get("machine", {}), "cpu_model": "Another CPU", "cores": 64})
    apart = " ".join(readme_block({1: one, 2: elsewhere}).split())
    assert "median ms, 2 threads" not in apart and "Speedup from 1 to 2 threads" not in apart
    assert (
        "The 2-thread columns are left out: `docs/bench/reference-t2.json` was measured on Another CPU (64 cores)"
        in apart
    )
    # The same CPU model and core count on another host (the provenance's host id) is another machine too,
    # and the same host id with the same CPU is the same machine (`provenance.machine_differences`).
    here = dict(one, provenance={**(one.get("provenance") or {}), "host_id": "a" * 16})
    cpu = {name: (one.get("machine") or {}).get(name) for name in ("cpu_model", "cores")}
    there = dict(
        two,
        machine={**two.get("machine", {}), **cpu},
        provenance={**(two.get("provenance") or {}), "host_id": "b" * 16},
    )
    assert "median ms, 2 threads" not in " ".join(readme_block({1: here, 2: there}).split())
    also_here = dict(there, provenance={**there["provenance"], "host_id": "a" * 16})
    assert "median ms, 2 threads" in " ".join(readme_block({1: here, 2: also_here}).split())
    readme = f"intro\n{BEGIN}\nold table\n{END}\noutro\n"
    assert replace_block(readme, block) == "intro\n" + block.rstrip("\n") + "\noutro\n"
    with pytest.raises(ValueError, match="no generated benchmark block"):
        replace_block("no markers here", block)


def test_the_readme_block_is_what_the_command_renders_from_the_committed_json():
    reports = load_reference_reports(ROOT / "docs")
    assert 1 in reports, "docs/bench/reference.json is committed"
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    start, end = page.index(BEGIN), page.index(END) + len(END)
    assert page[start:end] + "\n" == readme_block(reports), (
        "the benchmarks page's block is stale: run `mha-rosetta bench --render docs/bench/reference.json "
        "--write-docs docs`"
    )


def test_render_writes_the_docs_and_the_readme_block_from_a_saved_report(tmp_path, capsys):
    from mha_rosetta.cli.main import main

    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(_report({"numpy": (0.100, 0.102, 0.104), "torch": (0.2, 0.21, 0.22)})))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text(f"# x\n\n{BEGIN}\nstale\n{END}\n", encoding="utf-8")
    assert main(["bench", "--render", str(saved), "--write-docs", str(docs)]) == 0
    written = json.loads((docs / "bench" / "reference.json").read_text())
    assert written["cells"][0]["round_medians_s"] == [0.100, 0.102, 0.104]
    assert "| `numpy` |" in (docs / "bench" / "reference.md").read_text()
    page = (docs / "benchmarks.md").read_text()
    assert "stale" not in page and page == f"# x\n\n{readme_block(load_reference_reports(docs))}"
    assert "| median ms | rounds ms |" in capsys.readouterr().out  # the table, printed
    assert main(["bench", "--render", str(tmp_path / "missing.json")]) == 2


def test_publish_report_writes_its_files_and_touches_only_a_page_with_the_markers(tmp_path):
    # The one rule of write_docs and write_decode_docs: JSON and Markdown, the plots (none without matplotlib),
    # then the block, rendered only where the page holds the markers, and the page written only where it changed.
    from mha_rosetta.benchmarks.publish import publish_report

    def no_matplotlib(report, stem):
        raise ImportError("No module named 'matplotlib'")

    def never(kind):
        def fail():
            raise AssertionError(f"the block of a page {kind} was rendered")

        return fail

    markers = ("<!-- b -->", "<!-- e -->")
    stem = tmp_path / "docs" / "bench" / "name-t2"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers here\n", encoding="utf-8")
    written = publish_report({"cells": [1.5]}, stem, "| t |\n", no_matplotlib, plain, never("without markers"), markers)
    assert written == [stem.parent / "name-t2.json", stem.parent / "name-t2.md"]
    assert json.loads(written[0].read_text()) == {"cells": [1.5]} and written[1].read_text() == "| t |\n"
    assert plain.read_text() == "no markers here\n"
    missing = tmp_path / "missing.md"
    assert publish_report({}, stem, "", no_matplotlib, missing, never("that is missing"), markers) == written
    page = tmp_path / "page.md"
    page.write_text("a\n<!-- b -->\nold\n<!-- e -->\nz\n", encoding="utf-8")
    plots = [tmp_path / "plot.png"]
    block = "<!-- b -->\nnew\n<!-- e -->\n"
    assert publish_report({}, stem, "", lambda report, where: plots, page, lambda: block, markers) == [
        *written, *plots, page,
    ]  # fmt: skip
    assert page.read_text() == "a\n<!-- b -->\nnew\n<!-- e -->\nz\n"
    assert publish_report({}, stem, "", lambda report, where: [], page, lambda: block, markers) == written  # same


def test_intervals_overlap():
    assert intervals_overlap([1, 2], [2, 3]) and intervals_overlap([1, 5], [2, 3])
    assert not intervals_overlap([1, 2], [2.5, 3])


def test_drift_under_a_steady_reference_is_named_the_cells_own_not_the_hosts():
    """equinox's visits on 2026-12-02: 103.7, 103.7 and 84.4 ms while its paired reference held 2.49-2.52 ms (1%)."""
    from mha_rosetta.benchmarks.rounds import drift_warning

    cell = {
        "round_medians_s": [0.1037, 0.1037, 0.0844],
        "spread_s": [0.0844, 0.1037],
        "round_drift": 0.1037 / 0.0844 - 1,
        "round_reference_medians_s": [0.00249, 0.00252, 0.00251],
    }
    text = drift_warning(cell)
    assert text.startswith("drift: the round medians differ by 23% (84.400 to 103.700 ms)")
    assert "load changed" not in text
    assert "its paired reference moved by only 1% over those visits, so the host explains little of it" in text
    assert "the cell itself ran at different speeds in different processes" in text
    cell["corrected_drift"] = 0.229
    assert "even after the correction (raw: 23%); its paired reference moved by only 1%" in drift_warning(cell)
    # The reference moved half as much as the cell or more (12% against 23%): the host, as before.
    cell.pop("corrected_drift")
    cell["round_reference_medians_s"] = [0.0025, 0.0025, 0.0028]
    assert drift_warning(cell).endswith("the machine's load changed between rounds")
