"""`mha-rosetta report`: loading old and new files, the comparison's rules on hand-computed cells, the gate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mha_rosetta.cli.main import main
from mha_rosetta.report.agreement import matrix_cells
from mha_rosetta.report.build import build_report
from mha_rosetta.report.compare import cell_figure, compare, ratio, regressions
from mha_rosetta.report.runs import load_run, load_runs

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "bench"
DATA = ROOT / "tests" / "data"
SHAPE = {"device": "cpu", "dtype": "float32", "batch": 4, "tokens": 512, "d_model": 512, "heads": 8, "status": "ok"}


def bench_file(path: Path, cells: list[dict], *, schema: int = 1, host: str | None = None) -> Path:
    data = {"schema": schema, "settings": {"threads": 1}, "cells": [{**SHAPE, **cell} for cell in cells]}
    if host is not None:
        data["provenance"] = {"host": host, "git": {"commit": "0123456789abcdef", "dirty": True}}
    path.write_text(json.dumps(data))
    return path


def old_and_new(tmp_path: Path, write, prefix: str, old: list, new: list, **new_options) -> tuple[Path, Path]:
    """A baseline run from ``old-box`` and a new one from ``new-box``, each written by ``write`` (`bench_file` or
    `decode_file`) from its hand-made cells into ``<prefix>base.json`` and ``<prefix>new.json``."""
    base = write(tmp_path / f"{prefix}base.json", old, host="old-box")
    return base, write(tmp_path / f"{prefix}new.json", new, host="new-box", **new_options)


@pytest.fixture
def pair(tmp_path):
    old = [
        {"implementation": "a", "median_s": 0.010, "spread_s": [0.009, 0.011], "iqr_s": 0.0005},
        {"implementation": "b", "median_s": 0.020, "iqr_s": 0.002},
    ]
    new = [
        {"implementation": "a", "median_s": 0.0125, "spread_s": [0.012, 0.013], "samples_s": [0.0125] * 3},
        {"implementation": "b", "median_s": 0.0205, "iqr_s": 0.002},
        {"implementation": "c", "median_s": 0.001},
    ]
    return old_and_new(tmp_path, bench_file, "", old, new, schema=2)


def test_figure_and_range_rules():
    rounds = cell_figure({**SHAPE, "median_s": 0.010, "spread_s": [0.009, 0.011], "iqr_s": 0.0005})
    assert (rounds.seconds, rounds.lo, rounds.hi, rounds.used, rounds.range_rule) == (
        0.010,
        0.009,
        0.011,
        "median_s",
        "round medians",
    )
    # No round medians: the figure alone, whatever the IQR of its samples (the rule of `bench --baseline` too).
    alone = cell_figure({**SHAPE, "median_s": 0.020, "iqr_s": 0.002})
    assert (alone.lo, alone.hi) == (0.020, 0.020) and alone.range_rule == "single figure"
    corrected = cell_figure(
        {
            **SHAPE,
            "median_s": 0.010,
            "corrected_median_s": 0.011,
            "spread_s": [0.009, 0.011],
            "corrected_spread_s": [0.0105, 0.0118],
        }
    )
    assert corrected.used == "corrected_median_s" and corrected.seconds == 0.011
    assert (corrected.lo, corrected.hi) == pytest.approx((0.0105, 0.0118))  # the corrected rounds' own range
    assert cell_figure({**SHAPE, "median_s": 0.01, "status": "failed"}) is None


def test_ratio_and_noise_by_hand(pair):
    comparison = compare(load_runs(pair))
    assert [c.label for c in comparison.columns] == [
        "old-box @ 01234567+dirty · cpu · 1t",
        "new-box @ 01234567+dirty · cpu · 1t",
    ]
    group = ("fwd", "float32", "B4 N512 d512 h8")
    a_new, a_base = comparison.cells[1][(group, "a")], comparison.cells[0][(group, "a")]
    assert ratio(a_new, a_base) == pytest.approx((1.25, 0.012 / 0.011, 0.013 / 0.009))
    assert comparison.implementations(group) == ["c", "a", "b"]  # fastest first
    assert comparison.fastest(1, group) == 0.001


def test_gate_rule_by_hand(pair):
    base, new = (load_runs(pair)[0],), load_runs(pair)[1:]
    gate = regressions(list(base), new, 10)
    assert gate["compared"] == 2 and gate["unmatched"] == [
        "c fwd float32 B4 N512 d512 h8 on new-box @ 01234567+dirty · cpu · 1t"
    ]
    [found] = gate["regressions"]  # a: 25 % slower and beyond noise; b: +2.5 %, under the threshold
    assert found["cell"].startswith("a ") and found["change_pct"] == pytest.approx(25.0)
    assert regressions(list(base), new, 30)["regressions"] == []  # beyond noise but under the threshold
    # b has no round medians: its range is its figure alone, so at 0 % its +2.5 % counts (no IQR band).
    assert [g["cell"][0] for g in regressions(list(base), new, 0)["regressions"]] == ["a", "b"]
    assert [g["cell"][0] for g in regressions(list(base), new, 3)["regressions"]] == ["a"]
    with pytest.raises(ValueError, match="--fail-on-regression: expected a percentage >= 0, got -1"):
        regressions(list(base), new, -1)


def test_cli_exit_status_follows_the_gate(pair, capsys):
    base, new = map(str, pair)
    assert main(["report", new, "--baseline", base, "--fail-on-regression", "10", "--markdown", "-"]) == 1
    out, err = capsys.readouterr()
    assert "regression: a fwd float32" in err and "+25.0 %" in err
    assert "1 slower beyond noise and beyond the threshold" in out
    assert main(["report", new, "--baseline", base, "--fail-on-regression", "30", "--markdown", "-"]) == 0
    assert main(["report", new, "--baseline", base, "--markdown", "-"]) == 0  # no threshold: listed, not failed
    assert main(["report", new, "--fail-on-regression", "10"]) == 2
    assert "--fail-on-regression needs --baseline FILE" in capsys.readouterr().err


def test_bad_files_are_named(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"hello": 1}')
    (tmp_path / "y.json").write_text("{")
    bench_file(tmp_path / "z.json", [], schema=4)
    assert main(["report", str(tmp_path / "x.json")]) == 2
    assert (
        "x.json is not a check, bench or explain JSON (expected 'matrices', 'cells' or 'claims'; got dict with keys hello)"
        in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match=r"y.json is not JSON \(Expecting"):
        load_run(tmp_path / "y.json")
    with pytest.raises(ValueError, match="bench schema 4 is not one this version reads"):
        load_run(tmp_path / "z.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_run(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="--baseline: expected a bench JSON, got a claims file"):
        (tmp_path / "c.json").write_text('[{"claim": 1, "verdict": "confirmed"}]')
        build_report([str(bench_file(tmp_path / "ok.json", []))], baseline=[str(tmp_path / "c.json")])


def test_committed_reference_files_load_labelled_by_file_name(capsys):
    # The reference reports as committed before provenance was recorded (schema 1, AMD EPYC), kept as test data.
    old = [str(DATA / "reference-schema1.json"), str(DATA / "reference-t2-schema1.json")]
    status = main(["report", *old, "--markdown", "-"])
    out = capsys.readouterr().out
    assert status == 0
    assert "| reference-schema1.json (AMD EPYC) | bench | reference-schema1.json |" in out
    assert "no provenance (written before it was recorded): labelled by file name" in out
    # torch-sdpa in the committed file: median 77.1 ms, round medians 75.9-79.4 ms; at 2 threads 40.9 ms.
    assert "| torch-sdpa | 77.1 [75.9–79.4] | 40.9 [39.1–41.7] ×0.53 [0.49–0.55] |" in out


@pytest.mark.parametrize(
    "name", ["default.json", "quick.json", "long/long.json", "fwdbwd/reference.json", "sharded/sharded_2threads.json"]
)
def test_every_committed_bench_file_loads(name):
    report = build_report([str(BENCH / name)])
    assert report.comparison.cells[0], name
    assert "## Benchmarks" in report.markdown()


def test_report_json_has_provenance(pair, tmp_path):
    target = tmp_path / "r.json"
    assert main(["report", *map(str, pair), "--json", str(target)]) == 0
    data = json.loads(target.read_text())
    assert data["provenance"]["tool"] == "mha-rosetta" and data["schema"] == 1
    [a] = [row for row in data["bench"] if row["implementation"] == "a"]
    assert a["cells"][1] == {
        "seconds": 0.0125,
        "range": [0.012, 0.013],
        "used": "median_s",
        "range_rule": "round medians",
    }


@pytest.fixture(scope="module")
def check_json(tmp_path_factory):
    target = tmp_path_factory.mktemp("check") / "check.json"
    argv = ["check", "--backends", "numpy", "--cases", "self_attention,causal", "--dtypes", "float64,float32"]
    assert main([*argv, "--quiet", "--json", str(target)]) == 0
    return target


def test_heatmap_cells_tell_the_pairs_story(check_json):
    run = load_run(check_json)
    assert run.kind == "check" and run.provenance["tool"] == "mha-rosetta"
    for matrix in run.data["matrices"]:
        cells = matrix_cells(run, matrix)
        n = len(matrix["labels"])
        assert len(cells) == n * (n - 1)
        for cell in cells:
            assert cell["status"] == matrix["status"][cell["row"]][cell["col"]]
            pairs = [
                p
                for p in run.data["pairs"]
                if p["dtype"] == matrix["dtype"] and {p["a"], p["b"]} == {cell["a"], cell["b"]}
            ]
            worst = max(pairs, key=lambda p: p["max_rel"])
            assert (cell["case"], cell["max_rel"]) == (worst["case"], matrix["max_rel"][cell["row"]][cell["col"]])
            assert cell["rtol"] == run.data["tolerances"][matrix["dtype"]]["rtol"]
        [mistake] = [c for c in cells if c["a"] == "numpy" and c["b"] == "numpy:direct_reshape"]
        assert mistake["status"] == "caught" and mistake["stage_b"] == "q_heads (split heads)"
        assert mistake["stage_a"] == "none (every stage within tolerance)"


def test_markdown_merges_check_bench_and_claims(check_json, pair, tmp_path):
    claims = tmp_path / "claims.json"
    claims.write_text(json.dumps([{"claim": 1, "title": "t", "verdict": "confirmed", "evidence": "e"}]))
    wrapped = tmp_path / "explain.json"  # explain --claims --json: the claims with provenance
    wrapped.write_text(json.dumps({"schema": 1, "claims": [{"claim": 2, "title": "u", "verdict": "refuted"}]}))
    text = build_report([str(check_json), *map(str, pair), str(claims), str(wrapped)]).markdown()
    assert "## Agreement checks" in text and "## Benchmarks" in text
    assert "| claims.json | 1 | t | confirmed |" in text
    assert "| explain.json | 2 | u | refuted |" in text


def test_docs_report_command_runs_as_printed(capsys):
    section = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    first = section.split("```sh\n", 1)[1].split("\n", 1)[0]
    assert first == "mha-rosetta report docs/bench/reference.json docs/bench/reference-t2.json --markdown -"
    argv = [str(ROOT / arg) if arg.startswith("docs/") else arg for arg in first.split()[1:]]
    assert main(argv) == 0
    # torch-sdpa in the committed files, both on the Intel Xeon: 1 thread (2026-12-06 19:03, 3 rounds of 2 visits,
    # drift-corrected): 34.83 ms, rounds 34.73-35.07 ms; 2 threads (2026-12-06 18:44, 3 rounds of 2 visits, the
    # reference product on one BLAS thread): 18.80 ms (18.63-18.94). 18.80 / 34.83 = 0.54x (the docs say so).
    assert "| torch-sdpa | 34.8 [34.7–35.1] | 18.8 [18.6–18.9] ×0.54 [0.53–0.55] |" in capsys.readouterr().out


def test_scaling_plot_of_the_long_preset_tells_every_line_apart():
    from mha_rosetta.report.svg import scaling_plot, scaling_series, series_style

    comparison = build_report([str(BENCH / "long" / "long.json")]).comparison
    [(family, lines)] = scaling_series(comparison).items()
    # One line per implementation measured at some size in the committed run (20 since torch-flex joined).
    cells = json.loads((BENCH / "long" / "long.json").read_text(encoding="utf-8"))["cells"]
    measured = {cell["implementation"] for cell in cells if cell["status"] == "ok"}
    assert family == ("fwd", "float32", "B1 d512 h8") and len(lines) == len(measured) == 20
    assert lines[("torch-sdpa", 0)][1024] > 0 and set(lines[("torch-sdpa", 0)]) == {
        1024,
        2048,
        4096,
        8192,
        16384,
        32768,
    }
    assert len({series_style(i) for i in range(30)}) == 30  # colour and marker: 30 distinct series
    svg = scaling_plot(lines, "s", relative=True)
    assert svg.count("<polyline") == len(measured) and "× the fastest at that size" in svg


def test_help_says_the_rules(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "corrected_median_s (drift-corrected, with the corrected round spread) when present" in text
    assert "[min, max] of its round medians, else the figure alone" in text
    assert "Cells match by implementation, variant, mode, dtype, shape, threads and device" in text
    assert "the exit status is 1 when any cell's whole range is above the matching baseline cell's range" in text
    assert "more than PCT % slower; else 0" in text
    assert "one table per context, window and step (context=32768 W=4096)" in text


# -- decode files (bench --mode decode) ------------------------------------------------------------
def decode_file(path: Path, cells: list[tuple], *, host: str, gbps: float = 8.0) -> Path:
    """A decode report assembled as `bench --mode decode` assembles it, from hand-made cells:
    (implementation, context, window, median_s, [round low, round high])."""
    from mha_rosetta.benchmarks.decode import DecodeCellSpec, decode_record
    from mha_rosetta.benchmarks.decode_sweep import assemble_decode_report, decode_settings

    records = []
    for name, context, window, median, spread in cells:
        spec = DecodeCellSpec(
            implementation=name, context=context, window=window, d_model=64, heads=4, kv_heads=2, d_k=16
        )
        outcome = {"status": "ok", "median_s": median, "iqr_s": 0.0001, "round_medians_s": spread, "spread_s": spread}
        records.append(decode_record(spec, outcome))
    settings = decode_settings("decode-quick", d_model=64, heads=4, kv_heads=2, d_k=16).as_dict()
    data = assemble_decode_report(settings, [{"device": "cpu", "threads": 1, "gbps": gbps}], records)
    data["provenance"]["host"] = host
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def decode_pair(tmp_path):
    old = [
        ("numpy", 1024, None, 0.0020, [0.0019, 0.0021]),
        ("numpy", 4096, None, 0.0040, [0.0038, 0.0042]),
        ("numpy", 4096, 256, 0.0025, [0.0024, 0.0026]),
        ("torch", 1024, None, 0.0030, [0.0029, 0.0031]),
    ]
    new = [
        ("numpy", 1024, None, 0.00205, [0.0020, 0.0021]),
        ("numpy", 4096, None, 0.0060, [0.0059, 0.0061]),
        ("numpy", 4096, 256, 0.0025, [0.0024, 0.0026]),
    ]
    return old_and_new(tmp_path, decode_file, "decode-", old, new)


def test_decode_cells_are_one_table_per_context_and_window(decode_pair):
    report = build_report(list(map(str, decode_pair)))
    shapes = [group[2] for group in report.comparison.groups()]
    assert report.comparison.groups()[0][:2] == ("decode", "float32")
    assert shapes == [
        "B1 context=1024 step=1 d64 h4 hkv2 dk16 rope=half",
        "B1 context=4096 step=1 d64 h4 hkv2 dk16 rope=half",
        "B1 context=4096 W=256 step=1 d64 h4 hkv2 dk16 rope=half",
    ]
    text = report.markdown()
    # The K/V read limit: 1 x 1024 slots x 2 kv heads x (16 + 16) x 4 bytes = 262144 bytes over 8 GB/s = 32.768 us;
    # over 2 ms: 1.6%. Ratio 2.05 / 2.0 = 1.025 (1.0250000000000001: ×1.03), its range [2.0 / 2.1, 2.1 / 1.9] = [0.95, 1.11]: within noise.
    assert "### decode · float32 · B1 context=1024 step=1 d64 h4 hkv2 dk16 rope=half" in text
    assert (
        "| numpy | 2 [1.9–2.1] · 1.6% of KV limit | 2.05 [2–2.1] · 1.6% of KV limit ×1.03 [0.95–1.11] within noise |"
        in text
    )
    assert "| torch | 3 [2.9–3.1] · 1.1% of KV limit | - |" in text  # 32.768 us / 3 ms
    # 4096 slots: 131.072 us over 4 ms = 3.3%, over 6 ms = 2.2%; 6 / 4 = 1.5 [5.9 / 4.2, 6.1 / 3.8], beyond noise.
    assert "| numpy | 4 [3.8–4.2] · 3.3% of KV limit | 6 [5.9–6.1] · 2.2% of KV limit ×1.50 [1.40–1.61] |" in text
    # The window's ring of W - 1 + step = 256 slots: 32.768 us / 4 = 8.192 us over 2.5 ms = 0.3%.
    assert "| numpy | 2.5 [2.4–2.6] · 0.3% of KV limit | 2.5 [2.4–2.6] · 0.3% of KV limit ×1.00" in text
    assert "% of KV limit: the K and V bytes the step reads over the copy bandwidth" in text
    # A column's label is its host, then " @ commit" where the report was written from a git checkout (an
    # installed package, as in tox, has none).
    assert re.search(
        r"Copy bandwidth \(the K/V limit's yardstick\), per column: old-box( @ \S+)? · cpu · 1t: 8\.00 GB/s; "
        r"new-box( @ \S+)? · cpu · 1t: 8\.00 GB/s\.",
        text,
    ), text
    data = report.to_json()
    [row] = [r for r in data["bench"] if r["implementation"] == "torch"]
    assert row["cells"][0]["limit_fraction"] == pytest.approx(262144 / 8e9 / 0.003) and row["cells"][1] is None


def test_the_decode_gate_fails_only_the_cell_slower_beyond_noise(decode_pair, capsys):
    base, new = map(str, decode_pair)
    assert main(["report", new, "--baseline", base, "--fail-on-regression", "20", "--markdown", "-"]) == 1
    err = capsys.readouterr().err
    assert err.count("regression:") == 1
    assert "regression: numpy decode float32 B1 context=4096 step=1 d64 h4 hkv2 dk16 rope=half" in err
    assert "+50.0 % (6 ms vs 4 ms, beyond noise)" in err
    assert main(["report", new, "--baseline", base, "--fail-on-regression", "60", "--markdown", "-"]) == 0
    gate = build_report([new], baseline=[base], threshold_pct=20).gate
    assert gate["compared"] == 3 and gate["unmatched"] == []


def test_the_committed_decode_file_has_a_table_per_context_with_its_share_of_the_limit():
    report = build_report([str(BENCH / "decode.json")])
    groups = report.comparison.groups()
    # 12 implementations (the four best paths among them) at 3 contexts; the windowed groups have 8, since
    # the best paths implement no window and say so.
    assert len(groups) == 6
    assert [len(report.comparison.implementations(group)) for group in groups] == [12, 12, 12, 8, 8, 8]
    text = report.markdown()
    # docs/bench/decode.md (Intel Xeon, 2026-12-06 15:11 UTC, 2 rounds, drift-corrected): numpy at 1024, step
    # 1.746 ms, rounds 1.744-1.750, 9.7% of the K+V limit; jax at 32768 with W=4096: 8.282 ms, 8.221-8.371, 8.2%.
    assert "| numpy | 1.75 [1.74–1.75] · 9.7% of KV limit |" in text
    window = text.split("### decode · float32 · B1 context=32768 W=4096", 1)[1].split("###", 1)[0]
    assert "| jax | 8.28 [8.22–8.37] · 8.2% of KV limit |" in window
    page = report.html()
    assert "context (log2)" in page and page.count('1.75 <span class="small">[1.74–1.75]</span>') == 1


def test_bench_baseline_and_compare_take_decode_reports(decode_pair, capsys):
    base, new = map(str, decode_pair)
    assert main(["bench", "--render", new, "--baseline", base]) == 0
    out = capsys.readouterr().out
    assert "- copy bandwidth cpu: 8.0 -> 8.0 GB/s (+0%; the machine's own change, for scale)" in out
    assert "- `numpy` cpu float32 B=1 context=4096: slower by 50% (4.000 ms -> 6.000 ms)" in out
    assert "context=1024: moved" not in out and "W=256: moved" not in out  # 2.5%: neither flagged nor noted
    quick = str(BENCH / "quick.json")
    assert main(["bench", "--render", new, "--baseline", quick]) == 2
    assert "is a forward bench report and this is a decode one" in capsys.readouterr().err
    assert main(["bench", "--mode", "decode", "--baseline", quick]) == 2  # refused before anything is measured
    assert "is a forward bench report and this is a decode one" in capsys.readouterr().err
    assert main(["bench", "--compare", base, new]) == 1
    out = capsys.readouterr().out
    assert "| `numpy` | B=1 context=4096 | raw | 4.000 / 6.000 | 50.0% |" in out
    assert "| `numpy` | B=1 context=4096 W=256 | raw | 2.500 / 2.500 | 0.0% |" in out
    assert main(["bench", "--compare", base, quick]) == 2
    assert "--compare: A is a decode bench report and B a forward one; only reports of one kind are compared" in (
        capsys.readouterr().err
    )


# -- the decode check (check --decode --json) ----------------------------------------------------------
@pytest.fixture(scope="module")
def decode_check_json(tmp_path_factory):
    """The decode check of test_check_decode's fakes: one right, one whose rotary restarts at 0, one without a cache."""
    from test_check_decode import ChunkReference, NoCache, RotaryRestarts

    from mha_rosetta.checks import run_check
    from mha_rosetta.checks.json_report import write_decode_json

    backends = [ChunkReference(), RotaryRestarts(), NoCache()]
    result = run_check(backends=backends, cases=["gqa_rotary", "two_per_step"], dtypes=["float64"], kind="decode")
    target = tmp_path_factory.mktemp("decode-check") / "decode-check.json"
    write_decode_json(result, str(target))
    return target


def test_the_decode_check_is_read_against_its_oracle_with_where_runs_part(decode_check_json):
    from mha_rosetta.report.agreement import is_decode_check, oracle_rows

    run = load_run(decode_check_json)
    assert run.kind == "check" and is_decode_check(run) and run.provenance["tool"] == "mha-rosetta"
    [(dtype, rows)] = oracle_rows(run).items()
    assert dtype == "float64"
    rows = {row["implementation"]: row for row in rows}
    assert list(rows) == ["chunk-ref[tokens]", "rotary-restarts[tokens]", "no-cache"]
    right, wrong, none = rows.values()
    assert (right["status"], right["cases"], right["where"]) == (
        "agree",
        {"agree": 2},
        "none (every stage within tolerance)",
    )
    assert (wrong["status"], wrong["cases"]) == ("DISAGREE", {"DISAGREE": 2})
    # the worst of the two cases by max rel, and where it parts (test_check_decode names both: step 1, position 4)
    runs = [r for r in run.data["runs"] if r["implementation"] == "rotary-restarts[tokens]"]
    worst = max(runs, key=lambda r: r["max_rel"])
    assert (wrong["case"], wrong["max_rel"]) == (worst["case"], worst["max_rel"])
    assert wrong["where"] == worst["where"] == "step 1 (position 4) diverges at q_rotated"
    assert (none["status"], none["where"]) == (
        "unsupported",
        "no-cache has no KV-cache decoding: the library's API has no KV cache",
    )
    # the pair matrix's tooltip names where the decode runs part, as the forward's names the stage
    [cell] = [
        c
        for c in matrix_cells(run, run.data["matrices"][0])
        if c["a"] == "chunk-ref[tokens]" and c["b"] == "rotary-restarts[tokens]"
    ]
    assert (cell["status"], cell["stage_b"]) == ("DISAGREE", "step 1 (position 4) diverges at q_rotated")
    assert cell["stage_a"] == "none (every stage within tolerance)"
    text = build_report([str(decode_check_json)]).markdown()
    assert "Decode, float64, each implementation and cache kind against the full causal forward" in text
    assert "(its worst case; tolerance atol 1e-10, rtol 1e-09)" in text
    line = (
        f"| rotary-restarts[tokens] | DISAGREE | DISAGREE 2 | {worst['case']} | {worst['max_abs']:.3g} | "
        f"{worst['max_rel']:.3g} | step 1 (position 4) diverges at q_rotated |"
    )
    assert line in text
    page = build_report([str(decode_check_json)]).html()
    assert page.count('class="heatmap oracle-grid"') == 1
    assert 'data-stage="step 1 (position 4) diverges at q_rotated"' in page
