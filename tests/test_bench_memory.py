"""The benchmark's memory and CPU accounting: `benchmarks.memory` and the worker processes' CPU time.

Known allocations are counted to the byte (tracemalloc sees NumPy's buffers), the resident
set's reset high-water mark sees memory allocated outside NumPy, and a child process's CPU
time is counted as the cell's (the ranks of a sharded backend do the work, not the cell).
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.benchmarks import pinning
from mha_rosetta.benchmarks.cell import CellSpec, run_cell
from mha_rosetta.benchmarks.memory import MemoryProbe, is_numpy_array, reset_peak_rss

MIB = 2**20
LINUX = sys.platform.startswith("linux")


def test_numpy_memory_is_counted_exactly_by_tracemalloc():
    probe = MemoryProbe()
    probe.before_prepare()
    workspace = np.empty((256, 1024), dtype=np.float64)  # 2 MiB kept between calls (never touched)
    probe.after_prepare()

    def call():
        temporary = np.ones((1024, 1024), dtype=np.float64)  # 8 MiB, freed before the call returns
        output = np.empty((512, 1024), dtype=np.float32)  # the 2 MiB output
        output[...] = temporary[:512]  # a casting copy: no full-size intermediate
        return output

    result, memory = probe.call(call)
    assert result.shape == (512, 1024)
    assert memory["peak_mem_method"] == "tracemalloc"
    assert memory["held_traced_mb"] == pytest.approx(2.0, abs=0.05)
    # The temporary and the output are alive together at the worst moment: 8 + 2 MiB.
    assert memory["call_traced_peak_mb"] == pytest.approx(10.0, abs=0.1)
    assert memory["peak_mem_mb"] == pytest.approx(memory["held_traced_mb"] + memory["call_traced_peak_mb"])
    del workspace


@pytest.mark.skipif(not LINUX, reason="the resident set's high-water mark is reset through /proc (Linux only)")
def test_memory_outside_numpy_is_counted_by_the_resident_set():
    assert reset_peak_rss()
    probe = MemoryProbe()
    probe.before_prepare()
    probe.after_prepare()

    def call():
        block = bytearray(64 * MIB)  # zero-filled: every page is touched
        del block
        return "not an array"

    result, memory = probe.call(call)
    assert result == "not an array" and not is_numpy_array(result)
    assert memory["peak_mem_method"] == "rss-high-water"
    assert memory["call_traced_peak_mb"] is None  # tracemalloc would see only Python objects
    assert 60 <= memory["call_rss_peak_mb"] <= 90
    assert memory["peak_mem_mb"] == pytest.approx(memory["held_rss_mb"] + memory["call_rss_peak_mb"])


def test_is_numpy_array():
    assert is_numpy_array(np.zeros(2)) and is_numpy_array([np.zeros(2)]) and is_numpy_array({"dq": np.zeros(2)})
    assert not is_numpy_array(memoryview(b"ab")) and not is_numpy_array([]) and not is_numpy_array(np.float64(1.0))


@pytest.mark.skipif(not LINUX, reason="child processes and their CPU time are read from /proc (Linux only)")
def test_a_child_process_cpu_time_counts_as_the_cells():
    # The child spins until it has used 0.4 s of CPU, says so, and then waits to be stopped.
    spin = "import sys, time\nwhile time.process_time() < 0.4: pass\nprint('spun', flush=True)\nsys.stdin.read()\n"
    own_before = time.process_time()
    family_before = pinning.family_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        assert child.pid in pinning.child_pids()
        child_cpu = pinning.process_cpu_seconds(child.pid)
        assert child_cpu >= 0.35  # clock ticks of 10 ms
        family_after = pinning.family_cpu_seconds()
        own = time.process_time() - own_before
        assert family_after - family_before >= own + 0.35
        (report,) = [worker for worker in pinning.worker_report() if worker["pid"] == child.pid]
        assert report["cpu_s"] >= 0.35 and report["rss_mb"] > 1
        assert report["affinity"] == sorted(pinning.allowed_cpus())  # a child inherits the parent's cores
    finally:
        child.communicate("", timeout=30)
    assert pinning.process_cpu_seconds(child.pid) is None  # gone: no time, no error


def test_cpu_time_of_a_missing_process_is_none():
    assert pinning.process_cpu_seconds(2**22 + 12345) is None


def test_a_numpy_cell_reports_its_memory():
    spec = CellSpec(
        implementation="numpy", tokens=256, batch=1, d_model=64, heads=4, cpus=pinning.choose_cpus(1),
        policy=dict(min_time=0.01, min_repeats=2, max_time=0.2, warmup=0),
    )  # fmt: skip
    record = run_cell(spec, timeout=120)
    assert record["status"] == "ok", record.get("error")
    assert record["peak_mem_method"] == "tracemalloc" and record["workers"] == []
    # The adapter keeps one float32 score buffer (1, 4, 256, 256) = 1 MiB between calls: held, not per call.
    assert record["held_traced_mb"] >= 1.0
    assert record["peak_mem_mb"] == pytest.approx(record["held_traced_mb"] + record["call_traced_peak_mb"])


@requires("torch")
@pytest.mark.skipif(not LINUX, reason="the ranks' CPU time is read from /proc (Linux only)")
def test_a_torch_tp_cell_counts_its_two_ranks():
    spec = CellSpec(
        implementation="torch-tp", tokens=64, batch=2, d_model=32, heads=4, threads=2,
        cpus=pinning.choose_cpus(min(2, len(pinning.allowed_cpus()))),
        policy=dict(min_time=0.05, min_repeats=3, max_time=0.5, warmup=1),
    )  # fmt: skip
    record = run_cell(spec, timeout=300)
    assert record["status"] == "ok", record.get("error") or record.get("stderr_tail")
    assert len(record["workers"]) == 2  # one process per rank, seen from the cell
    # What cannot depend on the machine's load: both ranks seen, on the cell's cores, their CPU time read.
    # Not that it is positive: CPU time moves in 10 ms ticks, and on a busy machine a rank's short timed
    # span collected none (span_cpu_s 0.0 failed CI on a fresh clone, 2026-12-04).
    for worker in record["workers"]:
        assert isinstance(worker["span_cpu_s"], float) and worker["span_cpu_s"] >= 0.0
        assert set(worker["affinity"]) <= set(record["affinity"])
    assert record["span_cpu_s"] >= sum(worker["span_cpu_s"] for worker in record["workers"])
    assert record["peak_mem_mb"] is None and "worker processes" in record["peak_mem_method"]
