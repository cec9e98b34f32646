"""hf-attention: Hugging Face's LlamaAttention / MistralAttention through DynamicCache / StaticCache, as generate.

Every run is held to `core.decode.reference_decode` (the full causal float64 forward). A float64 run is held to
float32's tolerance, the level the oracle declares (eager's float32 softmax and the rotary module's float32
angles), and a test proves that the declaration is needed: the same run misses float64's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
pytest.importorskip("transformers", reason="transformers is not installed: pip install 'mha-rosetta[models]'")

from mha_rosetta.backends import UnsupportedCase, get_backend
from mha_rosetta.backends.oracles.hf_cache import Driver
from mha_rosetta.core import MHAConfig, compare, init_params, reference_mha
from mha_rosetta.core.decode import (
    CacheFull,
    decode_stage_names,
    prepare_decode_inputs,
    reference_decode,
    reference_decode_stages,
    ring_capacity,
)

CACHES = ("dynamic", "static")
GQA = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half")  # LlamaAttention, biases on
WINDOW = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", window=3, bias=False)  # Mistral
LLAMA3 = MHAConfig(
    d_model=16,
    n_heads=4,
    n_kv_heads=2,
    causal=True,
    rope="half",
    bias=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
)
LEFT = np.array([[False, False, True, True, True, True, True, True, True], [True] * 9])  # 2 left pads in item 0
RIGHT = np.array([[True] * 7 + [False] * 2, [True] * 9])  # 2 right pads in item 0

# (cfg, prefill, step, mask): prefill 1 and N, two tokens per step, a window the sequence outgrows with a prefill
# shorter (2) and longer (6) than its ring (W - 1 + step = 3 or 4 slots), left and right padding, llama3 scaling.
CASES = {
    "gqa_prefill1": (GQA, 1, 1, None),
    "gqa_prefill_all": (GQA, 9, 1, None),
    "gqa_two_per_step": (GQA, 3, 2, None),
    "window_prefill_shorter": (WINDOW, 2, 1, None),
    "window_prefill_longer_two_per_step": (WINDOW, 6, 2, None),
    "gqa_left_padded": (GQA, 3, 1, LEFT),
    "window_left_padded": (WINDOW, 4, 2, LEFT),
    "gqa_right_padded": (GQA, 3, 1, RIGHT),
    "llama3_scaling": (LLAMA3, 2, 1, None),
}


@pytest.fixture(scope="module")
def oracle():
    return get_backend("hf-attention")


def _x(batch: int = 2, tokens: int = 9, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, 16))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", list(CASES))
def test_run_decode_equals_the_full_causal_forward(oracle, case, cache):
    cfg, prefill, step, mask = CASES[case]
    params, x = init_params(cfg, seed=1), _x()
    prepared, _ = oracle.prepare_decode_run(cfg, params, x, prefill=prefill, step=step, mask=mask, cache=cache)
    expected = reference_decode(cfg, params, x, prefill=prefill, step=step, mask=mask)
    result = compare(prepared.output(), expected, prepared.info["tolerance_dtype"])
    assert prepared.info["tolerance_dtype"] == "float32"  # a float64 run, at the level the oracle declares
    assert result.ok, result.summary()
    # a left pad's query has no key: eager averages uniformly there, the oracle maps it and says how many
    assert prepared.info["empty_rows_mapped"] == (2 if mask is LEFT else 0)


def test_a_float64_run_is_float32_level_as_declared(oracle):
    cfg, prefill, step, _ = CASES["gqa_two_per_step"]
    params, x = init_params(cfg, seed=1), _x()
    expected = reference_decode(cfg, params, x, prefill=prefill, step=step)
    output = oracle.run_decode(cfg, params, x, prefill=prefill, step=step)
    assert not compare(output, expected, "float64").ok  # float32 inside: the declaration is needed
    assert compare(output, expected, "float32").ok
    assert any("float32 inside a float64 module" in line for line in oracle.known_differences)


@pytest.mark.parametrize("cache", CACHES)
def test_a_float32_module_agrees_at_float32(oracle, cache):
    cfg, prefill, step, mask = CASES["window_left_padded"]
    params, x = init_params(cfg, seed=1), _x()
    prepared, _ = oracle.prepare_decode_run(
        cfg, params, x, prefill=prefill, step=step, mask=mask, cache=cache, dtype="float32"
    )
    assert "tolerance_dtype" not in prepared.info
    result = compare(
        prepared.output(), reference_decode(cfg, params, x, prefill=prefill, step=step, mask=mask), "float32"
    )
    assert result.ok, result.summary()


@pytest.mark.parametrize("cache, stored", [("dynamic", 2), ("static", 3)])  # W - 1 kept, or W slots
@pytest.mark.parametrize("step", [1, 2])
def test_the_window_is_the_librarys_ring_of_w_minus_1_plus_step_slots(oracle, cache, stored, step):
    params, x = init_params(WINDOW, seed=1), _x(tokens=11)
    prepared, _ = oracle.prepare_decode_run(WINDOW, params, x, prefill=2, step=step, cache=cache)
    info = prepared.info["cache"]
    assert info["kind"] == cache
    assert info["slots"] == ring_capacity(WINDOW, step)  # measured: the weights' key axis, W - 1 + step
    assert info["stored_slots"] == stored  # O(W) for an 11-token sequence
    assert info["bytes"] == 2 * 2 * WINDOW.n_kv_heads * stored * WINDOW.d_k * 8  # K and V, B=2, float64
    assert "SlidingWindowLayer" in info["layout"]


@pytest.mark.parametrize("cache", CACHES)
def test_without_a_window_the_cache_holds_every_token(oracle, cache):
    params, x = init_params(GQA, seed=1), _x()
    prepared, _ = oracle.prepare_decode_run(GQA, params, x, prefill=3, step=2, cache=cache)
    assert prepared.info["cache"]["slots"] == 9
    # DynamicLayer grows to N; StaticLayer is allocated at max_cache_len = N from the start
    assert prepared.info["cache"]["stored_slots"] == 9


@pytest.mark.parametrize("cache", CACHES)
def test_each_steps_stages_agree_with_the_full_forwards(oracle, cache):
    params, x = init_params(WINDOW, seed=1), _x()
    prepared, inputs = oracle.prepare_decode_run(WINDOW, params, x, prefill=6, step=2, cache=cache)
    stages, expected = oracle.decode_stages(prepared, WINDOW), reference_decode_stages(WINDOW, params, inputs)
    assert len(stages) == len(expected) == len(inputs.chunks()) == 3
    for index, (got, want) in enumerate(zip(stages, expected, strict=True)):
        assert set(got) == set(want) == set(decode_stage_names(WINDOW))
        for name in want:
            result = compare(got[name], want[name], "float32")
            assert result.ok, f"chunk {index}, stage {name}: {result.summary()}"


def test_a_static_cache_past_its_capacity_is_cache_full():
    params, x = init_params(GQA, seed=1), _x()
    inputs = prepare_decode_inputs(GQA, x, prefill=3, step=2)
    with pytest.raises(CacheFull, match="holds 3 of 4 slots and cannot take 2 more"):
        Driver(GQA, params, "float64").decode(inputs, "static", capacity=4)


@pytest.mark.parametrize(
    "cfg, options, reason",
    [
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="half", softcap=30.0), {}, "does not implement softcap"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="half", qk_norm="head"), {}, "qk_norm_head"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="interleaved"), {}, "LlamaAttention applies rope='half'"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="half", rope_dims=2), {}, "rotates every feature"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="half", bias="qkv"), {}, "does not implement qkv_bias"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="half", window=3), {}, "MistralAttention has no biases"),
        (GQA, {"cache": "paged"}, "no 'paged' cache"),
        (GQA, {"strategy": "per_head"}, "standard strategy only"),
        (GQA, {"dtype": "float16"}, "does not support float16"),
    ],
)
def test_what_the_modules_cannot_express_is_unsupported_with_the_reason(oracle, cfg, options, reason):
    with pytest.raises(UnsupportedCase, match=reason):
        oracle.run_decode(cfg, init_params(cfg), _x(), prefill=2, **options)


def test_positions_the_index_masks_cannot_follow_are_refused(oracle):
    positions = np.array([0, 1, 2, 2, 3, 4, 5, 6, 7])  # two tokens at position 2 see each other in the spec
    with pytest.raises(ValueError, match="strictly increase"):  # core.decode refuses them for every cache
        oracle.run_decode(GQA, init_params(GQA), _x(), prefill=2, positions=positions)


def test_the_forward_follows_positions_with_gaps(oracle):
    params, x = init_params(GQA, seed=1), _x(tokens=5)
    positions = np.array([0, 2, 3, 7, 8])  # increasing, so causal on indices; not one sequence of steps of one
    output = oracle.run(GQA, params, x, positions=positions, dtype="float32")
    assert compare(output, reference_mha(GQA, params, x, positions=positions), "float32").ok


def test_the_forward_is_the_full_causal_forward_in_float32(oracle):
    params, x = init_params(WINDOW, seed=1), _x()
    mask = LEFT[:, None, None, :]  # (B, 1, 1, N): key padding
    output = oracle.run(WINDOW, params, x, mask=mask, dtype="float32")
    expected = reference_mha(WINDOW, params, x, mask=mask)
    real = LEFT[:, :, None]  # the pads' rows have no key: eager averages uniformly there (declared)
    assert compare(np.where(real, output, 0.0), np.where(real, expected, 0.0), "float32").ok
    with pytest.raises(UnsupportedCase, match="forward runs in float32 only"):
        oracle.run(WINDOW, params, x, dtype="float64")


@pytest.mark.parametrize("cache", CACHES)
def test_the_bench_step_reads_the_cache_it_says(oracle, cache):
    params = init_params(GQA, seed=1)
    prepared = oracle.prepare_decode(GQA, params, context=6, step=1, cache=cache, dtype="float32")
    first, again = prepared.output(), prepared.output()
    assert first.shape == (1, 1, 16)
    np.testing.assert_array_equal(first, again)  # the cache is cut back to its 6 tokens after each step
    assert prepared.info["cache"]["slots"] == 7
    ring = oracle.prepare_decode(WINDOW, init_params(WINDOW), context=8, step=2, cache=cache)
    assert ring.info["cache"]["slots"] == ring_capacity(WINDOW, 2)


@pytest.mark.parametrize("cache", CACHES)
def test_the_bench_step_fills_its_cache_in_blocks_with_the_same_numbers(oracle, cache, monkeypatch):
    """The benchmark's prefill goes through the module a block at a time (memory O(block x context)):
    the step after it reads the same cache as after one whole prefill."""
    from mha_rosetta.backends.oracles import hf_cache

    params = init_params(GQA, seed=2)
    whole = oracle.prepare_decode(GQA, params, context=10, step=1, cache=cache, dtype="float64").output()
    monkeypatch.setattr(hf_cache, "PREFILL_BLOCK", 3)  # 10 tokens in blocks of 3, 3, 3, 1
    blocks = oracle.prepare_decode(GQA, params, context=10, step=1, cache=cache, dtype="float64").output()
    assert np.max(np.abs(blocks - whole)) < 1e-6  # float32 softmax and rotary inside the module


def test_the_decode_check_holds_a_float64_run_to_the_declared_float32_level(oracle):
    from mha_rosetta.backends import get_backend as backend
    from mha_rosetta.checks import Status, run_check

    result = run_check(backends=[oracle, backend("numpy")], cases=["gqa_rotary"], dtypes=["float64"], kind="decode")
    runs = [run for run in result.runs if run.impl.backend == "hf-attention"]
    assert [run.impl.cache for run in runs] == ["dynamic", "static"]
    assert all(run.status is Status.KNOWN_DIFFERENCE and "float32's level" in run.reason for run in runs)
    assert all(run.max_abs > 1e-10 for run in runs)  # beyond float64's tolerance: the declaration is needed
    pairs = [pair for pair in result.pairs if "hf-attention" in (pair.a.impl.backend, pair.b.impl.backend)]
    assert pairs and all(pair.status in (Status.KNOWN_DIFFERENCE, Status.AGREE) for pair in pairs)
    assert any(pair.status is Status.KNOWN_DIFFERENCE for pair in pairs)  # hf-attention against numpy
    assert result.exit_status == 0
