"""The decode limit that counts every byte (`benchmarks.limits`): bytes by hand, bandwidth on a fake clock.

No test here measures a speed: the bytes are computed by hand from the configuration, the
bandwidth arithmetic runs on a clock that advances by a fixed step, and the cache's size is
found on made-up curves.
"""

from __future__ import annotations

import itertools

import pytest

from mha_rosetta.benchmarks.bandwidth import kv_read_bytes, weight_bytes
from mha_rosetta.benchmarks.limits import (
    MiB,
    decode_limit_s,
    fits_in_cache,
    limit_array_bytes,
    measure_llc,
    measure_read_limit,
    read_bandwidth,
    step_bytes,
)
from mha_rosetta.core import MHAConfig

# The decode preset's layer (benchmarks/presets.py): d_model 2048, 16 heads of 128 on 4 kv heads, no biases.
LLAMA = MHAConfig(d_model=2048, n_heads=16, n_kv_heads=4, d_k=128, rope="half", bias=False, causal=True)


def test_a_step_reads_its_cache_and_every_weight():
    at_1k = step_bytes(LLAMA, 1024, "float32")
    assert at_1k.kv == 1025 * 4 * (128 + 128) * 4  # the context and the step's own token: 4,198,400 bytes
    assert at_1k.weights == (2048 * 2048 + 512 * 2048 + 512 * 2048 + 2048 * 2048) * 4 == 40 * MiB
    assert at_1k.other == 0  # no biases
    assert at_1k.total == 4_198_400 + 41_943_040
    assert round(at_1k.weights / at_1k.total, 3) == 0.909  # the 91% at 1k ...
    at_32k = step_bytes(LLAMA, 32768, "float32")
    assert round(at_32k.weights / at_32k.total, 3) == 0.238  # ... and 24% at 32k
    # The same weights as the first limit's weight column, which the headline left out.
    assert at_1k.weights == weight_bytes(2048, 16, 4, 128, 128, 4)
    assert at_1k.kv == kv_read_bytes(1, 1025, 4, 128, 128, 4)


def test_every_parameter_and_every_item_of_the_batch_is_counted():
    cfg = MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, d_k=4, causal=True, qk_norm="head", sinks=True)
    counted = step_bytes(cfg, 10, "float64", batch=2, step=3)
    assert counted.kv == 2 * 13 * 2 * (4 + 4) * 8  # B x (10 + 3 slots) x Hkv x (Dk + Dv) x 8 bytes = 3328
    assert counted.weights == (24 * 24 + 8 * 24 + 8 * 24 + 24 * 24) * 8 == 12288  # once, whatever the batch
    assert counted.other == (24 + 8 + 8 + 24 + 4 + 4 + 6) * 8  # b_q, b_k, b_v, b_o, q_norm, k_norm, sinks
    assert counted.parameters == counted.weights + counted.other


def test_a_window_reads_its_ring_only():
    cfg = MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, d_k=4, causal=True, window=5, bias=False)
    assert step_bytes(cfg, 100, "float32", step=2).kv == 6 * 2 * 8 * 4  # the ring: W - 1 + step = 6 slots
    assert step_bytes(cfg, 2, "float32", step=2).kv == 4 * 2 * 8 * 4  # a context shorter than the ring


@pytest.mark.parametrize(("name", "value"), [("context", -1), ("batch", 0), ("step", 1.0), ("context", True)])
def test_bad_sizes_are_refused_by_name(name, value):
    sizes = {"context": 8, "batch": 1, "step": 1, name: value}
    context = sizes.pop("context")
    with pytest.raises(ValueError, match=rf"{name} must be an int >= \d, got {value!r}"):
        step_bytes(LLAMA, context, "float32", **sizes)


def test_the_limit_is_the_bytes_over_the_bandwidth():
    counted = step_bytes(LLAMA, 1024, "float32")
    assert decode_limit_s(counted, 16.0) == pytest.approx(46_141_440 / 16e9, rel=1e-15)  # 2.88 ms at 16 GB/s
    assert decode_limit_s(46_141_440, 16.0) == decode_limit_s(counted, 16.0)
    assert decode_limit_s(counted, None) is None
    assert fits_in_cache(counted, 48 * MiB) is True and fits_in_cache(counted, 40 * MiB) is False
    assert fits_in_cache(counted, None) is None


def ticking(step_s: float):
    """A clock that advances ``step_s`` seconds each time it is read."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def test_the_read_bandwidth_is_bytes_over_the_median_read():
    reads = []
    result = read_bandwidth(8003, repeats=5, clock=ticking(0.5e-3), read=lambda array: reads.append(array.nbytes))
    assert reads == [8000] * 6  # whole float64 elements; one untimed read, then five timed ones
    assert result["array_bytes"] == 8000
    assert result["samples_s"] == pytest.approx([0.5e-3] * 5)
    assert result["gbps"] == pytest.approx(8000 / 0.5e-3 / 1e9)  # 0.016 GB/s
    assert result["best_gbps"] == pytest.approx(result["gbps"])
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        read_bandwidth(8000, repeats=0)
    with pytest.raises(ValueError, match="array_bytes must hold at least one float64"):
        read_bandwidth(7)


def test_the_cache_ends_where_reads_slow_to_memory_speed():
    # Made up, shaped like this machine's: fast up to 64 MiB, memory speed from 128 MiB (sysfs would say 480 MiB),
    # and one noisy figure at 512 MiB that reads faster than memory.
    curve = {MiB << n: gbps for n, gbps in enumerate((45, 48, 48, 48, 48, 35, 34, 16.9, 16.4, 19.9))}
    found = measure_llc(sorted(curve), bandwidth=curve.__getitem__)
    assert found["memory_gbps"] == 16.9  # the median of 16.9, 16.4 and 19.9
    assert found["llc_bytes"] == 64 * MiB  # 34 >= 1.25 x 16.9 = 21.1; 16.9 is not
    assert found["settled"] is True  # the tail spreads by 3.5 GB/s, under 25% of 16.9
    assert found["curve"][0] == [MiB, 45]
    noisy = measure_llc(sorted(curve), bandwidth={**curve, 512 * MiB: 22.0}.__getitem__)
    assert noisy["llc_bytes"] == 64 * MiB and noisy["settled"] is False  # 16.4 to 22.0: 5.6 GB/s, over 25%
    flat = measure_llc([MiB, 2 * MiB, 4 * MiB], bandwidth=lambda size: 15.0)
    assert flat["llc_bytes"] is None and flat["memory_gbps"] == 15.0 and flat["settled"] is True
    two = measure_llc([MiB, 2 * MiB], bandwidth={MiB: 40.0, 2 * MiB: 20.0}.__getitem__)
    assert two["llc_bytes"] == MiB and two["memory_gbps"] == 20.0  # the tail: the largest only
    with pytest.raises(ValueError, match="at least two array sizes"):
        measure_llc([MiB])


def test_a_slow_reading_at_a_small_size_does_not_end_the_cache_early():
    # The Xeon-like curve with one reading at 2 MiB slowed to memory speed (a loaded machine slows reads): the
    # first rule (the cache ends before the first slow size) said 1 MiB; the cache is still 64 MiB.
    curve = {MiB << n: gbps for n, gbps in enumerate((45, 16.0, 48, 48, 48, 35, 34, 16.9, 16.4, 19.9))}
    found = measure_llc(sorted(curve), bandwidth=curve.__getitem__)
    assert found["llc_bytes"] == 64 * MiB and found["memory_from_bytes"] == 128 * MiB


def test_the_cache_and_where_memory_speed_begins_on_an_epyc_like_curve():
    # Shaped like the AMD EPYC's sweep in docs/bench/decode.json (sysfs: a 32 MiB L3): fast to 16 MiB, 34 GB/s
    # at 32 MiB (partly cached: 1.11 x memory), memory speed from 64 MiB.
    gbps = (44.6, 48.5, 48.0, 50.5, 46.0, 34.0, 31.6, 30.1, 30.7, 31.6)
    curve = {MiB << n: value for n, value in enumerate(gbps)}
    found = measure_llc(sorted(curve), bandwidth=curve.__getitem__)
    assert found["memory_gbps"] == 30.7  # the median of 30.1, 30.7, 31.6
    assert found["llc_bytes"] == 16 * MiB  # 46.0 >= 1.25 x 30.7 = 38.4; 34.0 is not
    assert found["memory_from_bytes"] == 64 * MiB  # 31.6 < 1.10 x 30.7 = 33.8 <= 34.0
    # The array read is 4 x where memory speed begins, or the sweep's largest: past the 32 MiB L3 either way.
    assert limit_array_bytes(16 * MiB, memory_from=64 * MiB) == 2048 * MiB  # the sweep's largest, 2 GiB
    assert limit_array_bytes(16 * MiB, memory_from=256 * MiB, floor=8 * MiB) == 1024 * MiB
    # A fast reading in the tail (noise) neither moves the cache into the tail nor past memory's start.
    noisy = measure_llc(sorted(curve), bandwidth={**curve, 256 * MiB: 45.0}.__getitem__)
    assert noisy["llc_bytes"] == 16 * MiB and noisy["settled"] is False


def test_the_bandwidth_is_read_over_arrays_beyond_the_cache():
    assert limit_array_bytes(64 * MiB) == 2048 * MiB  # 4 x 64 MiB is under the sweep's largest (2 GiB)
    assert limit_array_bytes(600 * MiB) == 2400 * MiB
    assert limit_array_bytes(None, floor=8 * MiB) == 8 * MiB
    # One run on a clock ticking 1 ms a read: every size reads in 1 ms, so the largest reads fastest, no size
    # reads faster than memory, and the bandwidth is the largest array's bytes per millisecond.
    sizes = [8 * 1024, 16 * 1024, 32 * 1024]
    result = measure_read_limit(None, sizes=sizes, repeats=3, clock=ticking(1e-3))
    assert result["llc"]["llc_bytes"] is None
    assert result["read"]["array_bytes"] == 32 * 1024
    assert result["read_gbps"] == pytest.approx(32 * 1024 / 1e-3 / 1e9)
    assert result["llc"]["memory_from_bytes"] == 8 * 1024  # every size reads at the largest's speed or slower
    # The check fires: on this clock the largest array reads 1.33 x the tail's median (32.8 against 24.6 MB/s),
    # as an array still in the cache would.
    assert result["read"]["at_memory_speed"] is False
    assert result["cpus"] is None


def test_the_rounds_read_bandwidth_is_their_median_and_the_cache_their_smallest():
    from mha_rosetta.benchmarks.bandwidth import merge_bandwidths

    rounds = [
        {"device": "cpu", "gbps": 25.0, "read_gbps": 16.0, "measured_llc_bytes": 64 * 2**20},
        None,  # a round whose bandwidth was lost
        {"device": "cpu", "gbps": 24.0, "read_gbps": 17.0, "measured_llc_bytes": 32 * 2**20},
        {"device": "cpu", "gbps": 26.0, "read_gbps": 15.5, "measured_llc_bytes": 64 * 2**20},
    ]
    merged = merge_bandwidths(rounds)
    assert merged["gbps"] == 25.0 and merged["read_gbps"] == 16.0
    assert merged["round_read_gbps"] == [16.0, None, 17.0, 15.5]
    assert merged["measured_llc_bytes"] == 32 * 2**20  # a step that fits the smallest fits every round's
    assert merge_bandwidths([{"device": "cpu", "gbps": 25.0}])["read_gbps"] is None  # an old run: no read limit


def test_the_read_bandwidth_is_the_fastest_readers(monkeypatch):
    # Three made-up readers on a clock that each advances by its own step per read: the fastest (the smallest
    # step) gives the figure, and each reader's own figure is kept beside it. The arithmetic-bound reader
    # (``np.sum``'s pairwise additions on the 2026-12-06 Xeon) must not set the limit.
    import mha_rosetta.benchmarks.limits as limits

    now = [0.0]
    steps = {"slow": 2e-3, "fast": 0.5e-3, "middle": 1e-3}

    def reader(name):
        def read(array):
            now[0] += steps[name]  # a read takes its reader's step on the fake clock

        return read

    def clock():
        return now[0]

    monkeypatch.setattr(limits, "READ_KERNELS", {name: reader(name) for name in steps})
    result = limits.read_bandwidth(8000, repeats=3, clock=clock)
    assert result["kernel"] == "fast"
    assert result["gbps"] == pytest.approx(8000 / 0.5e-3 / 1e9)
    assert result["kernels"] == pytest.approx({name: 8000 / step / 1e9 for name, step in steps.items()})


def test_each_default_reader_reads_the_whole_array_once():
    # The real readers on a small array: each returns what a full pass over the array gives, so none skips bytes.
    import numpy as np

    from mha_rosetta.benchmarks.limits import GEMV_COLUMNS, READ_KERNELS

    array = np.arange(4 * GEMV_COLUMNS, dtype=np.float64)  # 32 KiB: the GEMV sees (8, 1024) float32 rows
    assert set(READ_KERNELS) == {"np.sum (float64)", "np.max (float32)", "BLAS GEMV (float32 rows)"}
    assert READ_KERNELS["np.sum (float64)"](array) == array.sum()
    assert READ_KERNELS["np.max (float32)"](array) is None  # it reads and discards
    result = read_bandwidth(array.nbytes, repeats=1)
    assert set(result["kernels"]) == set(READ_KERNELS) and result["kernel"] in READ_KERNELS
