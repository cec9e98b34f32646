"""The benchmark harness's logic: FLOP counts, pinning, statistics, report, baseline, resume.

No timing assertions: timings live in the benchmark output. The only measured runs here
are tiny cells in fresh processes, checked for what the harness must guarantee (a result
comes back, the child was pinned to the core it was given, a broken cell is a record).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import python_stdout, requires
from mha_rosetta.benchmarks import pinning
from mha_rosetta.benchmarks.baseline import baseline_markdown, compare_to_baseline
from mha_rosetta.benchmarks.cell import CellSpec, cell_key, jsonable, run_cell, split_implementation
from mha_rosetta.benchmarks.flops import attention_matmul_flops, config_matmul_flops, gemm_flops
from mha_rosetta.benchmarks.fresh import RESULT_MARKER, parse_result
from mha_rosetta.benchmarks.markdown import markdown_table, status_text
from mha_rosetta.benchmarks.partial import load_partial
from mha_rosetta.benchmarks.questions import (
    CONFIRMED,
    PARTLY,
    REFUTED,
    answer_question,
    run_speed_questions,
    verdict_einsum,
    verdict_heads,
    verdict_linear_layout,
    verdict_merge_copy,
)
from mha_rosetta.benchmarks.report import SCHEMA_VERSION, assemble_report, machine_info, primary_peak
from mha_rosetta.benchmarks.sweep import SweepSettings, run_sweep
from mha_rosetta.benchmarks.timing import (
    RepeatPolicy,
    cold_median_s,
    fixed_median_s,
    memory_flush,
    minor_page_faults,
    summarize,
    time_repeats,
)
from mha_rosetta.core import MHAConfig
from mha_rosetta.core.files import write_text_atomic

# -- FLOP counts, by hand ---------------------------------------------------------------------


def test_self_attention_flops_hand_computed():
    # B=2, N=7, D=15, H=3 (d_k=5): 8*B*N*D^2 + 4*B*N^2*D = 8*2*7*15^2 + 4*2*7^2*15 = 25200 + 5880
    cfg = MHAConfig(d_model=15, n_heads=3)
    assert config_matmul_flops(cfg, batch=2, q_tokens=7) == 31080


def test_cross_attention_gqa_flops_hand_computed():
    # B=2, Nq=7, Nk=5, D=15, H=3, Hkv=1, Dk=5, Dv=4, kdim=6, vdim=8
    # projections: q 7*15*3*5=1575, k 5*6*1*5=150, v 5*8*1*4=160, out 7*3*4*15=1260 -> 3145, x 2B = 12580
    # attention: H*Nq*Nk*(Dk+Dv) = 3*7*5*9 = 945, x 2B = 3780
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=5, d_v=4, n_kv_heads=1, kdim=6, vdim=8)
    assert config_matmul_flops(cfg, batch=2, q_tokens=7, kv_tokens=5) == 16360
    assert (
        attention_matmul_flops(
            batch=2, q_tokens=7, kv_tokens=5, d_model=15, heads=3, kv_heads=1, d_k=5, d_v=4, kdim=6, vdim=8
        )
        == 16360
    )


def test_flops_reject_bad_sizes():
    with pytest.raises(ValueError, match="tokens"):
        attention_matmul_flops(
            batch=2, q_tokens=0, kv_tokens=5, d_model=15, heads=3, kv_heads=3, d_k=5, d_v=5, kdim=15, vdim=15
        )
    assert gemm_flops(4, 5, 6) == 240
    with pytest.raises(ValueError, match="m must be"):
        gemm_flops(0, 5, 6)


# -- pinning ----------------------------------------------------------------------------------


def test_a_backends_info_travels_as_json_with_only_what_json_refuses_as_text():
    # A cell's backend_info (forward and decode: `cell.jsonable`): JSON values kept as they are, at any depth.
    info = {"layout": "rows", "slots": 3, "nested": {"n": 2, "scale": complex(1, 2)}, 7: [1, 2]}
    assert jsonable(info) == {"layout": "rows", "slots": 3, "nested": {"n": 2, "scale": "(1+2j)"}, "7": [1, 2]}
    assert jsonable({"n": 1}) == {"n": 1} and jsonable({1, 2}) == "{1, 2}"
    json.dumps(jsonable(info))  # and it is JSON


def test_a_rows_status_says_the_error_table_safe_or_the_warning():
    # The forward and decode tables' status column (`markdown.status_text`): ": error" cut at the limit, 10 here.
    assert status_text({"status": "error", "error": "a|b\nc" + "x" * 50}, 10) == "error: a/b cxxx"
    assert status_text({"error": "e"}, 10) == ": e"  # a record without a status is not ok
    assert status_text({"status": "ok", "error": "ignored"}, 10) == "ok"
    assert status_text({"status": "ok", "warnings": ["w"]}, 10) == "ok (!)"
    assert status_text({"status": "ok", "warnings": ["w"], "drift": 0.3}, 10) == "ok (drift)"


def test_thread_env_sets_every_knob_and_keeps_other_variables():
    base = {
        "OPENBLAS_CORETYPE": "Haswell",
        "XLA_FLAGS": "--xla_dump_to=/tmp/x intra_op_parallelism_threads=4",
        "PATH": "/bin",
        "JAX_PLATFORMS": "cuda",
    }
    env = pinning.thread_env(2, base_env=base)
    for name in pinning.THREAD_ENV_VARS:
        assert env[name] == "2", name
    assert env["PJRT_NPROC"] == "2"  # the variable XLA:CPU sizes its intra-op pool from
    assert env["OPENBLAS_CORETYPE"] == "Haswell"  # not a thread count: passed through untouched
    assert env["PATH"] == "/bin"
    # The TensorFlow-era token is not an XLA flag (XLA aborts when it comes first): removed, never written.
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert env["JAX_PLATFORMS"] == "cuda"  # no device named: left alone
    assert base["XLA_FLAGS"] == "--xla_dump_to=/tmp/x intra_op_parallelism_threads=4"  # the input is not modified
    assert "XLA_FLAGS" not in pinning.thread_env(2, base_env={})  # nothing of the user's, nothing needed
    # A CPU cell keeps JAX off the GPU (its CUDA client would take GPU memory and the pinned core).
    assert pinning.thread_env(1, base_env=base, device="cpu")["JAX_PLATFORMS"] == "cpu"
    assert pinning.thread_env(1, base_env=base, device="gpu")["JAX_PLATFORMS"] == "cuda"
    assert pinning.device_env("cpu") == {"JAX_PLATFORMS": "cpu"} and pinning.device_env("gpu") == {}


def test_xla_flags_for_one_thread_switch_eigen_off_once():
    flags = pinning.xla_flags(1, "--xla_cpu_multi_thread_eigen=true --xla_foo=1")
    assert flags.split() == ["--xla_foo=1", "--xla_cpu_multi_thread_eigen=false"]
    assert pinning.xla_flags(2, "--xla_cpu_multi_thread_eigen=false") == ""  # XLA's default (true) for 2
    stale = pinning.xla_flags(1, "intra_op_parallelism_threads=1 --xla_foo=1")
    assert stale == "--xla_foo=1 --xla_cpu_multi_thread_eigen=false"
    with pytest.raises(ValueError, match="threads must be a positive int, got 0"):
        pinning.thread_env(0, base_env={})


@requires("jax")
def test_xla_parses_the_flags_of_every_thread_count():
    # XLA aborts at start-up on a flag it does not know or an unprefixed first token: a child
    # with exactly the environment a cell gets must start JAX and compute.
    code = "import jax.numpy as jnp; print(float(jnp.ones((4, 4)).sum()))"
    for threads in (1, 2):
        env = pinning.thread_env(threads, device="cpu")
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "16.0"


def test_malloc_env_keep_raises_both_glibc_thresholds_and_default_adds_nothing():
    assert pinning.malloc_env("keep") == {
        "MALLOC_MMAP_THRESHOLD_": "4294967296",
        "MALLOC_TRIM_THRESHOLD_": "4294967296",
        "MALLOC_ARENA_MAX": "1",
    }
    assert pinning.malloc_env() == pinning.malloc_env("keep")  # keep is the default
    assert pinning.malloc_env("default") == {}
    with pytest.raises(ValueError, match="malloc must be one of keep, default, got 'fast'"):
        pinning.malloc_env("fast")
    with pytest.raises(ValueError, match="malloc must be one of keep, default"):
        CellSpec(implementation="numpy", malloc="fast")
    with pytest.raises(ValueError, match="malloc must be one of keep, default"):
        SweepSettings(malloc="none")


def test_choose_cpus():
    assert pinning.choose_cpus(2, allowed=[0, 1, 2, 3]) == [2, 3]
    assert pinning.choose_cpus(1, requested=[0], allowed=[0, 1]) == [0]
    with pytest.raises(ValueError, match="threads=5 is more than the 4 cores"):
        pinning.choose_cpus(5, allowed=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"cpus \[7\] are not available"):
        pinning.choose_cpus(1, requested=[7], allowed=[0, 1])
    with pytest.raises(ValueError, match="names 2 cores"):
        pinning.choose_cpus(1, requested=[0, 1], allowed=[0, 1])


def test_cpu_use_warnings():
    assert pinning.cpu_utilisation(3.0, 2.0) == 1.5
    assert pinning.cpu_utilisation(1.0, 0.0) is None
    assert "used 1.60 cores" in pinning.cpu_use_warning(1.6, 1)
    assert pinning.cpu_use_warning(1.2, 1) is None  # within threads + 0.25
    assert pinning.cpu_use_warning(2.2, 2) is None
    assert "only 0.50 of its core" in pinning.contention_warning(0.5, 1)
    assert pinning.contention_warning(0.95, 1) is None
    assert pinning.contention_warning(0.5, 2) is None  # idle workers make a low ratio normal


# -- statistics and the repeat loop ----------------------------------------------------------


def test_summarize_hand_computed():
    summary = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert summary["median_s"] == 3.0
    assert summary["iqr_s"] == 2.0  # q75 = 4, q25 = 2 (linear interpolation, NumPy's default)
    assert summary["min_s"] == 1.0
    assert summary["repeats"] == 5


class FakeClock:
    """A clock that moves only when the timed function runs: step sizes are chosen by the test."""

    def __init__(self, steps):
        self.now, self.steps, self.calls = 0.0, list(steps), 0

    def __call__(self):
        return self.now

    def run_once(self):
        self.now += self.steps[self.calls % len(self.steps)]
        self.calls += 1


def test_time_repeats_stops_when_minimums_met_and_stable():
    clock = FakeClock([0.1])
    result = time_repeats(
        clock.run_once, RepeatPolicy(min_time=0.35, min_repeats=2, max_time=10), clock=clock, cpu_clock=clock
    )
    assert result["repeats"] == 4  # 0.4 s timed >= 0.35 and 4 samples are enough to judge the spread
    assert result["median_s"] == pytest.approx(0.1)
    assert result["stable"] is True


def test_time_repeats_caps_at_max_repeats_and_max_time():
    clock = FakeClock([0.1])
    capped = time_repeats(
        clock.run_once,
        RepeatPolicy(min_time=100, min_repeats=1, max_repeats=7, max_time=1000),
        clock=clock,
        cpu_clock=clock,
    )
    assert capped["repeats"] == 7
    noisy = FakeClock([0.1, 0.3])  # IQR / median stays large: gives up at max_time
    result = time_repeats(
        noisy.run_once, RepeatPolicy(min_time=0.5, min_repeats=3, max_time=2.0), clock=noisy, cpu_clock=noisy
    )
    assert result["stable"] is False
    assert result["timed_total_s"] == pytest.approx(2.0)  # 10 samples of 0.1/0.3 alternating


def test_the_cpu_reference_product_runs_on_one_blas_thread_and_gives_the_cells_theirs_back(monkeypatch):
    """Issue 43: a two-thread reference woke OpenBLAS's worker between a cell's samples, and its spin slowed the
    next torch sample 3x. The reference runs with one BLAS thread; the cell's own limit holds around it."""
    threadpoolctl = pytest.importorskip(
        "threadpoolctl", reason="threadpoolctl is not installed: pip install 'mha-rosetta[bench]'"
    )
    from mha_rosetta.benchmarks import gemm

    def blas_threads() -> list[int]:
        return [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]

    if not blas_threads():
        pytest.skip("no BLAS library that threadpoolctl can see is loaded")
    seen: list[list[int]] = []
    program = (lambda: seen.append(blas_threads()), lambda: None, {"numpy": "test"})
    monkeypatch.setattr(gemm, "_product", lambda library, n, dtype, device: program)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        run_once, workload = gemm.reference_product("cpu", ("torch",))
        run_once()
        after = blas_threads()
    assert seen == [[1] * len(after)] and after == [2] * len(after)
    assert workload["blas_threads"] == 1 and workload["library"] == "numpy" and workload["n"] == 512


def test_fixed_median_s_times_exactly_the_asked_calls_after_the_warm_up():
    """The cost scripts' loop: one untimed call (its 100 s never counts), then exactly ``repeats`` samples."""
    odd = FakeClock([100.0, 5.0, 1.0, 3.0, 2.0, 4.0])
    assert fixed_median_s(odd.run_once, 5, clock=odd) == 3.0  # sorted 1 2 3 4 5
    assert odd.calls == 6
    even = FakeClock([100.0, 1.0, 2.0, 3.0, 10.0])
    assert fixed_median_s(even.run_once, 4, clock=even) == 2.5  # (2 + 3) / 2, as np.median
    assert even.calls == 5
    twice = FakeClock([50.0, 50.0, 7.0])
    assert fixed_median_s(twice.run_once, 1, warmup=2, clock=twice) == 7.0
    assert twice.calls == 3


def test_cold_median_s_flushes_before_every_timed_call_and_never_times_the_flush():
    """The cost scripts' cold loop: warm-up, then flush, call, flush, call, ...; the flushes' 1000 s never count."""
    clock = FakeClock([100.0, 5.0, 1.0, 3.0])
    order = []

    def flush():
        order.append("flush")
        clock.now += 1000.0  # a slow flush: outside every sample

    def run_once():
        order.append("call")
        clock.run_once()

    assert cold_median_s(run_once, 3, flush, clock=clock) == 3.0  # sorted 1 3 5; the warm-up's 100 s untimed
    assert order == ["call", "flush", "call", "flush", "call", "flush", "call"]


def test_memory_flush_reads_an_array_of_the_asked_size():
    flush = memory_flush(2)
    assert flush.__self__.nbytes == 2 * 2**20 and flush() == 1.0  # np.max over 2 MiB of ones


def test_repeat_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="max_repeats=2 is below min_repeats=5"):
        RepeatPolicy(min_repeats=5, max_repeats=2)
    with pytest.raises(ValueError, match="min_time"):
        RepeatPolicy(min_time=-1)


# -- cells: specs, keys, child protocol -------------------------------------------------------


def test_implementation_labels_and_keys():
    assert split_implementation("numpy:slicing") == ("numpy", "slicing")
    assert split_implementation("torch-sdpa") == ("torch-sdpa", "standard")
    spec = CellSpec(implementation="numpy", tokens=16, batch=1, d_model=8, heads=2)
    record = {**spec.identity(), "median_s": 1.0}
    assert cell_key(record) == spec.key()
    assert CellSpec(implementation="numpy", tokens=32, batch=1, d_model=8, heads=2).key() != spec.key()
    with pytest.raises(ValueError, match="unknown cell spec fields"):
        CellSpec.from_dict({"implementation": "numpy", "sizes": 3})
    with pytest.raises(ValueError, match=r"CellSpec\.tokens must be a positive int, got 0"):
        CellSpec(implementation="numpy", tokens=0)


def test_parse_result_ignores_framework_noise():
    stdout = "warning: something\n" + RESULT_MARKER + json.dumps({"status": "ok", "median_s": 0.5}) + "\nbye\n"
    assert parse_result(stdout) == {"status": "ok", "median_s": 0.5}
    assert parse_result("no result here\n") is None


def test_failing_cell_in_a_fresh_process_is_recorded():
    spec = CellSpec(
        implementation="no-such-backend", tokens=4, batch=1, d_model=4, heads=2, cpus=pinning.choose_cpus(1)
    )
    record = run_cell(spec, timeout=120)
    assert record["status"] == "error"
    assert "unknown backend 'no-such-backend'" in record["error"]
    assert record["implementation"] == "no-such-backend" and record["tokens"] == 4


@pytest.mark.skipif(
    importlib.util.find_spec("mha_rosetta.backends.numpy.adapter") is None,
    reason="the numpy adapter is not written yet",
)
def test_smoke_numpy_cell_in_a_pinned_fresh_process(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # as on a GPU host where the user asked for the GPU
    cpus = pinning.choose_cpus(1)
    spec = CellSpec(
        implementation="numpy", tokens=8, batch=2, d_model=12, heads=3, cpus=cpus,
        policy=dict(min_time=0.01, min_repeats=3, max_time=0.2, warmup=1),
    )  # fmt: skip
    record = run_cell(spec, timeout=120)
    assert record["status"] == "ok", record.get("error")
    assert math.isfinite(record["median_s"]) and record["median_s"] > 0
    assert record["repeats"] >= 3
    assert record["flops"] == config_matmul_flops(MHAConfig(d_model=12, n_heads=3), 2, 8)
    assert record["output_finite"] is True
    assert record["malloc"] == "keep"
    assert record["malloc_env"] == pinning.MALLOC_KEEP_ENV  # the child started with the allocator rule
    if minor_page_faults() is not None:  # a tiny cell under the rule reuses its pages: under 1 MiB a call
        assert 0 <= record["page_faults_per_call"] * os.sysconf("SC_PAGE_SIZE") < 2**20
    assert record["thread_env"]["PJRT_NPROC"] == "1" and record["thread_env"]["OPENBLAS_NUM_THREADS"] == "1"
    assert record["thread_env"]["JAX_PLATFORMS"] == "cpu"  # a CPU cell's child never starts JAX's CUDA client
    if pinning.affinity_supported():
        assert record["affinity"] == cpus  # the child really was pinned
    openblas = [pool for pool in record.get("thread_pools", []) if pool.get("internal_api") == "openblas"]
    for pool in openblas:
        assert pool["num_threads"] == 1  # the environment reached the BLAS before it started


@requires("jax")
@pytest.mark.skipif(len(pinning.allowed_cpus()) < 2, reason="needs 2 cores available to this process")
def test_a_jax_cell_with_two_threads_runs_on_two_cores():
    cpus = pinning.choose_cpus(2)
    spec = CellSpec(
        implementation="jax", tokens=64, batch=2, d_model=64, heads=4, threads=2, cpus=cpus,
        policy=dict(min_time=0.05, min_repeats=3, max_time=0.3, warmup=1),
    )  # fmt: skip
    record = run_cell(spec, timeout=300)
    assert record["status"] == "ok", record.get("error") or record.get("stderr_tail")
    assert record["affinity"] == cpus and len(record["affinity"]) == 2  # pinned to its two cores
    env = record["thread_env"]
    assert env["PJRT_NPROC"] == "2" and env["JAX_PLATFORMS"] == "cpu"
    flags = env["XLA_FLAGS"] or ""
    assert "multi_thread_eigen=false" not in flags and "intra_op" not in flags  # no one-thread or stale flag
    assert all("cpu" in device.lower() for device in record["framework_threads"]["jax_devices"])  # no GPU client
    # The verified core use is reported (CPU time / wall time); on a shared machine its value
    # is not asserted, only that it is a measurement within what two cores can give.
    assert 0 < record["cpu_util"] <= 2 + pinning.CPU_UTIL_SLACK


def test_measured_children_import_no_numpy_or_framework_before_pinning():
    # The child pins itself in main(); everything imported before that must be light.
    code = (
        "import sys, mha_rosetta.benchmarks.cell, mha_rosetta.benchmarks.gemm, mha_rosetta.benchmarks.questions\n"
        "import mha_rosetta.benchmarks.bandwidth\n"
        "print(','.join(m for m in ('numpy', 'torch', 'jax') if m in sys.modules))\n"
    )
    assert python_stdout(code) == ""


# -- the report -------------------------------------------------------------------------------


def _cell(implementation="numpy", tokens=64, median=0.002, status="ok", **extra):
    cell = {
        "implementation": implementation, "backend": implementation.split(":")[0], "strategy": "standard",
        "device": "cpu", "dtype": "float32", "batch": 4, "tokens": tokens, "kv_tokens": None, "d_model": 512,
        "heads": 8, "kv_heads": None, "d_k": None, "kdim": None, "vdim": None, "causal": False, "threads": 1,
        "status": status,
    }  # fmt: skip
    if status == "ok":
        cell.update(
            median_s=median,
            iqr_s=median / 10,
            min_s=median * 0.9,
            repeats=9,
            compile_s=None,
            gflops=50.0,
            cpu_util=1.0,
            peak_mem_mb=3.0,
            warnings=[],
        )
    else:
        cell["error"] = "RuntimeError: boom"
    cell.update(extra)
    return cell


PEAK = {
    "device": "cpu",
    "dtype": "float32",
    "threads": 1,
    "n": 512,
    "gflops": 100.0,
    "library": "numpy",
    "by_library": {},
}


def test_report_has_the_schema_fields():
    report = assemble_report(
        {"threads": 1}, [PEAK], [_cell(), _cell("torch", status="error")], machine=machine_info([])
    )
    assert report["schema"] == SCHEMA_VERSION == 3
    assert report["gemm_peak_gflops"] == 100.0  # a number, the cpu/float32 entry
    assert report["gemm_peak_key"] == "cpu/float32"
    assert report["gemm_peak_gflops_by"] == {"cpu/float32": 100.0}
    assert report["gemm_peak_gflops"] == report["gemm_peak_gflops_by"]["cpu/float32"]
    for name in ("platform", "cpu_model", "cores", "python", "libraries", "blas"):
        assert name in report["machine"]
    assert report["machine"]["libraries"]["numpy"]  # a version string
    ok, failed = report["cells"]
    for name in ("implementation", "device", "dtype", "batch", "tokens", "d_model", "heads", "threads", "median_s",
                 "iqr_s", "min_s", "repeats", "compile_s", "gflops", "peak_fraction", "cpu_util", "peak_mem_mb", "status"):  # fmt: skip
        assert name in ok, name
    assert ok["peak_fraction"] == 0.5  # 50 GFLOP/s of a 100 GFLOP/s peak
    assert failed["peak_fraction"] is None and failed["status"] == "error"
    assert report["summary"] == {"cells": 2, "ok": 1, "unsupported": 0, "failed": 1, "warnings": 0, "drift": 0}
    json.loads(json.dumps(report))  # plain JSON all the way down
    table = markdown_table(report)
    assert "| `numpy` | cpu | float32 | 4 | 64 | 512 | 8 | 2.000 |" in table
    assert "error: RuntimeError: boom" in table
    assert "x its best" not in table  # a run that timed no best path has no such column


def test_the_forward_table_shows_each_cell_over_its_frameworks_best_path():
    cells = [
        _cell("numpy", median=0.003), _cell("numpy-best", median=0.002), _cell("einops-numpy", median=0.005),
        _cell("numpy", tokens=128, median=0.010),  # no numpy-best at 128 tokens: no ratio
        _cell("onnx", median=0.004),  # ONNX Runtime has no best path here: never compared with NumPy's
    ]  # fmt: skip
    report = assemble_report({"threads": 1}, [PEAK], cells, machine={})
    numpy, best, einops, larger, onnx = report["cells"]
    assert numpy["best_path"] == "numpy-best" and numpy["over_best"] == pytest.approx(1.5)
    assert best["over_best"] == 1.0 and einops["over_best"] == pytest.approx(2.5)
    assert "over_best" not in larger and "over_best" not in onnx
    table = markdown_table(report)
    assert "| implementation | device | dtype | B | N | D | H | median ms | x its best | rounds ms |" in table
    assert "| `einops-numpy` | cpu | float32 | 4 | 64 | 512 | 8 | 5.000 | 2.50 |" in table


def test_headline_peak_is_cpu_float32_else_the_first_measured():
    gpu_half = {**PEAK, "device": "gpu", "dtype": "float16", "gflops": 900.0}
    cpu_double = {**PEAK, "dtype": "float64", "gflops": 40.0}
    # cpu/float32 wins even when it is not first and not the largest
    report = assemble_report({}, [gpu_half, PEAK, cpu_double], [], machine={})
    assert (report["gemm_peak_key"], report["gemm_peak_gflops"]) == ("cpu/float32", 100.0)
    assert report["gemm_peak_gflops_by"] == {"gpu/float16": 900.0, "cpu/float32": 100.0, "cpu/float64": 40.0}
    assert "GEMM peak cpu/float32, 1 thread(s): 100.0 GFLOP/s (numpy, n=512) (the headline" in markdown_table(report)
    # without cpu/float32: the first (device, dtype) of the sweep
    report = assemble_report({}, [cpu_double, gpu_half], [], machine={})
    assert (report["gemm_peak_key"], report["gemm_peak_gflops"]) == ("cpu/float64", 40.0)
    # cpu/float32 present but not measured: the first one that was
    assert primary_peak({"cpu/float32": None, "gpu/float32": 700.0}) == ("gpu/float32", 700.0)
    assert primary_peak({"cpu/float16": None}) == ("cpu/float16", None)
    assert primary_peak({}) == (None, None)
    empty = assemble_report({}, [], [], machine={})
    assert empty["gemm_peak_gflops"] is None and empty["gemm_peak_gflops_by"] == {}


def test_markdown_names_the_allocator_rule():
    report = assemble_report({"threads": 1, "malloc": "keep"}, [PEAK], [_cell()], machine={})
    assert "Allocator: malloc=keep (glibc mmap/trim thresholds raised to 4 GiB), the same" in markdown_table(report)
    # A cell started under today's rule (the thresholds and MALLOC_ARENA_MAX): the line says so.
    cell = {**_cell(), "malloc_env": pinning.malloc_env("keep")}
    report = assemble_report({"threads": 1, "malloc": "keep"}, [PEAK], [cell], machine={})
    assert "(glibc mmap/trim thresholds raised to 4 GiB, one arena for every thread)" in markdown_table(report)


def test_baseline_comparison_sets_the_peaks_side_by_side_and_reads_old_reports():
    new = assemble_report({}, [{**PEAK, "gflops": 120.0}], [_cell("a", median=1.0)], machine={})
    old = assemble_report({}, [PEAK], [_cell("a", median=1.0)], machine={})
    comparison = compare_to_baseline(new, old)
    assert comparison["gemm_peak"] == {"key": "cpu/float32", "baseline_gflops": 100.0, "gflops": 120.0, "ratio": 1.2}
    text = baseline_markdown(comparison)
    assert "- GEMM peak cpu/float32: 100.0 -> 120.0 GFLOP/s (+20%" in text
    assert "- no change beyond 10%" in text  # the peak line is context, not a flagged change
    # a report written when the field was still the mapping
    legacy = {**old, "gemm_peak_gflops": {"cpu/float32": 100.0}}
    del legacy["gemm_peak_key"]
    assert compare_to_baseline(new, legacy)["gemm_peak"]["baseline_gflops"] == 100.0
    other_dtype = assemble_report({}, [{**PEAK, "dtype": "float64"}], [_cell("a", median=1.0)], machine={})
    assert compare_to_baseline(new, other_dtype)["gemm_peak"] is None  # different yardsticks: not compared
    # Both runs from one machine (assemble_report's provenance: this host): no machine line.
    assert comparison["machine_differences"] == [] and "another machine" not in text
    elsewhere = {**old, "machine": {**old["machine"], "cpu_model": "Another CPU"}}
    moved = baseline_markdown(compare_to_baseline(new, elsewhere))
    assert "- another machine (the baseline's against this run's: cpu_model 'Another CPU' against " in moved


def test_baseline_comparison_flags_changes_beyond_ten_percent():
    baseline = assemble_report(
        {},
        [PEAK],
        [_cell("a", median=1.0), _cell("b", median=1.0), _cell("c", median=1.0), _cell("e", median=1.0)],
        machine={},
    )
    report = assemble_report(
        {}, [PEAK],
        [_cell("a", median=1.15), _cell("b", median=1.05), _cell("c", median=0.85), _cell("d", median=1.0), _cell("e", status="error")],
        machine={},
    )  # fmt: skip
    comparison = compare_to_baseline(report, baseline)
    flagged = {row["implementation"]: row["change"] for row in comparison["flagged"]}
    assert flagged == {"a": "slower", "c": "faster"}  # b moved 5%: not flagged
    assert [row["implementation"] for row in comparison["stopped_working"]] == ["e"]
    assert [key[0] for key in comparison["only_in_report"]] == ["d"]
    with pytest.raises(ValueError, match="schema"):
        compare_to_baseline(report, {"schema": 99, "cells": []})


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "sub" / "report.json"
    write_text_atomic(target, "first")
    write_text_atomic(target, "second")
    assert target.read_text() == "second"
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]
    assert os.stat(target).st_mode & 0o044  # readable by others like any normal file, not mkstemp's 0600


@requires("matplotlib")
def test_plots_are_written(tmp_path):
    report = assemble_report(
        {},
        [PEAK],
        [_cell("a", 64, 0.001), _cell("a", 128, 0.003), _cell("b", 64, 0.002), _cell("b", 128, 0.005)],
        machine={},
    )
    from mha_rosetta.benchmarks.plots import plot_report

    written = plot_report(report, tmp_path)
    assert {path.name for path in written} == {
        "time_vs_tokens_cpu_float32_B4_D512_H8_T1.png",
        "gflops_at_reference_size.png",
    }
    assert all(path.stat().st_size > 1000 for path in written)


# -- the sweep: rounds, failures and resume (fake runners: no processes) ----------------------


def _settings(**changes):
    values = dict(
        implementations=["numpy", "torch"], tokens=[8, 16], batch=[1], d_model=[8], heads=[2], gemm_n=64, seed=7
    )
    values.update(changes)
    return SweepSettings(**values)


class FakeRunners:
    def __init__(self, fail=(), interrupt_at=None, unsupported=()):
        self.cells, self.gemms, self.fail, self.interrupt_at = [], [], set(fail), interrupt_at
        self.unsupported = set(unsupported)
        self.cell_mallocs, self.gemm_mallocs, self.gemm_libraries = [], [], []

    def cell(self, spec, timeout):
        if self.interrupt_at is not None and len(self.cells) == self.interrupt_at:
            raise KeyboardInterrupt
        self.cells.append(spec.key())
        self.cell_mallocs.append(spec.malloc)
        if spec.implementation in self.fail:
            return {**spec.identity(), "status": "error", "error": "RuntimeError: broken adapter"}
        if spec.implementation in self.unsupported:
            return {**spec.identity(), "status": "unsupported", "error": "not here"}
        # The n-th visit takes 1 + n/100 ms per token: every visit differs, so the merge shows.
        median = 0.001 * spec.tokens * (1 + len(self.cells) / 100)
        return {**spec.identity(), "status": "ok", "median_s": median, "samples_s": [median] * 3, "gflops": 1.0}

    def gemm(self, dtype, device, threads, cpus, **options):
        self.gemms.append((device, dtype))
        self.gemm_mallocs.append(options["malloc"])
        self.gemm_libraries.append(options.get("libraries"))
        gflops = 10.0 + len(self.gemms)  # a different figure each time
        return {
            "device": device,
            "dtype": dtype,
            "threads": threads,
            "n": options["n"],
            "gflops": gflops,
            "library": "numpy",
            "malloc": options["malloc"],
        }


def _run(runners, partial, resume=False, settings=None):
    settings = settings or _settings()
    return run_sweep(
        settings, partial_path=partial, resume=resume, progress=False, cell_runner=runners.cell,
        gemm_runner=runners.gemm, implementations=settings.implementations,
    )  # fmt: skip


def _visited(runners):
    return [(key["implementation"], key["tokens"]) for key in map(json.loads, runners.cells)]


PLAN = [("numpy", 8), ("torch", 8), ("numpy", 16), ("torch", 16)]


def test_round_orders_are_seeded_shuffles_of_every_cell():
    from mha_rosetta.benchmarks.rounds import round_orders

    orders = round_orders(6, 3, seed=11)
    assert all(sorted(order) == list(range(6)) for order in orders)  # every cell once per round
    assert round_orders(6, 3, seed=11) == orders  # the seed replays the order
    assert round_orders(6, 3, seed=12) != orders
    assert len({tuple(order) for order in round_orders(8, 4, seed=0)}) > 1  # shuffled afresh each round


def test_round_orders_with_several_visits_shuffle_every_visit_together():
    from mha_rosetta.benchmarks.rounds import round_orders

    assert round_orders(6, 3, seed=11, visits=1) == round_orders(6, 3, seed=11)  # one visit: the old orders
    orders = round_orders(5, 2, seed=3, visits=2)
    assert all(sorted(order) == sorted(list(range(5)) * 2) for order in orders)  # every cell twice a round
    assert any(order[:5] != sorted(order[:5]) for order in orders)  # not cell by cell: shuffled together


def test_several_visits_a_round_are_each_run_kept_and_pooled(tmp_path):
    runners = FakeRunners()
    partial = tmp_path / "p.jsonl"
    outcome = _run(runners, partial, settings=_settings(rounds=2, visits=2))
    assert sorted(_visited(runners)) == sorted(PLAN * 4)  # 4 cells x 2 rounds x 2 visits, each a process
    assert outcome.rounds["visits"] == 2 and all(len(order) == 8 for order in outcome.rounds["orders"])
    numpy8 = next(c for c in outcome.cells if c["implementation"] == "numpy" and c["tokens"] == 8)
    # The fake's n-th visit takes 8 x (1 + n/100) ms: each round's median pools its two visits' samples.
    entries = [json.loads(line) for line in partial.read_text().splitlines()]
    mine = [e for e in entries if e["type"] == "cell" and e["record"]["implementation"] == "numpy"
            and e["record"]["tokens"] == 8]  # fmt: skip
    assert sorted((entry["round"], entry["visit"]) for entry in mine) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(numpy8["samples_s"]) == 12
    assert [len(medians) for medians in numpy8["visit_medians_s"]] == [2, 2]
    for medians, pooled in zip(numpy8["visit_medians_s"], numpy8["round_medians_s"], strict=True):
        assert pooled == pytest.approx(sum(medians) / 2)  # 6 samples, 3 at each: the median is their midpoint
    kept, _peaks = load_partial(partial)
    assert len(kept) == 16 and sorted({key[:2] for key in kept}) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_resume_runs_only_the_missing_visit_of_a_round(tmp_path):
    partial = tmp_path / "p.jsonl"
    first = FakeRunners(interrupt_at=11)
    _run(first, partial, settings=_settings(rounds=2, visits=2))
    assert len(first.cells) == 11
    second = FakeRunners()
    resumed = _run(second, partial, resume=True, settings=_settings(rounds=2, visits=2))
    assert len(second.cells) == 16 - 11 and resumed.resumed_cells == 11
    assert all(len(cell["samples_s"]) == 12 for cell in resumed.cells)


def test_a_failed_visit_fails_its_round_and_names_the_visit():
    from mha_rosetta.benchmarks.rounds import pool_visits

    ok = {"status": "ok", "median_s": 1.0, "samples_s": [1.0, 1.0]}
    failed = {"status": "timeout", "error": "no result within 120 s"}
    assert pool_visits([ok]) is ok  # one visit a round: the visit itself
    assert pool_visits([ok, failed]) == {**failed, "error": "visit 2: no result within 120 s"}
    assert pool_visits([None, None]) is None
    unsupported = {"status": "unsupported", "error": "not here"}
    assert pool_visits([unsupported, None])["status"] == "unsupported"


def test_pooled_visits_keep_their_pairs_in_order():
    from mha_rosetta.benchmarks.rounds import pool_visits

    first = {"status": "ok", "median_s": 2.0, "samples_s": [2.0, 2.0, 2.0], "reference_samples_s": [1.0] * 3,
             "paired_ratios": [2.0] * 3, "ratio_median": 2.0, "reference_median_s": 1.0, "timed_total_s": 6.0,
             "compile_s": 0.5, "peak_mem_mb": 10.0, "warnings": ["slow start"]}  # fmt: skip
    second = {"status": "ok", "median_s": 3.0, "samples_s": [3.0, 3.0], "reference_samples_s": [1.5, 1.5],
              "paired_ratios": [2.0, 2.0], "ratio_median": 2.0, "reference_median_s": 1.5, "timed_total_s": 6.0,
              "compile_s": 0.7, "peak_mem_mb": 12.0, "warnings": []}  # fmt: skip
    pooled = pool_visits([first, second])
    assert pooled["samples_s"] == [2.0, 2.0, 2.0, 3.0, 3.0]
    assert pooled["reference_samples_s"] == [1.0, 1.0, 1.0, 1.5, 1.5] and pooled["paired_ratios"] == [2.0] * 5
    assert pooled["median_s"] == 2.0 and pooled["reference_median_s"] == 1.0 and pooled["repeats"] == 5
    assert pooled["visit_medians_s"] == [2.0, 3.0] and pooled["visit_ratio_medians"] == [2.0, 2.0]
    assert pooled["visit_reference_medians_s"] == [1.0, 1.5]
    # The run's median reference counts every visit once, not every round once.
    from mha_rosetta.benchmarks.correction import run_references
    from mha_rosetta.benchmarks.rounds import merge_visits

    workload = {"library": "numpy", "device": "cpu", "dtype": "float32", "n": 512, "flops": 2 * 512**3}
    third = {**second, "reference_samples_s": [4.0, 4.0], "reference_median_s": 4.0}
    cell = merge_visits([pool_visits([first, second]), pool_visits([first, third])])
    assert cell["visit_reference_medians_s"] == [[1.0, 1.5], [1.0, 4.0]]
    (entry,) = run_references([{**cell, "reference": workload}]).values()
    assert entry["visits"] == 4 and entry["median_s"] == 1.25  # the rounds' pooled medians would give 1.0
    assert pooled["timed_total_s"] == 12.0 and pooled["compile_s"] == pytest.approx(0.6)
    assert pooled["peak_mem_mb"] == 12.0 and pooled["warnings"] == ["visit 1: slow start"]


def test_every_round_visits_every_cell_once_and_measures_the_peak(tmp_path):
    runners = FakeRunners()
    outcome = _run(runners, tmp_path / "p.jsonl", settings=_settings(rounds=3))
    visited = _visited(runners)
    assert len(visited) == 12 and all(sorted(visited[4 * r : 4 * r + 4]) == sorted(PLAN) for r in range(3))
    rounds = outcome.rounds
    assert rounds["count"] == 3 and rounds["seed"] == 7
    assert [[label for label in order] for order in rounds["orders"]] == [
        [f"{name} N={tokens}" for name, tokens in visited[4 * r : 4 * r + 4]] for r in range(3)
    ]  # the recorded order is the order run
    assert runners.gemms == [("cpu", "float32")] * 3  # the peak in every round
    assert runners.gemm_libraries == [None, ["numpy"], ["numpy"]]  # later rounds: the first round's winner
    assert rounds["gemm_peaks_gflops"] == {"cpu/float32": [11.0, 12.0, 13.0]}
    assert rounds["busy_rounds"] == [0, 1]  # 11 and 12 are more than 5% below the best other round (13)
    peak = outcome.gemm_peaks[0]
    assert peak["gflops"] == 12.0 and peak["round_gflops"] == [11.0, 12.0, 13.0] and peak["busy_rounds"] == [0, 1]
    assert [(c["implementation"], c["tokens"]) for c in outcome.cells] == PLAN  # merged, in plan order
    cell = outcome.cells[0]
    medians = cell["round_medians_s"]
    assert len(medians) == 3 and cell["spread_s"] == [min(medians), max(medians)]
    assert cell["median_s"] == sorted(cell["round_medians_s"])[1]  # 3 equal samples per round: the middle round
    assert cell["repeats"] == 9  # every sample pooled


def test_a_drawn_seed_is_recorded_and_replays_the_same_order(tmp_path):
    first = _run(FakeRunners(), tmp_path / "a.jsonl", settings=_settings(rounds=2, seed=None))
    seed = first.settings.seed
    assert isinstance(seed, int) and first.rounds["seed"] == seed
    again = _run(FakeRunners(), tmp_path / "b.jsonl", settings=_settings(rounds=2, seed=seed))
    assert again.rounds["orders"] == first.rounds["orders"]


def test_an_unsupported_cell_is_not_visited_again(tmp_path):
    runners = FakeRunners(unsupported={"torch"})
    outcome = _run(runners, tmp_path / "p.jsonl", settings=_settings(rounds=3))
    assert _visited(runners).count(("torch", 8)) == 1 and _visited(runners).count(("numpy", 8)) == 3
    assert [c["status"] for c in outcome.cells] == ["ok", "unsupported", "ok", "unsupported"]
    assert not outcome.failed


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path):
    runners = FakeRunners(fail={"numpy"})
    outcome = _run(runners, tmp_path / "p.jsonl")
    assert sorted(_visited(runners)) == sorted(PLAN)
    assert [(c["implementation"], c["tokens"], c["status"]) for c in outcome.cells] == [
        ("numpy", 8, "error"), ("torch", 8, "ok"), ("numpy", 16, "error"), ("torch", 16, "ok"),
    ]  # fmt: skip
    assert len(outcome.failed) == 2 and not outcome.interrupted
    assert runners.gemms == [("cpu", "float32")]  # one round, one peak
    assert outcome.gemm_peaks[0]["gflops"] == 11.0 and outcome.gemm_peaks[0]["measured_gflops"] == [11.0]


def test_the_allocator_rule_reaches_every_cell_and_gemm_peak(tmp_path):
    keep = FakeRunners()
    _run(keep, tmp_path / "keep.jsonl")
    assert keep.cell_mallocs == ["keep"] * 4 and keep.gemm_mallocs == ["keep"]
    plain = FakeRunners()
    outcome = _run(plain, tmp_path / "plain.jsonl", settings=_settings(malloc="default", rounds=2))
    assert plain.cell_mallocs == ["default"] * 8 and plain.gemm_mallocs == ["default", "default"]
    assert [json.loads(key)["malloc"] for key in plain.cells] == ["default"] * 8  # part of the cell's identity
    assert outcome.gemm_peaks[0]["malloc"] == "default"


def test_resume_skips_finished_visits_and_retries_failed_ones(tmp_path):
    partial = tmp_path / "p.jsonl"
    first = FakeRunners(fail={"torch"}, interrupt_at=5)
    interrupted = _run(first, partial, settings=_settings(rounds=2, seed=None))
    assert interrupted.interrupted and len(first.cells) == 5  # round 1 (4 visits) and one of round 2
    kept, peaks = load_partial(partial)
    assert len(kept) == 5 and list(peaks) == [(0, "cpu/float32/1"), (1, "cpu/float32/1")]
    done_ok = [key for key, record in kept.items() if record["status"] == "ok"]

    second = FakeRunners()
    resumed = _run(second, partial, resume=True, settings=_settings(rounds=2, seed=None))
    assert not resumed.interrupted and resumed.resumed_cells == len(done_ok)
    assert resumed.settings.seed == interrupted.settings.seed  # the partial file's seed, so the same order
    assert resumed.rounds["orders"] == interrupted.rounds["orders"]
    assert len(second.cells) == 8 - len(done_ok)  # the failed visits again, and the unrun ones
    assert second.gemms == []  # both rounds' peaks were measured before the interruption
    assert [c["status"] for c in resumed.cells] == ["ok"] * 4
    assert all(None not in cell["round_medians_s"] for cell in resumed.cells)


def test_resume_refuses_a_partial_file_from_another_machine_with_the_same_host_id(tmp_path):
    # The case that happened: an Intel Xeon and an AMD EPYC whose cloned /etc/machine-id hash to one host id.
    from mha_rosetta.benchmarks.provenance import machine_key

    partial = tmp_path / "p.jsonl"
    _run(FakeRunners(interrupt_at=1), partial)
    header = json.loads(partial.read_text().splitlines()[0])
    assert header["machine"] == machine_key()  # the header records the machine it ran on
    lines = partial.read_text().splitlines()
    header["machine"] = {**machine_key(), "cpu_model": "Another CPU"}
    partial.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    rest = FakeRunners()
    with pytest.raises(ValueError, match=r"was written on another machine .*cpu_model 'Another CPU' against"):
        _run(rest, partial, resume=True)
    assert rest.cells == [] and rest.gemms == []  # refused before anything is measured


def test_a_fresh_sweep_discards_an_old_partial_file(tmp_path):
    partial = tmp_path / "p.jsonl"
    _run(FakeRunners(), partial)
    again = FakeRunners()
    _run(again, partial, resume=False)
    assert len(again.cells) == 4


def test_torn_last_line_of_a_partial_file_is_ignored_and_resume_goes_on(tmp_path):
    partial = tmp_path / "p.jsonl"
    _run(FakeRunners(interrupt_at=1), partial)
    with partial.open("a") as handle:
        handle.write('{"type": "cell", "record": {"implem')  # killed mid-write
    cells, _peaks = load_partial(partial)
    assert len(cells) == 1
    rest = FakeRunners()
    _run(rest, partial, resume=True)
    assert len(rest.cells) == 3
    cells, _peaks = load_partial(partial)
    assert len(cells) == 4  # the entries after the torn line start on a line of their own


def test_the_estimate_counts_cells_rounds_and_peaks():
    from mha_rosetta.benchmarks.progress import STARTUP_S, describe_estimate, estimate_seconds
    from mha_rosetta.benchmarks.sweep import expand_cells

    settings = _settings(rounds=3, implementations=["numpy"], policy=dict(min_time=1.0))
    cells = expand_cells(settings, ["numpy"])
    estimate = estimate_seconds(settings, cells)
    assert estimate["cells"] == 2 and estimate["rounds"] == 3
    assert estimate["per_cell_s"] == STARTUP_S["numpy"] + 2.0 + 0.2  # start-up + twice min_time + 0.2 s
    assert estimate["total_s"] == 2 * 3 * estimate["per_cell_s"] + estimate["gemm_s"]
    assert describe_estimate(estimate).startswith("2 cells x 3 round(s) x ~2.7 s + GEMM peaks")


# -- the command line -------------------------------------------------------------------------


def test_cli_rejects_unknown_implementation(capsys):
    from mha_rosetta.cli.main import main

    assert main(["bench", "--implementations", "numpy,nosuch", "--no-progress"]) == 2
    assert "unknown implementation 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--malloc", "fast", "--no-progress"])
    assert exited.value.code == 2
    assert "argument --malloc: invalid choice: 'fast'" in capsys.readouterr().err


def test_cli_writes_outputs_and_fails_on_a_failed_cell(tmp_path, monkeypatch, capsys):
    from mha_rosetta.benchmarks import sweep
    from mha_rosetta.cli.main import main

    runners = FakeRunners(fail={"torch"})
    real_sweep = sweep.run_sweep

    def fake_sweep(settings, **options):
        return real_sweep(settings, **options, cell_runner=runners.cell, gemm_runner=runners.gemm)

    monkeypatch.setattr(sweep, "run_sweep", fake_sweep)
    json_path, md_path = tmp_path / "out.json", tmp_path / "out.md"
    status = main(["bench", "--implementations", "numpy,torch", "--tokens", "8", "--batch", "1", "--d-model", "8",
                   "--heads", "2", "--devices", "cpu", "--json", str(json_path), "--markdown", str(md_path), "--no-progress"])  # fmt: skip
    assert status == 1  # the torch cell failed
    report = json.loads(json_path.read_text())
    assert report["complete"] is True and report["summary"]["failed"] == 1
    assert report["settings"]["tokens"] == [8] and report["settings"]["threads"] == 1
    assert report["settings"]["rounds"] == 3 and report["rounds"]["seed"] == report["settings"]["seed"]
    assert report["settings"]["malloc"] == "keep" and runners.cell_mallocs == ["keep"] * 6  # 2 cells x 3 rounds
    assert report["gemm_peak_gflops"] == report["gemm_peak_gflops_by"]["cpu/float32"] == 12.0  # median of 11, 12, 13
    assert report["sweep_time"]["estimated_s"] > 0 and report["sweep_time"]["wall_s"] > 0
    assert "2 cells x 3 round(s) x ~" in capsys.readouterr().err  # the time it takes, said up front
    assert [cell["malloc"] for cell in report["cells"]] == ["keep", "keep"]
    assert "`torch`" in md_path.read_text()
    assert not Path(f"{json_path}.partial.jsonl").exists()  # a finished sweep leaves no partial file


# -- the speed questions: verdict logic on given numbers --------------------------------------


def _heads_case(heads, batched, slicing, per_head):
    return {"sizes": {"heads": heads}, "median_s": {"batched": batched, "slicing": slicing, "per_head": per_head}}


def test_heads_verdicts():
    confirmed, text = verdict_heads(
        [_heads_case(2, 1.0, 1.6, 1.7), _heads_case(8, 1.0, 2.0, 2.5), _heads_case(32, 1.0, 3.0, 4.0)]
    )
    assert confirmed == CONFIRMED and "slicing / batched = 1.60x (h=2), 2.00x (h=8), 3.00x (h=32)" in text
    refuted, _ = verdict_heads([_heads_case(2, 1.0, 1.0, 1.0), _heads_case(32, 1.0, 0.6, 0.7)])
    assert refuted == REFUTED
    partly, _ = verdict_heads([_heads_case(2, 1.0, 1.2, 1.0), _heads_case(32, 1.0, 1.3, 1.0)])
    assert partly == PARTLY


def test_layout_merge_and_einsum_verdicts():
    case = {
        "sizes": {"tokens": 8, "d_in": 4, "d_out": 2},
        "median_s": {"x_at_wT": 1.0, "w_at_xT": 1.02, "w_at_xT_back": 1.5},
    }
    assert verdict_linear_layout([case])[0] == PARTLY  # only the copy back costs
    case["median_s"]["w_at_xT"] = 1.3
    assert verdict_linear_layout([case])[0] == CONFIRMED
    other_shape = {
        "sizes": {"tokens": 8, "d_in": 4, "d_out": 1},
        "median_s": {"x_at_wT": 1.0, "w_at_xT": 1.0, "w_at_xT_back": 1.05},
    }
    assert verdict_linear_layout([case, other_shape])[0] == PARTLY  # slower at one shape only
    assert verdict_linear_layout([other_shape])[0] == REFUTED  # no cost, even with the copy back
    merge = {"median_s": {"contiguous_then_view": 1.0, "reshape": 1.03, "view_no_copy": 0.01}}
    assert verdict_merge_copy([merge])[0] == CONFIRMED
    einsum = {"median_s": {"transpose_matmul": 1.0, "einsum": 14.0, "einsum_optimize": 1.05}}
    verdict, text = verdict_einsum([einsum])
    assert verdict == PARTLY and "einsum / (transpose + matmul) = 14.00x" in text


def test_answer_keeps_skipped_measurements_and_shape():
    answer = answer_question(9, [
        {"library": "numpy", "device": "cpu", "status": "ok", "cpu_util": 1.0,
         "cases": [{"median_s": {"contiguous_then_view": 1.0, "reshape": 1.0, "view_no_copy": 0.1}}]},
        {"library": "torch", "device": "cpu", "status": "error", "error": "ModuleNotFoundError: torch"},
    ])  # fmt: skip
    assert set(answer) >= {"claim", "title", "verdict", "evidence"}
    assert answer["claim"] == 9 and answer["verdict"] == CONFIRMED  # the skipped library does not vote
    assert "torch/cpu: not measured (ModuleNotFoundError: torch)" in answer["evidence"]
    with pytest.raises(ValueError, match=r"claims \[4\] have no speed question"):
        run_speed_questions(claims=[4])


def test_the_progress_lines_count_rounds(tmp_path, monkeypatch, capsys):
    from mha_rosetta.benchmarks.progress import Progress

    monkeypatch.setitem(sys.modules, "rich.progress", None)  # as without rich: one plain line per step
    bar = Progress(rounds=2, visits=3)
    bar.start_round(1)
    bar.advance("numpy N=8: 1.000 ms")
    bar.close()
    assert capsys.readouterr().err == "[round 2/2, 1/3] numpy N=8: 1.000 ms\n"


_THREAD_ALLOCATIONS = r"""
import ctypes, json, resource, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []

def work():  # what XLA:CPU does on its pool thread: two large temporaries (scores, weights), every call
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffers = [libc.malloc(40 << 20) for _ in range(2)]
        for buffer in buffers:
            libc.memset(buffer, 1, 40 << 20)
        for buffer in buffers:
            libc.free(buffer)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps(faults))
"""


def _thread_faults(env: dict[str, str]) -> list[int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", _THREAD_ALLOCATIONS], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="the allocator rule is made of glibc tunables")  # fmt: skip
def test_the_allocator_rule_keeps_a_threads_large_buffers_mapped():
    # Two buffers of 40 MiB written by a thread other than the main one, five times over: with the rule,
    # only the first time faults pages in; every later call reuses them.
    page = os.sysconf("SC_PAGE_SIZE")
    keep = _thread_faults(pinning.malloc_env("keep"))
    assert all(count < 0.05 * (40 << 20) / page for count in keep[1:]), keep
    # The two thresholds alone (the rule before MALLOC_ARENA_MAX): the thread's arena holds heaps of at
    # most 64 MiB, so the second buffer gets a heap of its own, which glibc unmaps whole once it is empty,
    # whatever the trim threshold; every call then faults that buffer in again (10240 faults of 4 KiB).
    thresholds_only = {k: v for k, v in pinning.malloc_env("keep").items() if k != "MALLOC_ARENA_MAX"}
    again = _thread_faults(thresholds_only)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" in thp.read_text():
        pytest.skip("transparent huge pages are always on here: a fault maps 2 MiB, so counts say nothing of bytes")
    assert all(count > 0.9 * (40 << 20) / page for count in again[1:]), again


@pytest.mark.skipif(minor_page_faults() is None, reason="this OS does not count page faults")
def test_a_call_that_faults_in_16_mib_or_more_is_warned_about():
    page = os.sysconf("SC_PAGE_SIZE")
    assert pinning.page_fault_warning(None, "keep") is None
    assert pinning.page_fault_warning((16 << 20) / page - 1, "keep") is None
    warning = pinning.page_fault_warning((32 << 20) / page, "keep")
    assert warning.startswith(f"each call faulted in 32 MiB of fresh pages ({(32 << 20) // page} page faults)")
    assert "although the allocator rule 'keep' was on" in warning
    assert "--malloc keep reuses them" in pinning.page_fault_warning((32 << 20) / page, "default")


def test_each_library_is_refused_with_its_reason_or_measured_apart_and_its_best_kept():
    # The GEMM peak's and the copy bandwidth's one loop (`gemm.each_library_best`): a refusal is recorded, not run;
    # each other library runs on its own, again (with its best so far) while its core was shared.
    from mha_rosetta.benchmarks.gemm import each_library_best

    results = {"a": iter([{"status": "ok", "gbps": 4.0, "cpu_util": 0.5}, {"status": "ok", "gbps": 6.0, "cpu_util": 1.0}]),
               "c": iter([{"status": "ok", "gbps": 3.0, "cpu_util": 1.0}])}  # fmt: skip
    calls = []

    def run(library, best):
        calls.append((library, None if best is None else best["gbps"]))
        return next(results[library])

    got = each_library_best(
        ["a", "b", "c"], lambda name: "b: not here" if name == "b" else None, run, "gbps", "cpu", 1, 2
    )
    assert got == {
        "a": {"status": "ok", "gbps": 6.0, "cpu_util": 1.0, "attempts": 2},
        "b": {"status": "unsupported", "error": "b: not here"},
        "c": {"status": "ok", "gbps": 3.0, "cpu_util": 1.0, "attempts": 1},
    }
    assert calls == [("a", None), ("a", 4.0), ("c", None)]


def test_a_contended_peak_or_bandwidth_is_measured_again_and_the_best_kept():
    from mha_rosetta.benchmarks.gemm import best_uncontended

    results = iter([{"status": "ok", "gflops": 80.0, "cpu_util": 0.5, "n": 512},
                    {"status": "ok", "gflops": 95.0, "cpu_util": 0.6, "n": 512},
                    {"status": "ok", "gflops": 99.0, "cpu_util": 1.0, "n": 512}])  # fmt: skip
    seen = []

    def run(best):
        seen.append(None if best is None else best["gflops"])
        return next(results)

    best = best_uncontended(run, "gflops", "cpu", 1, retries=1)
    assert (best["gflops"], best["attempts"], seen) == (95.0, 2, [None, 80.0])  # one retry, the better kept
    again = iter([{"status": "ok", "gbps": 9.0, "cpu_util": 1.0}])
    assert best_uncontended(lambda best: next(again), "gbps", "cpu", 1, retries=3)["attempts"] == 1  # not shared
    shared = iter([{"status": "ok", "gbps": 9.0, "cpu_util": 0.2}])
    assert best_uncontended(lambda best: next(shared), "gbps", "gpu", 1, retries=3)["attempts"] == 1  # a GPU: no retry
