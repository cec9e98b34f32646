"""``bench --mode decode``: the copy bandwidth, the limit arithmetic, a cell's figures, and the command end to end.

The cells here decode with the NumPy fake of `decode_fake` (a cache of random K/V and one attention
step), registered by path in the parent and in every measured child (``tests/`` on PYTHONPATH). No
test asserts a speed: the timings come from a fake clock, or are only checked to be consistent with
the bytes they were computed from.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends.registry import REGISTRY, register_path
from mha_rosetta.benchmarks import bandwidth
from mha_rosetta.benchmarks.bandwidth import (
    array_mb_for,
    cache_warning,
    copy_bytes,
    copy_program,
    enrich_decode_cell,
    kv_read_bytes,
    last_level_cache_bytes,
    limit_fraction,
    limit_seconds,
    weight_bytes,
)
from mha_rosetta.benchmarks.decode import (
    DecodeCellSpec,
    decode_config,
    decode_record,
    ragged_lengths,
    row_label,
    run_decode_cell,
    time_prepared,
)
from mha_rosetta.benchmarks.decode_docs import BEGIN, END, readme_block
from mha_rosetta.benchmarks.decode_sweep import decode_settings, expand_decode_cells, parent_reason
from mha_rosetta.benchmarks.markdown import decode_markdown, decode_row
from mha_rosetta.benchmarks.pinning import choose_cpus
from mha_rosetta.benchmarks.timing import RepeatPolicy
from mha_rosetta.core import init_params
from mha_rosetta.core.decode import ring_capacity

TESTS = Path(__file__).resolve().parent
PLUGIN = "decode_fake:FakeDecode"
SMALL = dict(d_model=64, heads=4, kv_heads=2, d_k=16)  # a layer small enough for a child in a second
FAST = dict(min_time=0.01, min_repeats=5, max_time=0.2, warmup=1)


@pytest.fixture
def fake(monkeypatch):
    """The fake registered here, and ``tests/`` on the PYTHONPATH of every child started from now on."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    name = register_path(PLUGIN)
    yield name
    REGISTRY.pop(name, None)


# -- the copy and its bytes ----------------------------------------------------------------------
def test_copy_bytes_counts_one_read_and_one_write():
    assert copy_bytes(1000, 8) == 16_000
    assert copy_bytes(1, 4) == 8


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_the_copy_moves_the_bytes_it_says(library):
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    launch, sync, facts = copy_program(library, 1 << 20, "cpu")  # 1 MiB per array
    src, dst = facts["arrays"]
    assert facts["elements"] == (1 << 20) // facts["itemsize"]
    assert facts["moved_bytes"] == 2 * (1 << 20)
    dst[...] = -1  # what the copy must overwrite, every element (NumPy and torch alike)
    launch()
    sync()
    values = np.asarray(dst)
    assert values.shape == (facts["elements"],)
    assert np.array_equal(values, np.arange(facts["elements"], dtype=values.dtype))
    assert np.array_equal(values, np.asarray(src))


def test_a_library_that_cannot_copy_says_why():
    assert "NumPy has no GPU" in bandwidth.unsupported_reason("numpy", "gpu")
    assert "library must be one of numpy, torch" in bandwidth.unsupported_reason("cupy", "cpu")
    assert "device must be 'cpu' or 'gpu'" in bandwidth.unsupported_reason("numpy", "tpu")


def test_the_measured_bandwidth_is_its_bytes_over_its_median():
    record = bandwidth.measure_bandwidth("cpu", 1, None, array_mb=4, policy=FAST, libraries=["numpy"])
    numpy_record = record["by_library"]["numpy"]
    assert numpy_record["status"] == "ok", numpy_record
    assert numpy_record["array_bytes"] == 4 << 20
    assert numpy_record["moved_bytes"] == 8 << 20
    assert numpy_record["gbps"] == pytest.approx(numpy_record["moved_bytes"] / numpy_record["median_s"] / 1e9)
    assert numpy_record["best_gbps"] >= numpy_record["gbps"]  # the min sample is never slower than the median
    assert record["library"] == "numpy" and record["gbps"] == numpy_record["gbps"]
    assert record["array_mb"] == 4 and record["array_rule"] == "as requested"
    # The decode limit's read stream, in its own pinned child: what it read and the cache it found.
    read = record["read"]
    assert read["status"] == "ok" and record["read_gbps"] == read["read_gbps"] == read["read"]["gbps"]
    assert read["read"]["array_bytes"] >= 4 * (read["llc"]["llc_bytes"] or 0)  # past the measured cache
    assert record["measured_llc_bytes"] == read["llc"]["llc_bytes"]


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, (level, kind, size) in enumerate(
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (3, "Unified", "480M")]
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 480 * 2**20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_the_array_size_is_far_beyond_the_cache_within_the_memory():
    assert array_mb_for("cpu", None, 8 * 2**20, 100_000) == (512.0, "the default")
    assert array_mb_for("cpu", None, 480 * 2**20, 100_000) == (1920.0, "4 x the last-level cache")
    assert array_mb_for("cpu", None, 480 * 2**20, 4000) == (1000.0, "held to a quarter of the available memory")
    assert array_mb_for("cpu", 64, 480 * 2**20, 4000) == (64.0, "as requested")
    assert array_mb_for("gpu", None, None, None)[0] == bandwidth.GPU_ARRAY_MB
    with pytest.raises(ValueError, match="array_mb must be a positive number of MiB, got -1"):
        array_mb_for("cpu", -1, None, None)
    assert "may be overstated" in cache_warning(64 * 2**20, 480 * 2**20)
    assert cache_warning(2048 * 2**20, 480 * 2**20) is None


# -- the limit arithmetic --------------------------------------------------------------------------
def test_the_kv_bytes_of_a_step_by_hand():
    # B=1, 1024 tokens, 4 kv heads, Dk = Dv = 128, float32: 1 x 1024 x 4 x 256 x 4 = 4 MiB
    assert kv_read_bytes(1, 1024, 4, 128, 128, 4) == 4 * 2**20
    # a window's ring of 4096 slots: 32k tokens read 4096 slots, 2k tokens their own 2048
    assert kv_read_bytes(1, 32768, 4, 128, 128, 4, ring=4096) == 16 * 2**20
    assert kv_read_bytes(1, 2048, 4, 128, 128, 4, ring=4096) == 8 * 2**20
    assert kv_read_bytes(2, 10, 3, 5, 7, 2) == 2 * 10 * 3 * 12 * 2
    # W_q and W_o (2048 x 2048) and W_k, W_v (2048 x 512), float32: 40 MiB
    assert weight_bytes(2048, 16, 4, 128, 128, 4) == 40 * 2**20


def test_the_limit_and_the_share_of_it_by_hand():
    assert limit_seconds(4 * 2**20, 4 * 2**20 / 1e6) == pytest.approx(1e-3)  # 4 MiB at 4.19 GB/s: 1 ms
    assert limit_seconds(1000, None) is None and limit_seconds(1000, 0.0) is None
    assert limit_fraction(1e-3, 2e-3) == pytest.approx(0.5)
    assert limit_fraction(None, 2e-3) is None and limit_fraction(1e-3, 0.0) is None


# -- a cell --------------------------------------------------------------------------------------
class FakeClock:
    """A clock that moves only when the timed step runs: every step takes exactly ``per_call`` seconds."""

    def __init__(self, per_call: float) -> None:
        self.now, self.per_call = 0.0, per_call

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.per_call


def test_a_cells_share_of_the_limit_from_a_fake_clock(fake):
    from mha_rosetta.backends import get_backend

    spec = DecodeCellSpec(implementation=fake, context=1000, **SMALL)
    cfg = decode_config(spec)
    prepared = get_backend(fake).prepare_decode(cfg, init_params(cfg, seed=0), context=1000, dtype="float32")
    clock = FakeClock(2e-3)

    def forward():
        result = prepared.forward()
        clock.tick()
        return result

    timings = time_prepared(forward, prepared.synchronize, None, RepeatPolicy(**FAST), clock=clock, cpu_clock=clock)
    assert timings["median_s"] == pytest.approx(2e-3) and timings["iqr_s"] == pytest.approx(0.0)
    assert timings["first_call_s"] == pytest.approx(2e-3) and timings["compile_s"] is None
    cell = decode_record(spec, {"status": "ok", **timings, "cache_info": prepared.info["cache"]})
    # K and V of 1000 tokens: 1000 x 2 kv heads x (16 + 16) x 4 bytes = 256 000 bytes; at 0.256 GB/s, 1 ms.
    enriched = enrich_decode_cell(cell, 0.256)
    assert enriched["kv_read_bytes"] == 256_000
    assert enriched["limit_s"] == pytest.approx(1e-3)
    assert enriched["step_s"] == pytest.approx(2e-3)
    assert enriched["limit_fraction"] == pytest.approx(0.5)
    weights = 64 * (4 * 16 + 2 * 16 + 2 * 16 + 4 * 16) * 4  # W_q, W_k, W_v, W_o in float32
    assert enriched["weight_bytes"] == weights
    assert enriched["limit_fraction_with_weights"] == pytest.approx((256_000 + weights) / 0.256e9 / 2e-3)
    assert enriched["tokens_per_s"] == pytest.approx(500.0)
    assert enriched["cache_mb"] == pytest.approx(1001 * 2 * 16 * 2 * 4 / 2**20)  # the fake's context + step slots
    assert "fits_last_level_cache" not in enriched  # no cache size known, nothing claimed
    assert enrich_decode_cell(cell, 0.256, llc_bytes=256_000 + weights)["fits_last_level_cache"] is True
    assert enrich_decode_cell(cell, 0.256, llc_bytes=256_000 + weights - 1)["fits_last_level_cache"] is False
    row = decode_row(enriched)
    assert row[3] == "1000" and row[4] == "2.000" and row[10] == "50.0%" and row[12] == "500"
    assert row[6] == row[7] == "" and enriched["read_limit_s"] is None  # no read bandwidth measured, no read limit
    # The limit that counts every byte (issue 43): K, V and the weights over a read bandwidth of 0.5 GB/s,
    # (256 000 + 49 152) / 0.5e9 = 0.610 ms, 30.5% of the 2 ms step; 305 152 bytes fit a 300 KiB cache, not 256 KiB.
    read = enrich_decode_cell(cell, 0.256, read_gbps=0.5, measured_llc_bytes=300 * 1024)
    assert weights == 49_152 and read["read_limit_s"] == pytest.approx(305_152 / 0.5e9)
    assert read["read_limit_fraction"] == pytest.approx(305_152 / 0.5e9 / 2e-3)
    assert read["fits_measured_cache"] is True
    assert enrich_decode_cell(cell, 0.256, read_gbps=0.5, measured_llc_bytes=256 * 1024)["fits_measured_cache"] is False
    assert decode_row(read)[7] == "30.5%"


def test_each_cell_is_read_against_its_frameworks_best_path():
    """``over_best``: the step over the best path of the framework it computes in, same context and window."""
    from mha_rosetta.benchmarks.decode_sweep import best_of_framework

    def cell(name, context, step_s, window=None, status="ok"):
        return dict(implementation=name, device="cpu", dtype="float32", context=context, window=window, step=1,
                    status=status, step_s=step_s)  # fmt: skip

    cells = [
        cell("numpy-best", 1024, 2e-3), cell("numpy", 1024, 3e-3), cell("einops-numpy", 1024, 5e-3),
        cell("jax", 1024, 8e-3), cell("numpy", 2048, 4e-3), cell("numpy", 1024, 9e-3, window=512),
        cell("torch", 1024, None, status="unsupported"),
    ]  # fmt: skip
    best_of_framework(cells)
    assert [c.get("over_best") for c in cells] == [1.0, 1.5, 2.5, None, None, None, None]
    assert cells[1]["best_path"] == cells[2]["best_path"] == "numpy-best"  # einops on NumPy arrays: NumPy's best


def test_a_paged_cell_is_read_against_its_own_contiguous_cell_and_shown():
    """``paged_over_contiguous``: the paged step over the same implementation's contiguous step (the gather's cost)."""
    from mha_rosetta.benchmarks.best_gap import paged_over_contiguous
    from mha_rosetta.benchmarks.decode_sweep import best_of_framework

    def cell(name, step_s, cache=None, context=4096):
        return dict(implementation=name, device="cpu", dtype="float32", context=context, window=None, step=1,
                    cache=cache, status="ok", step_s=step_s)  # fmt: skip

    cells = [
        cell("numpy", 2e-3), cell("numpy", 3e-3, "paged"), cell("torch", 1e-3, "paged"),
        cell("numpy", 5e-3, "paged", context=8192), cell("numpy-best", 1e-3),
    ]  # fmt: skip
    paged_over_contiguous(cells)
    best_of_framework(cells)
    assert [c.get("paged_over_contiguous") for c in cells] == [None, pytest.approx(1.5), None, None, None]
    assert cells[0]["over_best"] == 2.0 and "over_best" not in cells[1]  # a paged cell is not read against contiguous
    report = {"settings": decode_settings("decode").as_dict(), "cells": cells}
    assert "`numpy` 4096: 1.50x" in decode_markdown(report)


def test_a_backend_without_a_timed_paged_step_is_refused_without_a_child():
    name = register_path("decode_fake:FakePagedRunOnly")
    try:
        spec = DecodeCellSpec(implementation=name, context=64, cache="paged", **SMALL)
        assert parent_reason(spec) == f"{name}: the paged cache has no timed step yet (run_decode runs it)"
    finally:
        REGISTRY.pop(name, None)
    assert parent_reason(DecodeCellSpec(implementation="numpy", context=64, cache="paged", **SMALL)) is None


def test_a_windowed_cell_reads_the_ring_and_holds_it(fake):
    spec = DecodeCellSpec(implementation=fake, context=32768, window=4096, **{**SMALL, "kv_heads": 4, "d_k": 128})
    assert decode_config(spec).window == 4096
    enriched = enrich_decode_cell(decode_record(spec, {"status": "unsupported", "error": "not run"}), 10.0)
    assert enriched["kv_read_bytes"] == 4096 * 4 * 256 * 4  # the ring's W - 1 + 1 slots, not 32768
    assert enriched["limit_s"] == pytest.approx(4096 * 4 * 256 * 4 / 10e9)
    assert "limit_fraction" not in enriched  # nothing measured, nothing claimed


def test_a_decode_cell_in_a_fresh_child(fake):
    cpus = choose_cpus(1)
    plain = DecodeCellSpec(
        implementation=fake, context=300, cpus=cpus, policy=FAST, prefill_policy=FAST, plugins=[PLUGIN], **SMALL
    )
    windowed = DecodeCellSpec(
        implementation=fake, context=300, window=64, cpus=cpus, policy=FAST, prefill=False, plugins=[PLUGIN], **SMALL
    )
    for spec in (plain, windowed):
        record = run_decode_cell(spec, timeout=120)
        assert record["status"] == "ok", record.get("error") or record.get("stderr_tail")
        assert record["median_s"] > 0 and record["repeats"] == len(record["samples_s"]) >= 5
        assert len(record["paired_ratios"]) == record["repeats"]  # every sample paired with a reference
        assert record["cache_info"]["kind"] == "dynamic"
        assert record["affinity"] in (None, cpus)  # pinned to the chosen core where affinity exists
    assert record["cache_info"]["slots"] == ring_capacity(decode_config(windowed), 1) == 64  # O(W), not 300
    assert record["prefill_status"] == "skipped"


def test_the_prefill_is_the_decode_paths_forward(fake):
    spec = DecodeCellSpec(implementation=fake, context=64, policy=FAST, prefill_policy=FAST, plugins=[PLUGIN], **SMALL)
    record = run_decode_cell(spec, timeout=120)
    assert record["status"] == "ok", record.get("error")
    assert record["prefill_status"] == "ok" and record["prefill_median_s"] > 0 and record["prefill_repeats"] >= 5
    enriched = enrich_decode_cell(record, 10.0)
    assert enriched["prefill_over_step"] == pytest.approx(record["prefill_median_s"] / enriched["step_s"])


def test_an_unsupported_cell_says_why_without_a_child():
    name = register_path("decode_fake:FakeNoWindow")
    try:
        spec = DecodeCellSpec(implementation=name, context=100, window=8, **SMALL)
        assert "decode path does not implement window (it implements: none)" in parent_reason(spec)
        assert parent_reason(DecodeCellSpec(implementation=name, context=100, **SMALL)) is None
        static = DecodeCellSpec(implementation=name, context=100, cache="static", **SMALL)
        assert "has no 'static' cache (it has dynamic)" in parent_reason(static)
    finally:
        REGISTRY.pop(name, None)


def test_bad_cells_and_settings_name_the_argument():
    with pytest.raises(ValueError, match=r"DecodeCellSpec\.context must be a positive int, got 0"):
        DecodeCellSpec(implementation="numpy", context=0)
    with pytest.raises(ValueError, match=r"DecodeCellSpec\.window must be a positive int, got -4"):
        DecodeCellSpec(implementation="numpy", context=8, window=-4)
    with pytest.raises(ValueError, match="decode preset must be one of decode, decode-quick, got 'huge'"):
        decode_settings("huge")
    with pytest.raises(ValueError, match="contexts must name at least one context length"):
        decode_settings("decode-quick", contexts=[])


@requires("torch")  # the MLA row's cells are the installed backends' that decode MLA (numpy's and torch's here)
def test_the_presets_cells():
    settings = decode_settings("decode")
    assert settings.contexts == [1024, 2048, 4096, 8192, 16384, 32768]
    assert (settings.d_model, settings.heads, settings.kv_heads, settings.d_k) == (2048, 16, 4, 128)
    cells = expand_decode_cells(settings, ["numpy", "torch"])
    # the ragged row: 2 contexts x (rectangular, ragged) x 2 caches; the MLA row: naive and absorbed at 4 contexts
    assert len(cells) == 2 * (6 + 3 + 4 + 2 * 4 + 2 * 4)
    paged = [cell for cell in cells if cell.cache == "paged" and cell.row is None]  # 4k-32k, no prefill again
    assert [cell.context for cell in paged[:4]] == [4096, 8192, 16384, 32768] and not any(c.prefill for c in paged)
    assert all(cell.window is None for cell in paged) and {cell.cache for cell in cells} == {None, "paged"}
    windowed = [cell for cell in cells if cell.window is not None]
    assert {cell.context for cell in windowed} == {2048, 8192, 32768} and {cell.window for cell in windowed} == {4096}
    assert [cell.prefill for cell in cells[:6]] == [True, True, True, False, False, False]  # prefill_max 4096


def test_the_ragged_rows_cells_hold_the_rectangular_batchs_tokens():
    settings = decode_settings("decode")
    ragged = [cell for cell in expand_decode_cells(settings, ["numpy"]) if cell.row == "ragged"]
    shown = [(cell.batch, cell.context, cell.cache, cell.lengths, cell.width) for cell in ragged]
    assert shown == [
        (4, 2048, None, None, 2048), (4, 2048, None, [4096, 2048, 1024, 1024], 4096),
        (4, 2048, "paged", None, 2048), (4, 2048, "paged", [4096, 2048, 1024, 1024], 4096),
        (4, 8192, None, None, 8192), (4, 8192, None, [16384, 8192, 4096, 4096], 16384),
        (4, 8192, "paged", None, 8192), (4, 8192, "paged", [16384, 8192, 4096, 4096], 16384),
    ]  # fmt: skip
    assert all(cell.tokens == 4 * cell.context and not cell.prefill and cell.window is None for cell in ragged)
    assert len({cell.key() for cell in ragged}) == 8  # the rows' lengths are part of a cell's identity
    # A batch of the ragged row's size at a context the main row times: its main cell is the reference, not a copy.
    same = decode_settings(
        "decode",
        batch=4,
        contexts=[2048],
        window_contexts=[],
        paged_contexts=[],
        ragged_contexts=[2048],
        mla_contexts=[],
    )
    cells = expand_decode_cells(same, ["numpy"])
    assert [(c.context, c.cache, c.lengths, c.row) for c in cells] == [
        (2048, None, None, None), (2048, None, [4096, 2048, 1024, 1024], "ragged"),
        (2048, "paged", None, "ragged"), (2048, "paged", [4096, 2048, 1024, 1024], "ragged"),
    ]  # fmt: skip
    assert ragged_lengths(1001, [4, 2, 1, 1]) == [2003, 1001, 500, 500]  # 4004 tokens: the rounding's 1 to row 0
    with pytest.raises(ValueError, match=r"ragged_rows must be two or more positive ints .* got \[4\]"):
        decode_settings("decode", ragged_rows=[4])
    with pytest.raises(ValueError, match=r"DecodeCellSpec.lengths must hold batch=2 lengths summing to .* 64"):
        DecodeCellSpec(implementation="numpy", context=32, batch=2, lengths=[40, 20])


def test_a_ragged_cell_is_read_against_the_rectangular_batch_of_its_tokens_and_shown():
    from mha_rosetta.benchmarks.best_gap import paged_over_contiguous, ragged_over_rectangular
    from mha_rosetta.benchmarks.decode_sweep import best_of_framework

    def cell(name, step_s, cache=None, batch=4, lengths=None, row="ragged"):
        return dict(implementation=name, device="cpu", dtype="float32", context=2048, window=None, step=1,
                    cache=cache, batch=batch, lengths=lengths, row=row, status="ok", step_s=step_s)  # fmt: skip

    rows = [4096, 2048, 1024, 1024]
    cells = [
        cell("numpy", 1e-3, batch=1, row=None), cell("numpy", 4e-3), cell("numpy", 6e-3, lengths=rows),
        cell("numpy", 5e-3, "paged"), cell("numpy", 5.5e-3, "paged", lengths=rows), cell("numpy-best", 2e-3),
    ]  # fmt: skip
    ragged_over_rectangular(cells)
    paged_over_contiguous(cells)
    best_of_framework(cells)
    assert [c.get("ragged_over_rectangular") for c in cells] == [None, None, 1.5, None, pytest.approx(1.1), None]
    # Each ratio within the same batch and rows: never the B=1 cell, never the other rows.
    assert [c.get("paged_over_contiguous") for c in cells] == [None, None, None, 1.25, pytest.approx(5.5 / 6), None]
    assert cells[1]["over_best"] == 2.0 and "over_best" not in cells[0] and "over_best" not in cells[2]
    assert [row_label(c) for c in cells[1:5]] == [
        " (B=4 rectangular)", " (ragged 4096+2048+1024+1024)", " (paged) (B=4 rectangular)",
        " (paged) (ragged 4096+2048+1024+1024)",
    ]  # fmt: skip
    table = decode_markdown({"settings": decode_settings("decode").as_dict(), "cells": cells})
    assert "| `numpy` | paged (ragged 4096+2048+1024+1024) |" in table and "| `numpy` | (B=4 rectangular) |" in table
    assert "`numpy` (ragged 4096+2048+1024+1024) 2048: 1.50x" in table
    assert "`numpy` (paged) (ragged 4096+2048+1024+1024) 2048: 1.10x" in table


def test_a_backend_without_a_timed_ragged_step_is_refused_without_a_child(fake):
    rows = dict(batch=2, lengths=[96, 32])
    spec = DecodeCellSpec(implementation=fake, context=64, **rows, **SMALL)
    assert (
        parent_reason(spec) == f"{fake}: no timed step of a ragged batch (rows at different lengths, left padded) yet"
    )
    assert parent_reason(DecodeCellSpec(implementation="numpy", context=64, **rows, **SMALL)) is None


@pytest.mark.parametrize("cache", [None, "paged"])
def test_a_ragged_decode_cell_runs_in_a_fresh_child(cache):
    spec = DecodeCellSpec(
        implementation="numpy", context=64, batch=2, lengths=[96, 32], cache=cache, policy=FAST, prefill=False, **SMALL
    )
    record = run_decode_cell(spec, timeout=120)  # a smoke run of the path, not a figure
    assert record["status"] == "ok", record.get("error") or record.get("stderr_tail")
    assert record["lengths"] == [96, 32] and record["batch"] == 2 and record["context"] == 64
    info = record["cache_info"]
    if cache is None:
        assert info["slots"] >= 96  # the contiguous cache is as wide as the longest row (left padded)
    else:  # the pool: 7 pages of 16 for row 0's 96 tokens and the step, the null page for row 1's 64 pads, then 3
        # of its own; held once the context is written (the step's page in each row comes with the step): 6 + 1 + 2
        assert (info["pages"], info["pages_held"], info["pad_only_pages"]) == (7 + 1 + 3, 6 + 1 + 2, 4)
    enriched = enrich_decode_cell(record, 10.0)
    assert enriched["kv_read_bytes"] == kv_read_bytes(2, 64, 2, 16, 16, 4)  # the limit: the batch's real tokens


def test_the_estimate_counts_the_cells_that_can_run(fake):
    from mha_rosetta.benchmarks.decode_sweep import estimate_decode_seconds
    from mha_rosetta.benchmarks.progress import _startup_s, _timed_s

    settings = decode_settings("decode-quick", rounds=2)
    one = expand_decode_cells(settings, [fake])
    per_cell = _startup_s(fake) + _timed_s(settings.policy)
    prefills = sum(cell.prefill for cell in one) * _timed_s(settings.prefill_policy)
    bandwidth = _startup_s("numpy") + 2 * _timed_s(settings.bandwidth_policy)
    assert estimate_decode_seconds(settings, one) == pytest.approx(2 * (len(one) * per_cell + prefills + bandwidth))
    name = register_path("decode_fake:FakeNoWindow")
    try:  # a windowed cell of a backend without the window is not run, so it adds nothing
        skipped = [DecodeCellSpec(implementation=name, context=8, window=4, prefill=False, **SMALL)]
        assert estimate_decode_seconds(settings, skipped) == pytest.approx(2 * bandwidth)
    finally:
        REGISTRY.pop(name, None)


# -- the command ---------------------------------------------------------------------------------
def _main(argv):
    from mha_rosetta.cli.main import main

    return main(argv)


def test_bench_mode_decode_quick_end_to_end(fake, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    readme = tmp_path / "README.md"
    readme.write_text(f"# project\n\n{BEGIN}\nold figures\n{END}\n\nthe rest\n", encoding="utf-8")
    out = tmp_path / "decode.json"
    argv = ["bench", "--mode", "decode", "--quick", "--plugin", PLUGIN, "--backends", fake, "--no-progress"]
    code = _main([*argv, "--json", str(out), "--write-docs", str(docs)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads(out.read_text())
    assert report["kind"] == "decode" and report["complete"] is True
    assert not (tmp_path / "decode.json.partial.jsonl").exists()  # kept while it ran, removed once complete
    assert report["summary"] == {"cells": 4, "ok": 4, "unsupported": 0, "failed": 0}
    assert report["bandwidth"][0]["gbps"] > 0 and report["bandwidth"][0]["array_mb"] == 64
    for cell in report["cells"]:
        assert cell["bandwidth_gbps"] == report["bandwidth"][0]["gbps"]
        assert cell["limit_s"] == pytest.approx(cell["kv_read_bytes"] / (cell["bandwidth_gbps"] * 1e9))
        assert cell["limit_fraction"] == pytest.approx(cell["limit_s"] / cell["step_s"])
        # The published figure: the drift-corrected one (`correction.correct_cell`), which is the raw median where
        # the step's samples did not follow their references (beta 0: on a loaded machine the tiny quick steps can).
        assert cell["step_s"] == cell["corrected_median_s"] and 0.0 <= cell["reference_beta"] <= 1.0
        if cell["reference_beta"] == 0.0:
            assert cell["corrected_median_s"] == pytest.approx(cell["median_s"])
    windowed = [cell for cell in report["cells"] if cell["window"] == 128]
    assert sorted(cell["context"] for cell in windowed) == [256, 1024]
    assert {cell["cache_info"]["slots"] for cell in windowed} == {128}  # the ring holds W slots at 256 and 1024
    assert (docs / "bench" / "decode.json").exists()
    table = (docs / "bench" / "decode.md").read_text()
    assert table == printed.out and "| `fake-decode` | dynamic | 128 | 1024 |" in table
    text = readme.read_text()
    assert "old figures" not in text and text.endswith("\n\nthe rest\n") and "% of KV limit" in text
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (docs / "bench" / "decode" / "decode_step_vs_context.png").stat().st_size > 0
    # --render: the same table from the saved JSON, nothing measured
    assert _main(["bench", "--render", str(out)]) == 0
    assert capsys.readouterr().out == table


def test_bench_mode_decode_refuses_what_it_does_not_take(capsys):
    assert _main(["bench", "--mode", "decode", "--tokens", "64"]) == 2
    assert "--mode decode does not take --tokens (decode: --contexts)" in capsys.readouterr().err
    assert _main(["bench", "--mode", "decode", "--visits", "2"]) == 2
    assert "--mode decode does not take --visits" in capsys.readouterr().err
    assert _main(["bench", "--visits", "0"]) == 2
    assert "--visits must be a positive int, got 0" in capsys.readouterr().err
    assert _main(["bench", "--mode", "decode", "--dtypes", "float32,float64"]) == 2
    assert "--mode decode takes one value of --dtypes, got ['float32', 'float64']" in capsys.readouterr().err
    assert _main(["bench", "--mode", "decode", "--plugin", "nowhere_at_all:Nothing"]) == 2
    assert "nowhere_at_all" in capsys.readouterr().err


def test_the_markdown_and_readme_block_of_a_report_without_measurements():
    spec = DecodeCellSpec(implementation="numpy", context=1024, **SMALL)
    cell = enrich_decode_cell(
        decode_record(spec, {"status": "unsupported", "error": "numpy has no KV-cache decoding"}), 5.0
    )
    settings = decode_settings("decode-quick").as_dict()
    report = {
        "settings": settings,
        "bandwidth": [{"device": "cpu", "threads": 1, "gbps": 5.0, "library": "numpy"}],
        "cells": [cell],
    }
    table = decode_markdown(report)
    assert (
        "unsupported: numpy has no KV-cache decoding" in table and "Copy bandwidth cpu, 1 thread(s): 5.00 GB/s" in table
    )
    block = readme_block(report)
    assert block.startswith(BEGIN) and block.rstrip().endswith(END)
    assert "No implementation could decode in this run" in block


def test_the_in_cache_flag_reads_the_measured_cache_and_names_the_readers():
    # A step of 4 MiB KV + 40 MiB weights (1k context) fits a measured 64 MiB cache; sysfs's 300 MiB (the Xeon's)
    # would also flag the 8k step, which the measurement says reads past the cache. The read bandwidth line names
    # the fastest reader and every reader's figure.
    settings = decode_settings("decode").as_dict()
    cells = []
    for context in (1024, 8192):
        spec = DecodeCellSpec(implementation="numpy-best", context=context, d_model=2048, heads=16, kv_heads=4, d_k=128)
        record = decode_record(spec, {"status": "ok", "median_s": 0.01, "samples_s": [0.01]})
        cells.append(enrich_decode_cell(record, 20.0, llc_bytes=300 * 2**20, read_gbps=17.0,
                                        measured_llc_bytes=64 * 2**20))  # fmt: skip
    read = {"read": {"kernel": "np.max (float32)", "kernels": {"np.sum (float64)": 10.4, "np.max (float32)": 17.0}}}
    bandwidth = {"device": "cpu", "threads": 1, "gbps": 20.0, "library": "numpy", "read_gbps": 17.0,
                 "measured_llc_bytes": 64 * 2**20, "llc_bytes": 300 * 2**20, "read": read}  # fmt: skip
    table = decode_markdown({"settings": settings, "bandwidth": [bandwidth], "cells": cells})
    assert "fit in the last-level cache (64 MiB, as measured)" in table
    flagged = table.split("as measured): ")[1].splitlines()[0]
    assert "numpy-best 1024" in flagged and "8192" not in flagged
    assert "np.max (float32), the fastest of 2 readers: np.sum (float64) 10.40, np.max (float32) 17.00" in table


def test_contexts_set_the_full_and_the_windowed_row():
    from mha_rosetta.cli.bench_decode import decode_settings_of
    from mha_rosetta.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--mode", "decode", "--contexts", "512,2048", "--repeats", "9"])
    settings = decode_settings_of(args)
    assert settings.contexts == [512, 2048] and settings.window_contexts == [512, 2048]
    assert settings.paged_contexts == [512, 2048]  # the decode preset's paged row at the contexts given
    assert settings.ragged_contexts == [512, 2048]  # and its ragged row
    assert settings.policy["min_repeats"] == 9 and settings.window == 4096 and settings.preset == "decode"
    quick = decode_settings_of(build_parser().parse_args(["bench", "--mode", "decode", "--quick"]))
    assert quick.preset == "decode-quick" and quick.window_contexts == [256, 1024]


def test_a_step_past_the_measured_cache_but_faster_than_memory_is_named():
    # The 8k step reads 32 MiB of K and V + 40 MiB of weights = 75,497,472 B, past a measured 64 MiB cache; at
    # 17 GB/s its limit is 4.441 ms, so a 3 ms step ran at 148% of it: some of its bytes came from a cache (sysfs's
    # 300 MiB), and the table says so. The 1k step (44 MiB) fits the measured cache: the first flag names it.
    settings = decode_settings("decode").as_dict()
    cells = []
    for context, median in ((1024, 0.001), (8192, 0.003), (32768, 0.02)):
        spec = DecodeCellSpec(implementation="numpy-best", context=context, d_model=2048, heads=16, kv_heads=4, d_k=128)
        record = decode_record(spec, {"status": "ok", "median_s": median, "samples_s": [median]})
        cells.append(enrich_decode_cell(record, 20.0, llc_bytes=300 * 2**20, read_gbps=17.0,
                                        measured_llc_bytes=64 * 2**20))  # fmt: skip
    assert abs(cells[1]["read_limit_fraction"] - 75_497_472 / 17e9 / 0.003) < 1e-9  # 1.48
    bandwidth = {"device": "cpu", "threads": 1, "gbps": 20.0, "library": "numpy", "read_gbps": 17.0,
                 "measured_llc_bytes": 64 * 2**20, "llc_bytes": 300 * 2**20}  # fmt: skip
    table = decode_markdown({"settings": settings, "bandwidth": [bandwidth], "cells": cells})
    faster = table.split("yet ran faster than memory can feed them")[1].splitlines()[0]
    assert "(sysfs reports 300 MiB)" in faster and faster.endswith("memory: numpy-best 8192")  # not 1k, not 32k (52%)


def test_rows_leave_out_the_optional_rows_and_refuse_unknown_names():
    from mha_rosetta.cli.bench_decode import decode_settings_of
    from mha_rosetta.cli.main import build_parser

    parse = lambda *extra: build_parser().parse_args(["bench", "--mode", "decode", "--contexts", "512,2048", *extra])  # noqa: E731
    settings = decode_settings_of(parse("--rows", "main,window"))
    assert settings.contexts == [512, 2048] and settings.window_contexts == [512, 2048]
    assert settings.paged_contexts == [] and settings.ragged_contexts == [] and settings.mla_contexts == []
    cells = expand_decode_cells(settings, ["numpy"])
    assert len(cells) == 4  # 2 main + 2 windowed: no paged, ragged or MLA cell
    assert {(cell.window, cell.context) for cell in cells} == {(None, 512), (None, 2048), (4096, 512), (4096, 2048)}
    only_main = decode_settings_of(parse("--rows", "main"))
    assert only_main.window_contexts == [] and len(expand_decode_cells(only_main, ["numpy"])) == 2
    with pytest.raises(
        ValueError, match="--rows takes names among main, window, paged, ragged, mla, main among them; got window"
    ):
        decode_settings_of(parse("--rows", "window"))  # the main row is every other row's reference
    with pytest.raises(ValueError, match="got main,pages"):
        decode_settings_of(parse("--rows", "main,pages"))


def test_decode_only_options_are_refused_in_the_forward_mode(capsys):
    from mha_rosetta.cli.main import main

    assert main(["bench", "--rows", "main", "--list"]) == 2
    assert "--rows is for --mode decode, got --mode fwd" in capsys.readouterr().err


def test_a_prefill_that_compiles_in_its_timed_runs_is_flagged(monkeypatch):
    from mha_rosetta.benchmarks.decode import compiled_count

    assert compiled_count({"prefill": 1, "step": 0}) == 1 and compiled_count(3) == 3
    assert compiled_count(None) == 0 and compiled_count(True) == 0 and compiled_count({"a": {"b": 2}}) == 2
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    name = register_path("decode_fake:FakeRecompiles")
    try:
        spec = DecodeCellSpec(
            implementation=name, context=32, policy=FAST, prefill_policy=FAST, plugins=["decode_fake:FakeRecompiles"],
            **SMALL,
        )  # fmt: skip
        record = run_decode_cell(spec, timeout=120)
        assert record["status"] == "ok", record.get("error")
        assert record["prefill_compilations"] == {"prefill": 1, "step": 0}
        assert any("its time includes compilation" in warning for warning in record["warnings"])
    finally:
        REGISTRY.pop(name, None)


# -- resume (fake runners: no processes) ----------------------------------------------------------
class FakeDecodeRunners:
    """A cell runner whose step takes 1 ms x the context / 256 and a bandwidth of 10 GB/s; the first visit of each
    cell in ``fail`` fails; after ``stop_after`` cells it raises KeyboardInterrupt (Ctrl-C). It records every cell
    it was asked to run."""

    def __init__(self, stop_after: int | None = None, fail: set | None = None) -> None:
        self.stop_after, self.fail, self.ran, self.bandwidths = stop_after, fail or set(), [], 0

    def cell(self, spec: DecodeCellSpec, timeout: float) -> dict:
        if self.stop_after is not None and len(self.ran) >= self.stop_after:
            raise KeyboardInterrupt
        self.ran.append((spec.context, spec.window))
        if (spec.context, spec.window) in self.fail:  # fails its first visit only
            self.fail.discard((spec.context, spec.window))
            return decode_record(spec, {"status": "error", "error": "a crash"})
        median = 1e-3 * spec.context / 256
        return decode_record(spec, {"status": "ok", "median_s": median, "iqr_s": 0.0, "samples_s": [median] * 3})

    def bandwidth(self, device, threads, cpus, **options) -> dict:
        self.bandwidths += 1
        return {"device": device, "threads": threads, "gbps": 10.0, "library": "numpy", "malloc": options["malloc"]}


def _sweep(runners, partial, resume=False, seed=None):
    from mha_rosetta.benchmarks.decode_sweep import run_decode_sweep

    settings = decode_settings(  # the main and windowed rows (the MLA row's numpy cells left out)
        "decode-quick", implementations=["numpy"], rounds=2, seed=seed, mla_contexts=[], **SMALL
    )
    return run_decode_sweep(
        settings, ["numpy"], progress=False, cell_runner=runners.cell, bandwidth_runner=runners.bandwidth,
        partial_path=partial, resume=resume,
    )  # fmt: skip


def test_an_interrupted_decode_sweep_resumes_with_its_seed_and_runs_only_the_rest(tmp_path):
    from mha_rosetta.benchmarks.decode_sweep import load_decode_partial

    partial = tmp_path / "decode.partial.jsonl"
    first = FakeDecodeRunners(stop_after=5, fail={(1024, None)})  # 4 cells a round (256, 1024; W=128 at both)
    interrupted = _sweep(first, partial)
    assert interrupted["complete"] is False and len(first.ran) == 5 and first.bandwidths == 2
    kept, bandwidths = load_decode_partial(partial)
    assert len(kept) == 5 and sorted(bandwidths) == [(0, "cpu"), (1, "cpu")]
    second = FakeDecodeRunners()
    resumed = _sweep(second, partial, resume=True)
    assert resumed["complete"] is True and resumed["rounds"]["seed"] == interrupted["rounds"]["seed"]
    assert resumed["rounds"]["orders"] == interrupted["rounds"]["orders"]  # the same shuffled orders
    # 8 visits in all (whatever the drawn order): 4 kept as measured; the failed one (context 1024, round 1) and
    # the 3 never reached run now
    assert len(second.ran) == 4 and (1024, None) in second.ran and second.bandwidths == 0
    assert resumed["settings"]["resumed_cells"] == 4
    assert resumed["summary"] == {"cells": 4, "ok": 4, "unsupported": 0, "failed": 0}
    by_context = {(cell["context"], cell["window"]): cell for cell in resumed["cells"]}
    assert by_context[(1024, None)]["round_medians_s"] == [pytest.approx(4e-3)] * 2
    # the limit: 1 x 1024 slots x 2 kv heads x (16 + 16) x 4 bytes over 10 GB/s = 26.2144 us, over 4 ms
    assert by_context[(1024, None)]["limit_fraction"] == pytest.approx(262144 / 10e9 / 4e-3)


def test_a_decode_resume_refuses_a_forward_file_and_another_machines(tmp_path, capsys):
    from mha_rosetta.benchmarks.decode_sweep import check_decode_partial
    from mha_rosetta.benchmarks.partial import append_entry
    from mha_rosetta.benchmarks.provenance import host_id, machine_key

    forward = tmp_path / "forward.partial.jsonl"
    append_entry(forward, {"type": "header", "schema": 1, "settings": {"seed": 3}})
    with pytest.raises(ValueError, match="holds a forward sweep's finished cells, not a decode sweep's"):
        check_decode_partial(forward)
    assert _main(["bench", "--mode", "decode", "--resume", "--partial", str(forward)]) == 2
    assert "holds a forward sweep's finished cells" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere.partial.jsonl"
    append_entry(elsewhere, {"type": "header", "schema": 1, "kind": "decode", "host_id": "0" * 16, "settings": {}})
    with pytest.raises(ValueError, match="was written on another machine"):
        check_decode_partial(elsewhere)  # a header from before the machine was recorded: its host id
    same_id = tmp_path / "same-id.partial.jsonl"  # one host id, another CPU: cloned /etc/machine-id
    cores = machine_key()["cores"]
    other_cpu = {**machine_key(), "host_id": host_id(), "cores": cores + 1}
    append_entry(same_id, {"type": "header", "schema": 1, "kind": "decode", "machine": other_cpu, "settings": {}})
    with pytest.raises(ValueError, match=rf"another machine .*cores {cores + 1} against {cores}"):
        check_decode_partial(same_id)
    decode = tmp_path / "decode.partial.jsonl"
    _sweep(FakeDecodeRunners(stop_after=1), decode)
    assert check_decode_partial(decode)["kind"] == "decode"
    assert _main(["bench", "--resume", "--partial", str(decode), "--quick"]) == 2  # a forward sweep refuses it
    assert "holds a decode sweep's finished cells, not a forward sweep's" in capsys.readouterr().err


def test_the_preset_layer_has_no_biases_and_a_schema_1_file_had_them(tmp_path):
    """The decode layer is Llama's (no biases; MHAConfig.bias reaches every cell); a schema-1 file, whose cells
    do not say, is read as the biased layer it timed, so a baseline never pairs the two layers."""
    from mha_rosetta.benchmarks.report import load_report
    from mha_rosetta.benchmarks.verdict import comparison_key
    from mha_rosetta.report.compare import decode_shape_label

    settings = decode_settings("decode")
    cells = expand_decode_cells(settings, ["numpy"])
    assert settings.bias is False and {cell.bias for cell in cells} == {False}
    assert decode_config(cells[0]).bias is False and decode_config(cells[0]).output_bias is False
    assert decode_config(DecodeCellSpec(implementation="numpy", context=8, bias=True)).bias is True
    record = {**cells[0].identity(), "mode": "decode", "status": "ok"}
    old = {key: value for key, value in record.items() if key != "bias"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": 1, "kind": "decode", "cells": [old]}))
    loaded = load_report(path)["cells"][0]
    assert loaded["bias"] is True
    assert comparison_key(loaded) != comparison_key(record)
    assert decode_shape_label(loaded) == decode_shape_label(record) + " bias"
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"schema": 2, "kind": "decode", "cells": [old]}))
    assert "bias" not in load_report(new)["cells"][0]  # only schema 1 is filled in
