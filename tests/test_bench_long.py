"""The long preset's memory predictions, budget, fitted slopes, target ratios and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import requires
from mha_rosetta.benchmarks.long import (
    fit_slope,
    fitted_slopes,
    is_memory_linear,
    memory_budget_mb,
    memory_kind,
    over_budget_reason,
    plot_long,
    predicted_peak_mb,
    target_ratios,
)

REPO = Path(__file__).resolve().parent.parent


def test_slopes_of_exact_powers():
    tokens = [1024, 2048, 4096, 8192]
    assert fit_slope(tokens, [3e-9 * n**2 for n in tokens]) == pytest.approx(2.0)
    assert fit_slope(tokens, [5.0 * n for n in tokens]) == pytest.approx(1.0)
    assert fit_slope([1024], [1.0]) is None  # one point has no slope


def test_memory_linear_implementations():
    assert is_memory_linear("numpy:chunked") and is_memory_linear("jax:chunked") and is_memory_linear("torch-sdpa")
    assert not is_memory_linear("numpy") and not is_memory_linear("torch-mha") and not is_memory_linear("torch:slicing")
    # nn.MultiheadAttention: batch_first=False goes through SDPA's flash loop, batch_first=True's fast path does not.
    assert is_memory_linear("torch-mha-seqfirst")
    assert memory_kind("numpy:per_head") == memory_kind("numpy:slicing") == "one head at a time"
    assert memory_kind("torch:per_head") == memory_kind("torch-mha") == "materialising"


def test_the_declared_kinds_agree_with_the_committed_long_run():
    """Each implementation's memory kind against its measured tail slope in docs/bench/long."""
    report = REPO / "docs" / "bench" / "long" / "long.json"  # committed: `bench --preset long` on a quiet machine
    slopes = fitted_slopes(json.loads(report.read_text(encoding="utf-8"))["cells"])
    assert len(slopes) >= 19
    for name, slope in slopes.items():
        tail = slope["memory_tail_slope"]
        if slope["memory_kind"] == "memory-linear":
            assert tail < 1.1, (name, tail)  # linear, flattened by a constant part at the small sizes
        else:
            assert tail > 1.4, (name, tail)  # quadratic, plus linear terms at the small sizes


def test_predictions_and_the_budget():
    # B=1, H=8, D=512 at 8k tokens, float32: 3 copies of the (1, 8, 8192, 8192) scores are 6 GiB.
    material = predicted_peak_mb("numpy", 1, 8192, 512, 8, "float32")
    assert material == pytest.approx(3 * 8 * 8192**2 * 4 / 2**20 + 16 * 8192 * 512 * 4 / 2**20)
    chunked = predicted_peak_mb("numpy:chunked", 1, 8192, 512, 8, "float32")
    assert chunked == pytest.approx(16 * 8192 * 512 * 4 / 2**20)  # 256 MiB: linear only
    assert over_budget_reason("numpy:chunked", 1, 32768, 512, 8, "float32", 4096) is None
    # One head's scores at a time: 1/H of the quadratic part.
    one_head = predicted_peak_mb("numpy:per_head", 1, 8192, 512, 8, "float32")
    assert one_head == pytest.approx(3 * 8192**2 * 4 / 2**20 + 16 * 8192 * 512 * 4 / 2**20)
    reason = over_budget_reason("numpy", 1, 16384, 512, 8, "float32", 4096)
    assert (
        reason.startswith("skipped: predicted peak 25,088 MiB (3 copies")
        and "exceeds the memory budget of 4,096 MiB" in reason
    )
    assert memory_budget_mb(1234) == 1234.0
    with pytest.raises(ValueError, match="memory budget must be a positive number of MiB, got 0"):
        memory_budget_mb(0)


def _cells():
    cells = []
    for n in (1024, 2048, 4096, 8192):
        cells.append({"implementation": "numpy", "tokens": n, "status": "ok", "median_s": 1e-9 * n**2,
                      "peak_mem_mb": 4e-5 * n**2})  # fmt: skip
        cells.append({"implementation": "numpy:chunked", "tokens": n, "status": "ok", "median_s": 1.1e-9 * n**2,
                      "peak_mem_mb": 0.01 * n})  # fmt: skip
        cells.append({"implementation": "torch-sdpa", "tokens": n, "status": "ok", "median_s": 1e-9 * n**2,
                      "peak_mem_mb": 0.02 * n})  # fmt: skip
    cells.append({"implementation": "numpy", "tokens": 16384, "status": "skipped"})
    return cells


def test_fitted_slopes_and_targets():
    slopes = fitted_slopes(_cells())
    assert slopes["numpy"]["memory_slope"] == pytest.approx(2.0)
    assert slopes["numpy:chunked"]["memory_slope"] == pytest.approx(1.0)
    assert slopes["numpy:chunked"]["memory_tail_slope"] == pytest.approx(1.0)
    assert slopes["numpy"]["time_tail_slope"] is not None
    assert slopes["numpy"]["tokens"] == [1024, 2048, 4096, 8192]  # the skipped cell does not count
    targets = target_ratios(_cells())
    assert targets["memory_8k"]["ratio"] == pytest.approx(0.01 * 8192 / (4e-5 * 8192**2))
    assert targets["memory_8k"]["met"] is True
    assert targets["time_4k"]["ratio"] == pytest.approx(1.1) and targets["time_4k"]["met"] is True


def test_tail_slopes_see_past_a_constant_part():
    # 60 MiB of caches plus 0.01 MiB per token: flat at first, linear at the end.
    cells = [{"implementation": "jax:chunked", "tokens": n, "status": "ok", "median_s": 1e-6 * n,
              "peak_mem_mb": 60 + 0.01 * n} for n in (1024, 2048, 4096, 8192, 16384, 32768)]  # fmt: skip
    (slope,) = fitted_slopes(cells).values()
    # Over three sizes evenly spaced in log2, the least-squares slope is the end points' slope.
    assert slope["memory_tail_slope"] == pytest.approx(math.log2((60 + 327.68) / (60 + 81.92)) / 2)  # 0.72
    assert slope["memory_slope"] < 0.5 < slope["memory_tail_slope"] < 1  # the constant flattens the early sizes
    assert slope["time_tail_slope"] == pytest.approx(1.0)


@requires("matplotlib")
def test_long_plots(tmp_path):
    paths = plot_long(_cells(), tmp_path)
    assert [p.name for p in paths] == ["long_time_vs_tokens.png", "long_memory_vs_tokens.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_the_sweep_skips_cells_over_the_budget_and_never_runs_them(tmp_path):
    from mha_rosetta.benchmarks.sweep import preset_settings, run_sweep

    ran = []

    def cell(spec, timeout):
        ran.append((spec.implementation, spec.tokens))
        return {**spec.identity(), "status": "ok", "median_s": 1e-3, "samples_s": [1e-3] * 3, "gflops": 1.0}

    def gemm(dtype, device, threads, cpus, **options):
        return {"device": device, "dtype": dtype, "threads": threads, "n": options["n"], "gflops": 10.0,
                "library": "numpy", "malloc": options["malloc"]}  # fmt: skip

    settings = preset_settings(
        "long", implementations=["numpy", "numpy:chunked"], tokens=[1024, 32768], memory_budget_mb=2048.0, seed=1
    )
    outcome = run_sweep(settings, partial_path=tmp_path / "p.jsonl", progress=False, cell_runner=cell,
                        gemm_runner=gemm, implementations=settings.implementations)  # fmt: skip
    assert sorted(ran) == [("numpy", 1024), ("numpy:chunked", 1024), ("numpy:chunked", 32768)]
    [skipped] = [c for c in outcome.cells if c["implementation"] == "numpy" and c["tokens"] == 32768]
    assert skipped["status"] == "unsupported"
    assert (
        skipped["error"].startswith("skipped: predicted peak 99,328 MiB") and "budget of 2,048 MiB" in skipped["error"]
    )


def test_long_preset_and_the_dist_group():
    from mha_rosetta.backends import available_backends
    from mha_rosetta.benchmarks.plan import resolve_implementations
    from mha_rosetta.benchmarks.sweep import preset_settings

    settings = preset_settings("long")
    assert (settings.batch, settings.heads, settings.d_model) == ([1], [8], [512])
    assert settings.tokens == [1024, 2048, 4096, 8192, 16384, 32768]
    everything = resolve_implementations(["all"])
    assert "numpy:chunked" in everything
    sharded = [name for name in ("jax-sharded", "torch-tp") if name in available_backends()]
    assert not set(sharded) & set(everything)  # worker processes: not in main/all ...
    dist = resolve_implementations(["dist"])
    assert all(any(label.startswith(name) for label in dist) for name in sharded)  # ... but in "dist"


def test_the_table_states_each_target_with_its_ratio():
    from mha_rosetta.benchmarks.long import long_markdown

    text = long_markdown(_cells())
    assert "| `numpy:chunked` | memory-linear | 1024..8192 | 2.00 | 2.00 | 1.00 | 1.00 |" in text
    assert "chunked 82 MiB (worst) against 2684 MiB (best materialising): ratio 0.0305, target <= 0.1: met" in text
    assert "numpy:chunked 18.5 ms against torch SDPA 16.8 ms (one core): ratio 1.1, target <= 1.25: met" in text
