"""Paired reference samples (issue 28): every timed sample is followed by one sample of a fixed
reference product, and the published figures are the control-variate correction: each sample x
(the run's median reference / its own reference) ^ beta, beta the cell's slope of log(sample) on
log(reference), clipped to [0, 1]. With a fake clock: a 40% slowdown injected into half of one
cell's samples, hitting its reference alike (beta 1), moves that cell's raw median and leaves its
corrected figure, the rankings and the baseline verdict exactly where they were; a reference
slowed on its own (beta 0) leaves the corrected figure at the raw one, its spread not inflated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mha_rosetta.benchmarks.baseline import _signed_percent, baseline_markdown, compare_to_baseline
from mha_rosetta.benchmarks.cell import CellSpec, cell_record, run_cell
from mha_rosetta.benchmarks.gemm import REFERENCE_SIZES, reference_key, reference_library
from mha_rosetta.benchmarks.markdown import markdown_table
from mha_rosetta.benchmarks.questions import _ratio, verdict_heads
from mha_rosetta.benchmarks.readme import ranking_sentences
from mha_rosetta.benchmarks.report import SCHEMA_VERSION, assemble_report, load_report
from mha_rosetta.benchmarks.rerun import compare_markdown, compare_runs
from mha_rosetta.benchmarks.rounds import cell_interval, cell_time, merge_visits
from mha_rosetta.benchmarks.timing import RepeatPolicy, time_interleaved, time_repeats

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench"
# The reference report as committed before paired sampling (schema 1, AMD EPYC), kept as test data.
SCHEMA_1 = Path(__file__).resolve().parent / "data" / "reference-schema1.json"
# The same, committed with paired samples and corrected by the plain ratio (schema 2, Intel Xeon, 2026-12-01).
SCHEMA_2 = Path(__file__).resolve().parent / "data" / "reference-schema2.json"
REFERENCE_S = 0.002  # the fake reference product: 2 ms on an undisturbed host
WORKLOAD = {"library": "numpy", "device": "cpu", "dtype": "float32", "n": 512, "flops": 2 * 512**3}
PEAK = {"device": "cpu", "dtype": "float32", "threads": 1, "n": 1024, "gflops": 100.0, "library": "numpy",
        "round_gflops": [100.0, 100.0, 100.0]}  # fmt: skip


class FakeHost:
    """A clock that only moves when work runs: each call advances it by its cost x the host's slowdown."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slowdown = 1.0
        self.calls: list[str] = []

    def clock(self) -> float:
        return self.now

    def work(self, name: str, seconds: float):
        def run() -> None:
            self.calls.append(name)
            self.now += seconds * self.slowdown

        return run


def test_every_sample_is_followed_by_one_reference_sample_and_the_budget_counts_both():
    host = FakeHost()
    policy = RepeatPolicy(min_time=0.1, min_repeats=3, warmup=0)
    timings = time_repeats(
        host.work("cell", 0.010), policy, clock=host.clock, cpu_clock=host.clock, reference=host.work("ref", 0.002)
    )
    # 12 ms per pair: 8 pairs are 96 ms < min_time, the 9th reaches 108 ms (and the spread is 0: stable).
    assert timings["repeats"] == 9 and host.calls == ["cell", "ref"] * 9
    assert timings["samples_s"] == pytest.approx([0.010] * 9) and timings["reference_samples_s"] == pytest.approx(
        [0.002] * 9
    )
    assert timings["paired_ratios"] == pytest.approx([5.0] * 9) and timings["ratio_median"] == pytest.approx(5.0)
    assert timings["timed_total_s"] == pytest.approx(0.09) and timings["reference_total_s"] == pytest.approx(0.018)
    plain = time_repeats(host.work("cell", 0.010), policy, clock=host.clock, cpu_clock=host.clock)
    assert plain["repeats"] == 10 and "paired_ratios" not in plain  # unpaired: 10 x 10 ms reach 0.1 s


def _visits(label: str, base_s: float, host: FakeHost, slowed_half: bool) -> list[dict]:
    """Three rounds of one cell, each visit 10 paired samples; with ``slowed_half`` samples 5-9 of every
    visit (and their references) run on a host 40% slower."""
    backend, _, strategy = label.partition(":")
    spec = CellSpec(implementation=label, batch=4, tokens=512, d_model=512, heads=8)
    visits = []
    for _round in range(3):
        cell, reference = host.work("cell", base_s), host.work("ref", REFERENCE_S)
        count = [0]

        def run_once(cell=cell, count=count) -> None:
            host.slowdown = 1.4 if slowed_half and count[0] >= 5 else 1.0
            count[0] += 1
            cell()

        policy = RepeatPolicy(min_time=0.0, min_repeats=10, max_repeats=10, warmup=0)
        timings = time_repeats(run_once, policy, clock=host.clock, cpu_clock=host.clock, reference=reference)
        host.slowdown = 1.0
        flops = 8e9
        outcome = {"status": "ok", **timings, "flops": flops, "gflops": flops / timings["median_s"] / 1e9,
                   "reference": dict(WORKLOAD), "warnings": [], "cpu_util": 1.0}  # fmt: skip
        visits.append(cell_record(spec, outcome))
    assert visits[0]["backend"] == backend and visits[0]["strategy"] == (strategy or "standard")
    return visits


def _run(slowed: str | None) -> dict:
    host = FakeHost()
    bases = {"numpy": 0.010, "numpy:slicing": 0.013, "torch": 0.0105}
    cells = [merge_visits(_visits(label, base, host, slowed == label)) for label, base in bases.items()]
    return assemble_report({"threads": 1}, [PEAK], cells, machine={})


def test_a_slowdown_of_half_a_cells_samples_moves_its_raw_median_not_its_corrected_figure():
    quiet, disturbed = _run(None), _run("numpy")
    before, after = quiet["cells"][0], disturbed["cells"][0]
    assert before["implementation"] == after["implementation"] == "numpy"
    # Raw: 5 samples of 10 ms and 5 of 14 ms per visit; the median moves from 10 to 12 ms.
    assert before["median_s"] == pytest.approx(0.010) and after["median_s"] == pytest.approx(0.012)
    # Every paired ratio is 10 / 2 = 14 / 2.8 = 5; the run's reference median stays 2 ms (6 of 9 visits
    # undisturbed), so the corrected figure is 5 x 2 ms = 10 ms in both runs.
    assert disturbed["reference"]["workloads"][reference_key(WORKLOAD)]["median_s"] == pytest.approx(REFERENCE_S)
    for cell in (before, after):
        assert cell["corrected_median_s"] == pytest.approx(0.010) and cell["ratio_median"] == pytest.approx(5.0)
        assert cell["corrected_spread_s"] == pytest.approx([0.010, 0.010]) and cell["drift"] is False
        assert cell_time(cell) == cell["corrected_median_s"] and cell_interval(cell) == cell["corrected_spread_s"]
        assert cell["corrected_gflops"] == pytest.approx(800.0) and cell["corrected_peak_fraction"] == pytest.approx(
            8.0
        )
    assert len(after["samples_s"]) == len(after["reference_samples_s"]) == len(after["paired_ratios"]) == 30
    # The disturbed cell's samples follow their references exactly (log 14/10 = log 2.8/2): beta 1, the plain
    # ratio; in the quiet run no reference moved, so there is no slope to take: beta 0, the raw samples.
    assert after["reference_beta"] == pytest.approx(1.0) and after["reference_correlation"] == pytest.approx(1.0)
    assert before["reference_beta"] == 0.0 and before["reference_correlation"] is None
    assert after["reference_pairs"] == 30 and after["round_sample_counts"] == [10, 10, 10]
    assert disturbed["schema"] == SCHEMA_VERSION == 3
    # The verdicts do not move: the rankings read the same, and against the quiet run nothing changed ...
    assert ranking_sentences(disturbed["cells"]) == ranking_sentences(quiet["cells"])
    comparison = compare_to_baseline(disturbed, quiet)
    assert comparison["flagged"] == [] and comparison["within_noise"] == []
    assert comparison["compared"][0]["ratio"] == pytest.approx(1.0) and comparison["compared"][0]["corrected"] == [
        True,
        True,
    ]
    # ... where the raw medians would have called numpy 20% slower (12 ms against 10, round ranges apart).
    raw = {key: {**value, "cells": [{k: v for k, v in c.items() if not k.startswith("corrected")} for c in value["cells"]]}
           for key, value in (("quiet", quiet), ("disturbed", disturbed))}  # fmt: skip
    flagged = compare_to_baseline(raw["disturbed"], raw["quiet"])["flagged"]
    assert [(row["implementation"], row["change"]) for row in flagged] == [("numpy", "slower")]
    # The table leads with the corrected figure and keeps the raw one beside it.
    table = markdown_table(disturbed)
    assert "| corrected ms | rounds ms | raw ms | raw rounds ms |" in table
    assert "| `numpy` | cpu | float32 | 4 | 512 | 512 | 8 | 10.000 | 10.000-10.000 | 12.000 | 12.000-12.000 |" in table
    # Per round: references 5 x 2 + 5 x 2.8 + 10 x 2 + 10 x 2 = 64 ms against cells 120 + 130 + 105 = 355 ms.
    assert disturbed["reference"]["time_share"] == pytest.approx(64 / 419)
    assert "The reference took 15% of the timed work" in table


def test_the_speed_questions_take_ratios_round_by_round():
    case = {"median_s": {"slow": 3.0, "fast": 2.0}, "samples_s": {"slow": [3.0, 2.0, 8.0], "fast": [1.0, 2.0, 2.0]}}
    assert _ratio(case, "slow", "fast") == 3.0  # the paired ratios 3, 1, 4; the medians' ratio would be 1.5
    assert _ratio({"median_s": case["median_s"]}, "slow", "fast") == 1.5  # recorded without samples
    host = FakeHost()
    variants = {"batched": host.work("batched", 0.001), "slicing": host.work("slicing", 0.0025)}
    timings = time_interleaved(variants, RepeatPolicy(min_time=0.0, min_repeats=6, max_repeats=6, warmup=1), host.clock)
    assert host.calls[-4:] == ["batched", "slicing", "batched", "slicing"] and len(timings["slicing"]["samples_s"]) == 6

    def cases(slowed: bool) -> list[dict]:
        out = []
        for heads, ratio in ((2, 1.6), (8, 1.8), (32, 2.2)):
            factors = [
                1.4 if slowed and i % 2 else 1.0 for i in range(6)
            ]  # every other round 40% slower, both variants
            samples = {"batched": [0.001 * f for f in factors], "slicing": [0.001 * ratio * f for f in factors],
                       "per_head": [0.0011 * f for f in factors]}  # fmt: skip
            medians = {name: sorted(values)[3] for name, values in samples.items()}
            out.append({"sizes": {"heads": heads}, "median_s": medians, "samples_s": samples})
        return out

    assert verdict_heads(cases(slowed=True)) == verdict_heads(cases(slowed=False))
    assert verdict_heads(cases(slowed=False))[0] == "confirmed"  # >= 1.5x at every head count, and growing


def test_interleaved_rounds_end_at_max_time_when_a_variant_cannot_fill_min_time():
    # A breakdown's empty cut (1 us) beside a 60 ms step: the cut would need 300,000 rounds to time 0.3 s by
    # itself. The rounds stop once both have min_repeats samples and max_time has passed (1.5 s: 25 rounds).
    host = FakeHost()
    variants = {"empty cut": host.work("empty cut", 1e-6), "whole": host.work("whole", 0.06)}
    policy = RepeatPolicy(min_time=0.3, min_repeats=7, max_time=1.5, warmup=1)
    timings = time_interleaved(variants, policy, host.clock)
    rounds = len(timings["whole"]["samples_s"])
    assert rounds == len(timings["empty cut"]["samples_s"]) == 25  # ceil(1.5 / 0.060001)
    # Variants that fill min_time and are stable stop at min_time, as before: 0.3 s of the 60 ms step is 5 rounds,
    # but min_repeats asks for 7.
    host = FakeHost()
    steady = {"a": host.work("a", 0.06), "b": host.work("b", 0.05)}
    assert len(time_interleaved(steady, policy, host.clock)["a"]["samples_s"]) == 7


def test_schema_1_reports_still_render_and_compare():
    old = load_report(SCHEMA_1)
    assert old["schema"] == 1 and not any("corrected_median_s" in cell for cell in old["cells"])
    assert all(cell_time(cell) == cell["median_s"] for cell in old["cells"] if cell.get("status") == "ok")
    table = markdown_table(old)
    assert "| median ms | rounds ms | IQR ms |" in table and "corrected ms" not in table
    assert compare_to_baseline(old, old)["flagged"] == []
    mixed = compare_to_baseline(_run(None), old)  # a schema-2 run against the committed schema-1 baseline
    # The fake cells stand at the reference size: the corrected 10 ms against the raw ~82 ms of the file.
    rows = {row["implementation"]: row for row in mixed["compared"]}
    assert set(rows) == {"numpy", "numpy:slicing", "torch"} and rows["numpy"]["corrected"] == [False, True]
    numpy = next(cell for cell in old["cells"] if cell["implementation"] == "numpy")
    assert rows["numpy"]["baseline_median_s"] == numpy["median_s"] and rows["numpy"]["change"] == "faster"


def test_cli_renders_and_compares_against_the_committed_schema_1_file(tmp_path, capsys):
    from mha_rosetta.cli.main import main

    reference = str(SCHEMA_1)
    assert main(["bench", "--render", reference, "--baseline", reference, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "| `numpy` | cpu | float32 | 4 | 512 | 512 | 8 |" in out and "no change beyond 10%" in out
    assert json.loads((tmp_path / "r.json").read_text())["baseline_comparison"]["flagged"] == []


def _cell(label: str, corrected: list[float], raw: list[float]) -> dict:
    ratio = [value / REFERENCE_S for value in corrected]
    return {"implementation": label, "device": "cpu", "dtype": "float32", "batch": 4, "tokens": 512, "d_model": 512,
            "heads": 8, "threads": 1, "status": "ok", "median_s": sorted(raw)[1], "round_medians_s": raw,
            "corrected_median_s": sorted(corrected)[1], "corrected_round_medians_s": corrected, "ratio_median": ratio[1]}  # fmt: skip


def test_compare_runs_counts_the_two_agreement_figures(tmp_path, capsys):
    first = {"cells": [_cell("numpy", [0.100, 0.101, 0.102], [0.100, 0.120, 0.090]),
                       _cell("torch", [0.080, 0.081, 0.082], [0.080, 0.080, 0.080])]}  # fmt: skip
    second = {"cells": [_cell("numpy", [0.104, 0.105, 0.106], [0.070, 0.075, 0.080]),
                        _cell("torch", [0.090, 0.091, 0.100], [0.080, 0.081, 0.082])]}  # fmt: skip
    comparison = compare_runs(first, second)
    # numpy: 0.105 / 0.101 - 1 = 4.0% (within 5%); torch: 0.091 / 0.081 - 1 = 12.3% (not).
    assert comparison["compared"] == 2 and comparison["runs_agreeing"] == 1
    differences = {cell["label"]: cell["difference"] for cell in comparison["cells"]}
    assert math.isclose(differences["numpy"], 0.105 / 0.101 - 1) and math.isclose(
        differences["torch"], 0.091 / 0.081 - 1
    )
    # Round spreads (corrected): 2.0%, 1.9%, 2.5%, 11.1% (torch B: 0.100 / 0.090 - 1): 3 of 4 within 10%.
    assert comparison["cell_runs"] == 4 and comparison["cell_runs_within"] == 3
    # Raw: numpy A 0.120 / 0.090 - 1 = 33%, numpy B 14%, torch 0% and 2.5%: 2 of 4.
    assert comparison["raw_cell_runs_within"] == 2 and comparison["raw_runs_agreeing"] == 1  # torch 1.2%; numpy 25%
    assert comparison["targets_met"] is False
    text = compare_markdown(comparison)
    assert text.startswith("Run agreement: 1 of 2 cells within 5% (raw medians: 1 of 2)")
    # By report: A numpy 2.0% and torch 2.5% (2), B numpy 1.9% (1); raw A torch 0%, B torch 2.5% (1 each).
    assert comparison["cell_runs_within_by_run"] == [2, 1] and comparison["raw_cell_runs_within_by_run"] == [1, 1]
    assert "Round agreement: 3 of 4 cell-runs with round figures within 10% (A 2, B 1) (raw: 2 (A 1, B 1))" in text
    assert comparison["ratio_runs_agreeing"] is None and "plain paired ratio" not in text  # no pairs recorded
    # Paired reports: the plain ratio's figures (ratio medians x the run's 2 ms reference) are set beside; with
    # ratios of the raw figures over 2 ms they count as the raw ones do.
    paired = [{"reference": {"workloads": {reference_key(WORKLOAD): {"median_s": REFERENCE_S}}},
               "cells": [{**cell, "reference": dict(WORKLOAD), "ratio_median": cell["median_s"] / REFERENCE_S,
                          "round_ratio_medians": [value / REFERENCE_S for value in cell["round_medians_s"]]}
                         for cell in report["cells"]]} for report in (first, second)]  # fmt: skip
    plain = compare_runs(*paired)
    assert plain["ratio_runs_agreeing"] == 1 and plain["ratio_cell_runs_within"] == 2
    assert plain["ratio_cell_runs_within_by_run"] == [1, 1] and plain["runs_agreeing"] == 1  # the rule's: as before
    assert "(raw medians: 1 of 2; plain paired ratio: 1 of 2)" in compare_markdown(plain)
    assert "(raw: 2 (A 1, B 1); plain paired ratio: 2 (A 1, B 1))" in compare_markdown(plain)
    assert comparison["cell_runs_needed"] == 4  # 36/38 of 4 cell-runs, rounded up: all 4
    assert "95% of the cell-runs, 4 of 4, within 10%): NOT met" in text  # this comparison's count, not 36 of 38
    same = compare_runs(first, first)
    assert same["runs_agreeing"] == 2 and same["targets_met"] is True  # 4 of 4 within 10% >= 36/38

    from mha_rosetta.cli.main import main

    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, report in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(report))
    assert main(["bench", "--compare", str(paths[0]), str(paths[1])]) == 1
    assert "Targets (every cell within 5%" in capsys.readouterr().out
    assert main(["bench", "--compare", str(paths[0]), str(paths[0])]) == 0


def test_compare_runs_puts_a_host_that_was_faster_for_a_whole_run_at_one_speed(capsys):
    # Run B's host is 8% faster throughout: every cell and the reference product take 0.92x. The
    # corrected figures (each in its run's milliseconds) differ by 8.7%; at one host speed they agree.
    def report(scale: float) -> dict:
        cells = [{**_cell(label, [t * scale] * 3, [t * scale] * 3), "reference": dict(WORKLOAD)}
                 for label, t in (("numpy", 0.100), ("torch", 0.080))]  # fmt: skip
        return {"reference": {"workloads": {reference_key(WORKLOAD): {"median_s": REFERENCE_S * scale}}},
                "cells": cells}  # fmt: skip

    comparison = compare_runs(report(1.0), report(0.92))
    assert comparison["runs_agreeing"] == 0 and comparison["targets_met"] is False
    assert math.isclose(comparison["reference_shift"], 0.92 - 1) and comparison["host_compared"] == 2
    assert comparison["host_runs_agreeing"] == 2 and comparison["host_targets_met"] is True
    assert all(math.isclose(cell["host_difference"], 0.0, abs_tol=1e-12) for cell in comparison["cells"])
    text = compare_markdown(comparison)
    assert "The host: the reference product's run median moved by -8.0% from A to B" in text
    assert "At one host speed (B x A's median reference / B's): 2 of 2 cells within 5%; targets met" in text
    # A cell that really changed (6% slower in B, beyond the host's 8%) still shows at one host speed.
    slower = report(0.92)
    slower["cells"][1] = {**_cell("torch", [0.080 * 0.92 * 1.06] * 3, [0.080 * 0.92 * 1.06] * 3),
                          "reference": dict(WORKLOAD)}  # fmt: skip
    changed = compare_runs(report(1.0), slower)
    assert changed["host_runs_agreeing"] == 1 and changed["host_targets_met"] is False
    torch = next(cell for cell in changed["cells"] if cell["label"] == "torch")
    assert math.isclose(torch["host_difference"], 0.06)
    # Unpaired reports: no host line.
    unpaired = {"cells": [_cell("numpy", [0.1] * 3, [0.1] * 3)]}
    assert "The host:" not in compare_markdown(compare_runs(unpaired, unpaired))


def test_the_baseline_comparison_also_reads_the_cells_at_one_host_speed():
    # This run's host is 12% faster throughout: numpy and torch take 0.88x, and so does the reference
    # product. In milliseconds both are flagged faster (beyond 10%, their ranges apart); at one host
    # speed (x the baseline's median reference / this run's) they are the same. einops-numpy held its
    # milliseconds while the host sped up: the same in ms, but 1/0.88 - 1 = 13.6% slower at one host speed.
    def report(scale: float, held: float | None = None) -> dict:
        cells = [{**_cell(label, [t * scale] * 3, [t * scale] * 3), "reference": dict(WORKLOAD)}
                 for label, t in (("numpy", 0.100), ("torch", 0.080))]  # fmt: skip
        cells.append({**_cell("einops-numpy", [held or 0.090 * scale] * 3, [held or 0.090 * scale] * 3),
                      "reference": dict(WORKLOAD)})  # fmt: skip
        return {"schema": SCHEMA_VERSION, "cells": cells,
                "reference": {"workloads": {reference_key(WORKLOAD): {"median_s": REFERENCE_S * scale}}}}  # fmt: skip

    comparison = compare_to_baseline(report(0.88, held=0.090), report(1.0))
    assert comparison["reference_shifts"] == [pytest.approx(-0.12)]
    assert comparison["host_compared"] == 3
    rows = {row["implementation"]: row for row in comparison["compared"]}
    assert {name: row["change"] for name, row in rows.items()} == {"numpy": "faster", "torch": "faster",
                                                                  "einops-numpy": "same"}  # fmt: skip
    assert {name: row["host_change"] for name, row in rows.items()} == {"numpy": "same", "torch": "same",
                                                                       "einops-numpy": "slower"}  # fmt: skip
    assert rows["numpy"]["host_ratio"] == pytest.approx(1.0) and rows["einops-numpy"]["host_ratio"] == pytest.approx(
        1 / 0.88
    )
    assert [row["implementation"] for row in comparison["host_differs"]] == ["numpy", "torch", "einops-numpy"]
    text = baseline_markdown(comparison)
    assert "- reference product: its run median moved by -12.0% (the host's own speed; 3 cells" in text
    assert (
        "- `numpy` cpu float32 B=4 N=512: faster by 12% (100.000 ms -> 88.000 ms; at one host speed +0%, the same)"
        in text
    )
    assert "- `einops-numpy` cpu float32 B=4 N=512: the same in ms (+0%) but slower by 14% at one host speed" in text
    assert _signed_percent(-0.003) == "+0%" and _signed_percent(-0.12) == "-12%"  # never "-0%" (a ratio of 0.9999)
    # The reports paired with different reference products, or a raw side: no host figures at all.
    other = report(1.0)
    for cell in other["cells"]:
        cell["reference"] = {**WORKLOAD, "n": 1024}
    assert compare_to_baseline(report(0.88), other)["host_compared"] == 0
    raw = report(1.0)
    raw["cells"] = [{k: v for k, v in cell.items() if not k.startswith("corrected")} for cell in raw["cells"]]
    plain = compare_to_baseline(report(0.88), raw)
    assert (
        plain["host_compared"] == 0
        and plain["reference_shifts"] == []
        and "reference product" not in (baseline_markdown(plain))
    )
    assert all("host_change" not in row for row in plain["compared"])


def test_the_reference_workload_is_numpy_on_a_cpu_and_a_framework_of_the_cell_on_a_gpu():
    assert reference_library("cpu", ("torch",)) == "numpy" and REFERENCE_SIZES["cpu"] == 512
    assert reference_library("gpu", ("einops", "torch")) == "torch"
    assert reference_library("gpu", ("jax", "flax")) == "jax"
    assert reference_library("gpu", ("numpy",)) is None  # NumPy has no GPU product: such a cell is not paired
    assert reference_key(WORKLOAD) == "cpu/numpy/float32/512"


def test_a_real_cell_pairs_every_sample_with_a_numpy_reference():
    spec = CellSpec(implementation="numpy", batch=1, tokens=16, d_model=32, heads=4,
                    policy={"min_time": 0.05, "min_repeats": 5, "max_time": 0.5, "warmup": 1})  # fmt: skip
    record = run_cell(spec, timeout=120)
    assert record["status"] == "ok", record.get("error")
    assert record["reference"]["library"] == "numpy" and record["reference"]["n"] == 512
    assert record["reference"]["flops"] == 2 * 512**3
    samples, references = record["samples_s"], record["reference_samples_s"]
    assert len(samples) == len(references) == len(record["paired_ratios"]) == record["repeats"] >= 5
    assert record["paired_ratios"] == pytest.approx([s / r for s, r in zip(samples, references, strict=True)])
    assert record["timed_total_s"] + record["reference_total_s"] >= 0.05  # the budget counts both


def _reference_alone_visits(host: FakeHost) -> list[dict]:
    """Three visits of 12 paired samples: the cell alternates 10 and 11 ms; its reference takes 2 ms, except in
    the whole first visit and at samples 4-5 of the others, where it alone is slowed 2.6x (measured so: jax-dpa's
    first visit on an Intel Xeon, 2026-12-01: 6.1 ms against 2.3 ms while its own median stayed within 2%).
    The slowed references cover an even and an odd sample alike, so they do not covary with the cell at all."""
    spec = CellSpec(implementation="numpy", batch=4, tokens=512, d_model=512, heads=8)
    visits = []
    for round_index in range(3):
        cell_ms = [10.0 + index % 2 for index in range(12)]
        ref_ms = [5.2 if round_index == 0 or index in (4, 5) else 2.0 for index in range(12)]
        count = [0]

        def run_once(count=count, cell_ms=cell_ms) -> None:
            host.now += cell_ms[count[0]] / 1e3
            count[0] += 1

        def reference(count=count, ref_ms=ref_ms) -> None:
            host.now += ref_ms[count[0] - 1] / 1e3

        policy = RepeatPolicy(min_time=0.0, min_repeats=12, max_repeats=12, warmup=0)
        timings = time_repeats(run_once, policy, clock=host.clock, cpu_clock=host.clock, reference=reference)
        outcome = {"status": "ok", **timings, "flops": 8e9, "gflops": 8e9 / timings["median_s"] / 1e9,
                   "reference": dict(WORKLOAD), "warnings": [], "cpu_util": 1.0}  # fmt: skip
        visits.append(cell_record(spec, outcome))
    return visits


def test_a_reference_slowed_on_its_own_leaves_the_corrected_figure_at_the_raw_one():
    cell = merge_visits(_reference_alone_visits(FakeHost()))
    report = assemble_report({"threads": 1}, [PEAK], [cell], machine={})
    out = report["cells"][0]
    # Run median reference: the visits' medians are 5.2, 2.0 and 2.0 ms -> 2 ms.
    assert report["reference"]["workloads"][reference_key(WORKLOAD)]["median_s"] == pytest.approx(0.002)
    assert out["reference_beta"] == pytest.approx(0.0, abs=1e-12) and out["reference_correlation"] == pytest.approx(
        0.0, abs=1e-12
    )
    # Raw: 18 samples of 10 ms and 18 of 11 -> 10.5 ms, and 10.5 ms in every round; the corrected figures are those.
    assert out["median_s"] == pytest.approx(0.0105) and out["round_medians_s"] == pytest.approx([0.0105] * 3)
    assert out["corrected_median_s"] == pytest.approx(0.0105)
    assert out["corrected_round_medians_s"] == pytest.approx([0.0105] * 3)
    assert out["corrected_spread_s"] == pytest.approx([0.0105, 0.0105]) and out["corrected_drift"] == pytest.approx(0)
    assert out["drift"] is False and out["warnings"] == []
    # The plain ratio (beta 1) would have put the first round at 10.5 / 5.2 x 2 = 4.04 ms: a 2.6x spread.
    assert out["round_ratio_medians"][0] * 0.002 == pytest.approx(0.0105 / 2.6)


def test_beta_is_the_slope_of_the_logs_by_hand():
    from mha_rosetta.benchmarks.correction import MIN_PAIRS, correct_cell, reference_fit

    # log(reference / 2 ms) = x = +-0.2 alternately; log(sample / 10 ms) = 0.5 x + e, e = 0.1 x (1, 1, -1, -1, 1,
    # 1, -1, -1, 0, 0), which sums to 0 and is orthogonal to x. Sxx = 10 x 0.04 = 0.4, Sxy = 0.5 Sxx = 0.2,
    # Syy = 0.25 x 0.4 + 8 x 0.01 = 0.18: beta = 0.2 / 0.4 = 0.5, correlation = 0.2 / sqrt(0.4 x 0.18) = 0.745356.
    x = [0.2 * (-1) ** index for index in range(10)]
    e = [0.1 * value for value in (1, 1, -1, -1, 1, 1, -1, -1, 0, 0)]
    references = [0.002 * math.exp(value) for value in x]
    samples = [0.010 * math.exp(0.5 * xi + ei) for xi, ei in zip(x, e, strict=True)]
    fit = reference_fit(samples, references)
    assert fit["beta"] == pytest.approx(0.5) and fit["correlation"] == pytest.approx(0.745356, abs=1e-6)
    assert fit["pairs"] == MIN_PAIRS == 10
    # Clipped to [0, 1]: a slope of 1.5 counts as 1 (the plain ratio), a negative one as 0 (the raw samples).
    assert reference_fit([0.010 * math.exp(1.5 * xi) for xi in x], references)["beta"] == 1.0
    assert reference_fit([0.010 * math.exp(-0.5 * xi) for xi in x], references)["beta"] == 0.0
    assert reference_fit(samples[:9], references[:9]) == {"beta": 0.0, "correlation": None, "pairs": 9}
    with pytest.raises(ValueError, match="samples and references must pair one to one; got 10 and 9"):
        reference_fit(samples, references[:9])
    # Corrected samples: 10 ms x exp(0.5 x + e) x (2 ms / (2 ms x exp(x))) ^ 0.5 = 10 ms x exp(e).
    cell = {"status": "ok", "implementation": "numpy", "reference": dict(WORKLOAD), "samples_s": samples,
            "reference_samples_s": references, "round_sample_counts": [4, 6], "round_medians_s": [0.010, 0.010],
            "round_drift": 0.0, "flops": 8e9, "gemm_peak_gflops": 100.0, "warnings": []}  # fmt: skip
    out = correct_cell(cell, {reference_key(WORKLOAD): {"median_s": 0.002}})
    # Round 1: 10 e^0.1, 10 e^0.1, 10 e^-0.1, 10 e^-0.1 -> 10 cosh(0.1) = 10.050 ms; round 2: e = 0.1, 0.1, -0.1,
    # -0.1, 0, 0 -> 10 ms; all ten: 4 x e^0.1, 4 x e^-0.1, 2 x 1 -> 10 ms.
    assert out["corrected_round_medians_s"] == pytest.approx([0.010 * math.cosh(0.1), 0.010])
    assert out["corrected_median_s"] == pytest.approx(0.010) and out["corrected_gflops"] == pytest.approx(800.0)
    assert out["corrected_drift"] == pytest.approx(math.cosh(0.1) - 1) and out["drift"] is False


def test_an_old_file_without_the_new_fields_loads_with_its_figures_re_derived(tmp_path):
    # A schema-2 file, written before the rule: the same report less what schema 3 added, its corrected figures
    # those of the plain ratio. Loading re-derives them from the kept samples, round counts found from the medians.
    new = _run("numpy")
    added = ("round_sample_counts", "reference_beta", "reference_correlation", "reference_pairs")
    old = {**new, "schema": 2, "cells": [{k: v for k, v in c.items() if k not in added} for c in new["cells"]]}
    old["cells"][1]["corrected_median_s"] = 1.0  # what the plain ratio (or anything) had written is not read
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_report(path)
    assert loaded["recorrected_from"] == 2 and loaded["reference"]["rule"] == new["reference"]["rule"]
    for before, after in zip(new["cells"], loaded["cells"], strict=True):
        for name in (*added[1:], "corrected_median_s", "corrected_round_medians_s", "corrected_spread_s", "drift"):
            assert after[name] == pytest.approx(before[name]), name
    # numpy's visits are told apart by their medians (10 and 14 ms samples, 12 ms per round); the other two cells'
    # samples are all alike, so any split reproduces their round medians (the first is taken: [1, 1, 28]).
    assert [cell["round_sample_counts"] for cell in loaded["cells"]] == [[10, 10, 10], [1, 1, 28], [1, 1, 28]]
    assert "corrected ms" in markdown_table(loaded) and compare_to_baseline(loaded, new)["flagged"] == []
    # Round medians that no split of the samples reproduces: raw figures only, and the reason.
    broken = {**old, "cells": [{**old["cells"][0], "round_medians_s": [0.5, 0.5, 0.5]}]}
    path.write_text(json.dumps(broken))
    cell = load_report(path)["cells"][0]
    assert "corrected_median_s" not in cell and cell_time(cell) == cell["median_s"]
    assert cell["reference_uncorrected"] == "its samples could not be told apart by round: raw figures only"
    assert cell["warnings"] == [f"not drift-corrected: {cell['reference_uncorrected']}"]


def test_the_schema_2_reference_loads_under_the_rule_and_renders():
    # docs/bench/reference.json as committed before the rule (kept as test data), written with the plain
    # ratio; jax-dpa's first visit slowed its reference 2.6x (6.09 ms against 2.30) while
    # its own median stayed at 117-119 ms, which the old rule could only escape by dropping to raw figures.
    assert json.loads(SCHEMA_2.read_text())["schema"] == 2
    report = load_report(SCHEMA_2)
    assert report["recorrected_from"] == 2 and report["schema"] == 3
    from mha_rosetta.report.runs import load_run

    assert load_run(SCHEMA_2).data["cells"] == report["cells"]  # `mha-rosetta report` reads it the same way
    cells = {cell["implementation"]: cell for cell in report["cells"] if cell.get("status") == "ok"}
    assert len(cells) == 19 and all(cell["reference_pairs"] >= 27 for cell in cells.values())
    jax_dpa = cells["jax-dpa"]
    assert jax_dpa["reference_beta"] < 0.01 and jax_dpa["round_sample_counts"] == [9, 9, 9]
    assert jax_dpa["corrected_median_s"] == pytest.approx(jax_dpa["median_s"], rel=0.01)
    assert "reference disturbed" not in " ".join(jax_dpa["warnings"])
    assert max(cell["reference_beta"] for cell in cells.values()) == pytest.approx(0.59, abs=0.01)  # torch:per_head
    assert "| corrected ms | rounds ms | raw ms | raw rounds ms |" in markdown_table(report)
    # The committed reference (measured afresh since) holds what the rule derives from its own samples.
    from mha_rosetta.benchmarks.correction import correct_cell, run_references

    stored = json.loads((DOCS / "reference.json").read_text())["cells"]
    workloads = run_references(stored)
    ok = [cell for cell in stored if cell.get("status") == "ok"]
    assert len(ok) >= 19 and all("corrected_median_s" in cell for cell in ok)
    assert all(correct_cell(cell, workloads)["corrected_median_s"] == cell["corrected_median_s"] for cell in ok)


def test_the_correction_rules_script_scores_each_rule_on_two_saved_runs(tmp_path, capsys):
    import runpy

    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "correction-rules"))
    paths = [tmp_path / "quiet.json", tmp_path / "disturbed.json"]
    for path, report in zip(paths, (_run(None), _run("numpy")), strict=True):
        path.write_text(json.dumps(report))
    assert script["main"]([str(path) for path in paths]) == 0
    rows = {row.split(" | ")[0].strip("| "): row for row in capsys.readouterr().out.splitlines()[2:]}
    # numpy: 10 ms quiet, 12 ms raw with half its samples (and their references) 40% slower. Raw: 2 of 3 cells
    # agree; every rule that sees the pairs (slope 1) puts it back at 10 ms; the round medians alone cannot (each
    # visit has the same 12 ms and 2.4 ms medians: no slope). Every round agrees with the others under every rule.
    expected = {"raw": 2, "plain ratio": 3, "pooled slope": 3, "within-visit slope": 3, "round-median slope": 2,
                "pooled, shrunk": 3}  # fmt: skip
    assert set(rows) == set(expected)
    for rule, agreeing in expected.items():
        assert rows[rule].startswith(f"| {rule} | {agreeing} of 3 | 6 of 6 (3, 3) |"), rows[rule]
    assert script["main"]([str(paths[0])]) == 2
    assert "usage: correction-rules A.json B.json" in capsys.readouterr().err
