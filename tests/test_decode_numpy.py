"""The NumPy adapter's KV-cache decoding (`backends.numpy.decode`): keys stay columns, a step appends columns.

Every run equals the full causal forward (`core.decode.reference_decode`) for every split, case,
variant and dtype; the step stages equal the full forward's chunk by chunk; the cache holds the
keys after QK-norm and rotary, before the GQA repeat, as (B, Hkv, Dk, T) columns; a window is a
ring of ``ring_capacity`` columns; a static cache refuses to overflow.
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_property_cases import (
    DECODE_CASES,
    SPLITS,
    TOKENS,
    VARIANT_CFGS,
    assert_decode_matches,
    assert_variant_decodes,
    decode_run_inputs,
)

from mha_rosetta.backends.base import STANDARD, UnsupportedCase
from mha_rosetta.backends.numpy.adapter import NumpyBackend
from mha_rosetta.backends.numpy.common import NumpyPrecision
from mha_rosetta.backends.numpy.decode import ColumnCache, ColumnSampleDecoder, grown_capacity
from mha_rosetta.core import MHAConfig, init_params, reference_stages
from mha_rosetta.core.decode import CacheFull, prepare_decode_inputs, ring_capacity
from mha_rosetta.core.variants import adapted_variants

BACKEND = NumpyBackend()
CACHES = ("columns", "static")


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"prefill{s[0]}-step{s[1]}")
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("cache", CACHES)
def test_decode_equals_the_full_forward_float64(case, split, cache):
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    assert_decode_matches(BACKEND, cfg, x, mask, *split, "float64", cache=cache)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", ["gqa_rope_half", "window_outgrown", "left_padded", "partial_interleaved"])
def test_decode_equals_the_full_forward_in_lower_precision(case, dtype):
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    for split in [(1, 1), (6, 2)]:
        prepared = assert_decode_matches(BACKEND, cfg, x, mask, *split, dtype)
        assert prepared.info["storage_dtype"] == dtype
        itemsize = NumpyPrecision.for_dtype(dtype).storage.itemsize
        slots = prepared.info["cache"]["slots"]
        assert prepared.info["cache"]["bytes"] == x.shape[0] * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * itemsize


def test_every_variant_is_declared_for_decoding():
    # and MLA's, decoded in its naive and absorbed strategies through the latent cache (tests/test_mla_adapters.py)
    assert adapted_variants("numpy") == BACKEND.decode_variants
    covered = {name for cfg in VARIANT_CFGS.values() for name in cfg.variants}
    assert covered == adapted_variants("numpy", strategy=STANDARD)  # the cases below: each one the standard path runs


@pytest.mark.parametrize("split", [(1, 1), (2, 2), (6, 1)], ids=lambda s: f"prefill{s[0]}-step{s[1]}")
@pytest.mark.parametrize("variant", sorted(VARIANT_CFGS))
def test_decode_with_each_variant(variant, split):
    assert_variant_decodes(BACKEND, variant, *split)


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("cache", CACHES)
def test_a_window_is_a_ring_of_w_minus_1_plus_step_columns(cache, step):
    cfg, _ = DECODE_CASES["window_outgrown"]
    x, _ = decode_run_inputs(cfg, None)
    prepared = assert_decode_matches(BACKEND, cfg, x, None, 2, step, "float64", cache=cache)
    ring = ring_capacity(cfg, step)
    assert prepared.info["cache"]["slots"] == ring == cfg.window - 1 + step < TOKENS  # O(W), not O(N)
    assert prepared.info["cache"]["bytes"] == 2 * 2 * cfg.n_kv_heads * ring * cfg.d_k * 8  # B=2, float64


def _run_by_hand(cfg, x, prefill, step, kind, mask=None):
    """A decode run through `ColumnSampleDecoder` chunk by chunk, returning the cache as it ends."""
    inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step, mask=mask)
    params = init_params(cfg, seed=3)
    decoder = ColumnSampleDecoder(cfg, params, inputs.x, inputs.positions, NumpyPrecision.for_dtype("float64"))
    capacity = prefill if kind == "columns" else TOKENS
    cache = decoder.new_cache(kind, capacity, step)
    for start, stop in inputs.chunks():
        tokens = slice(start, stop)
        decoder.chunk(cache, tokens, inputs.positions[:, tokens], inputs.valid[:, tokens])
    full = reference_stages(cfg, params, inputs.x, mask=inputs.forward_mask(), positions=inputs.positions)
    return cache, full


@pytest.mark.parametrize("kind", CACHES)
def test_the_cache_holds_rotated_normed_keys_as_columns_of_hkv_heads(kind):
    # QK-norm and rotary before caching, GQA repeat after: the cache's column t is the full forward's key t.
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="interleaved", qk_norm="head")
    x, _ = decode_run_inputs(cfg, None)
    cache, full = _run_by_hand(cfg, x, 3, 2, kind)
    assert cache.keys.shape[:3] == (2, cfg.n_kv_heads, cfg.d_k)  # (B, Hkv, Dk, T): Hkv heads, tokens last
    assert cache.values.shape[:3] == (2, cfg.n_kv_heads, cfg.d_v)
    keys, values, positions, valid = cache.columns()
    assert keys.shape[-1] == TOKENS and valid.all()
    np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(TOKENS), (2, TOKENS)))
    # canonical k_rotated (B, Hkv, Nk, Dk) -> columns (B, Hkv, Dk, Nk)
    np.testing.assert_allclose(keys, full["k_rotated"].transpose(0, 1, 3, 2), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(values, full["v_heads"].transpose(0, 1, 3, 2), rtol=1e-12, atol=1e-13)


def test_a_wrapped_ring_holds_the_last_tokens_at_t_mod_slots():
    cfg, _ = DECODE_CASES["window_outgrown"]
    x, _ = decode_run_inputs(cfg, None)
    cache, full = _run_by_hand(cfg, x, 5, 1, "columns")  # prefill 5 > ring 3: it keeps its last columns
    ring = cache.ring
    assert ring == cache.slots == 3
    for t in range(TOKENS - ring, TOKENS):
        np.testing.assert_allclose(cache.keys[..., t % ring], full["k_rotated"][:, :, t], rtol=1e-12, atol=1e-13)
        assert (cache.positions[:, t % ring] == t).all()


def test_a_growing_cache_doubles_and_info_says_what_it_holds():
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    x, _ = decode_run_inputs(cfg, None)
    cache, _ = _run_by_hand(cfg, x, 1, 1, "columns")
    assert (cache.slots, cache.reallocations) == (16, 4)  # 1 -> 2 -> 4 -> 8 -> 16 for 9 tokens
    assert grown_capacity(1, range(1, TOKENS + 1)) == (16, 4)
    # A write longer than the doubling grows to its end: prefill 1, then 4 tokens at once.
    assert grown_capacity(1, [1, 5, 9]) == (10, 2)
    params = init_params(cfg, seed=3)
    prepared, _ = BACKEND.prepare_decode_run(cfg, params, x, prefill=1, step=1)
    assert prepared.info["cache"]["slots"] == 16 and prepared.info["reallocations"] == 4
    assert prepared.info["cache"]["kind"] == "columns" and prepared.info["cache"]["layout"].startswith(
        "(B, Hkv, Dk, T)"
    )
    assert prepared.info["cache"]["bytes"] == 2 * 2 * cfg.n_kv_heads * 16 * cfg.d_k * 8


def test_a_static_cache_refuses_to_overflow():
    cache = ColumnCache("static", 1, 2, 4, 3, np.float64, capacity=4)
    keys, values = np.ones((1, 2, 4, 3)), np.ones((1, 2, 3, 3))
    cache.write(keys, values, np.arange(3)[None], np.ones((1, 3), bool))
    with pytest.raises(CacheFull, match=r"holds 3 of 4 slots and cannot take 3 more"):
        cache.write(keys, values, np.arange(3, 6)[None], np.ones((1, 3), bool))
    assert cache.written == 3  # nothing was written
    grown = ColumnCache("columns", 1, 2, 4, 3, np.float64, capacity=4)
    grown.write(keys, values, np.arange(3)[None], np.ones((1, 3), bool))
    grown.write(2 * keys, values, np.arange(3, 6)[None], np.ones((1, 3), bool))
    assert grown.slots == 8 and grown.reallocations == 1
    np.testing.assert_array_equal(grown.columns()[0][..., :3], keys)  # the old columns survive the doubling
    np.testing.assert_array_equal(grown.columns()[0][..., 3:], 2 * keys)
    with pytest.raises(ValueError, match=r"kind must be one of columns, static, got 'paged'"):
        ColumnCache("paged", 1, 2, 4, 3, np.float64, capacity=4)
    with pytest.raises(ValueError, match=r"capacity must be an int >= 1 .* got 0"):
        ColumnCache("static", 1, 2, 4, 3, np.float64, capacity=0)


def test_unsupported_strategy_and_cache_are_refused_with_the_reason():
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    params = init_params(cfg)
    x, _ = decode_run_inputs(cfg, None)
    with pytest.raises(
        UnsupportedCase, match=r"numpy decodes with the standard, naive, absorbed strategies only, not 'per_head'"
    ):
        BACKEND.run_decode(cfg, params, x, prefill=2, strategy="per_head")
    with pytest.raises(UnsupportedCase, match=r"numpy has no 'rolling' cache \(it has columns, static, paged\)"):
        BACKEND.run_decode(cfg, params, x, prefill=2, cache="rolling")


def test_bad_decode_input_is_an_error_naming_the_argument():
    cfg, _ = DECODE_CASES["window_outgrown"]
    params = init_params(cfg)
    x, _ = decode_run_inputs(cfg, None)
    with pytest.raises(ValueError, match=r"prefill must be between 1 and the sequence's 9 tokens, got 0"):
        BACKEND.run_decode(cfg, params, x, prefill=0)
    with pytest.raises(ValueError, match=r"step must be at least 1"):
        BACKEND.run_decode(cfg, params, x, prefill=1, step=0)
    with pytest.raises(ValueError, match=r"positions must not go backwards"):
        BACKEND.run_decode(cfg, params, x, prefill=1, positions=np.array([0, 1, 2, 1, 4, 5, 6, 7, 8]))
    gap = np.ones((2, TOKENS), dtype=bool)
    gap[0, 4] = False  # a pad followed by more real tokens: positions no longer advance by one per slot
    with pytest.raises(ValueError, match=r"pad on the left instead"):
        BACKEND.run_decode(cfg, params, x, prefill=1, mask=gap)


def test_unbatched_input_gives_unbatched_output():
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    params = init_params(cfg, seed=3)
    x, _ = decode_run_inputs(cfg, None)
    batched = BACKEND.run_decode(cfg, params, x, prefill=2, step=2)
    single = BACKEND.run_decode(cfg, params, x[1], prefill=2, step=2)
    assert single.shape == (TOKENS, cfg.d_model)
    np.testing.assert_allclose(single, batched[1], rtol=1e-12, atol=1e-13)


def test_step_stages_have_column_sample_axes():
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    x, _ = decode_run_inputs(cfg, None)
    prepared, _ = BACKEND.prepare_decode_run(cfg, init_params(cfg), x, prefill=3, step=2)
    chunks = prepared.step_stages()
    assert len(chunks) == 4  # the prefill of 3, then 2 + 2 + 2
    assert chunks[0]["q"].axes == ("B", "H*Dk", "Nq") and chunks[0]["q"].value.shape == (2, 16, 3)
    assert chunks[1]["k_rotated"].axes == ("B", "Hkv", "Dk", "Nk") and chunks[1]["k_rotated"].value.shape == (
        2,
        2,
        4,
        2,
    )
    assert chunks[-1]["output"].axes == ("B", "D", "Nq")


# -- the benchmark's step: one step of `step` tokens on a cache already holding `context` ---------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    ("cfg", "context", "step", "cache"),
    [
        (MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half"), 37, 1, "columns"),
        (MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, d_v=3), 20, 2, "static"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, window=5, rope="half"), 50, 2, "columns"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, alibi=True), 0, 1, "columns"),
    ],
    ids=["gqa", "d_v", "window", "empty"],
)
def test_the_benchmark_step_runs_and_reports_the_cache_bytes(cfg, context, step, cache, dtype):
    batch = 2
    prepared = BACKEND.prepare_decode(
        cfg, init_params(cfg), context=context, batch=batch, step=step, dtype=dtype, cache=cache
    )
    first = prepared.output()
    assert first.shape == (batch, step, cfg.d_model) and np.isfinite(first).all()
    np.testing.assert_array_equal(prepared.output(), first)  # every timed call is the same step at the same context
    info = prepared.info["cache"]
    slots = ring_capacity(cfg, step) if cfg.window else context + step
    itemsize = np.dtype(dtype).itemsize
    assert info["slots"] == slots and info["kind"] == cache
    assert info["bytes"] == batch * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * itemsize
    if cfg.d_k == cfg.d_v:
        assert info["bytes"] == 2 * batch * cfg.n_kv_heads * slots * cfg.d_k * itemsize
    stages = prepared.native_stages()
    assert stages["k_rotated"].value.shape == (batch, cfg.n_kv_heads, cfg.d_k, step)


def test_the_benchmark_step_on_an_empty_cache_is_a_prefill_of_its_tokens():
    # context 0: nothing random is cached, so the step is the forward of its own tokens (drawn from the seed).
    cfg = MHAConfig(d_model=8, n_heads=2, n_kv_heads=1, causal=True, rope="half", softcap=3.0)
    params = init_params(cfg)
    prepared = BACKEND.prepare_decode(cfg, params, context=0, batch=2, step=3, dtype="float64", seed=7)
    x = np.random.default_rng(7).standard_normal((2, 3, cfg.d_model))
    expected = BACKEND.run_decode(cfg, params, x, prefill=3)
    np.testing.assert_allclose(prepared.output(), expected, rtol=1e-12, atol=1e-13)
