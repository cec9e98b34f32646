"""KV-cache decoding on the sharded backends: jax-sharded (a static cache split by kv head over simulated
devices, one shard_map prefill and one step program) and torch-tp (each gloo rank its heads' Hugging Face
cache through a whole run, one all-reduce per chunk).

The property (`core.decode`): prefill, then steps through each rank's own cache slice, equals the full
causal forward (`reference_decode`) within the dtype's tolerance, for the shared property cases
(`decode_property_cases`: GQA + rotary half and partial interleaved, a window outgrown by prefills shorter
and longer than its ring, two and three tokens per step, left- and right-padded batches, prefill=1 and
prefill=N), every variant, and fewer kv heads than ranks (kv heads replicated). Plus the step stages
gathered from the ranks chunk by chunk, the ring's O(W) slots, jax-sharded's compile counts and the
reasons where a strategy, cache or head split cannot decode.

Each backend's worker processes start once per module (module-scoped fixtures): a torch-tp group start
costs seconds, and jax-sharded's worker keeps its compiled programs between tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_property_cases import DECODE_CASES, SPLITS, TOKENS, VARIANT_CFGS, assert_decode_matches, decode_run_inputs

from conftest import requires
from mha_rosetta.backends import STANDARD, UnsupportedCase
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.core import MHAConfig, init_params
from mha_rosetta.core.decode import ring_capacity
from mha_rosetta.core.variants import adapted_variants

MANUAL = "manual"


@pytest.fixture(scope="module")
def jax_sharded():
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    backend = JaxShardedBackend()  # the largest world up to 8 devices that splits each case's heads
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def jax_sharded_4():
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    backend = JaxShardedBackend(world=4)  # 4 devices: 2 kv heads each replicated on 2 of them
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def torch_tp():
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    backend = TorchTPBackend(world=2)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def torch_tp_4():
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    backend = TorchTPBackend(world=4)  # 4 ranks: 2 kv heads each replicated on 2 of them (manual only)
    yield backend
    backend.close()


def _runs_or_says_why(backend, cfg, strategy=STANDARD, cache=None) -> bool:
    """True when ``backend`` decodes ``cfg``; else its reason must name the head split it cannot make."""
    reason = backend.decode_reason(cfg, "float64", "cpu", strategy, cache)
    if reason is None:
        return True
    assert "does not divide" in reason, reason
    return False


# -- jax-sharded ------------------------------------------------------------------------------------
@requires("jax")
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_jax_sharded_decode_equals_the_full_causal_forward(jax_sharded, case):
    assert (TOKENS, 1) in SPLITS and (1, 1) in SPLITS  # prefill=N and prefill=1
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    assert _runs_or_says_why(jax_sharded, cfg)
    for prefill, step in SPLITS:
        prepared = assert_decode_matches(jax_sharded, cfg, x, mask, prefill, step, "float64")
        assert prepared.info["devices"] == jax_sharded.world_for(cfg) > 1


@requires("jax")
@pytest.mark.parametrize("variant", sorted(VARIANT_CFGS))
def test_jax_sharded_decode_of_each_variant(jax_sharded, variant):
    cfg = VARIANT_CFGS[variant]
    x, mask = decode_run_inputs(cfg, None)
    assert_decode_matches(jax_sharded, cfg, x, mask, 5, 2, "float64")


@requires("jax")
def test_jax_sharded_declares_every_variant_it_tests():
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    # Every variant; MLA's (`Variant.strategies`) in its naive and absorbed strategies only, tested in
    # tests/test_sharded_mla.py; the standard strategy decodes the rest, tested here.
    assert JaxShardedBackend.decode_variants == adapted_variants("jax")
    assert {name for cfg in VARIANT_CFGS.values() for name in cfg.variants} == adapted_variants(
        "jax", strategy=STANDARD
    )
    assert JaxShardedBackend.decode_caches == ("static",)
    assert JaxShardedBackend.decode_strategies == (STANDARD, *MLA_STRATEGIES)


@requires("jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_sharded_decode_in_lower_precision(jax_sharded, dtype):
    cfg, padding = DECODE_CASES["left_padded_window"]
    x, mask = decode_run_inputs(cfg, padding)
    assert_decode_matches(jax_sharded, cfg, x, mask, 2, 2, dtype)


@requires("jax")
@pytest.mark.parametrize("case", ["gqa_rope_half", "window_outgrown", "left_padded"])
def test_jax_sharded_decode_with_fewer_kv_heads_than_devices(jax_sharded_4, case):
    cfg, padding = DECODE_CASES[case]
    assert cfg.n_kv_heads == 2
    x, mask = decode_run_inputs(cfg, padding)
    for prefill, step in [(1, 1), (6, 2)]:
        prepared = assert_decode_matches(jax_sharded_4, cfg, x, mask, prefill, step, "float64")
        assert prepared.info["plan"] == "4 ranks x 1 query head(s), each kv head replicated on 2 ranks"


@requires("jax")
@pytest.mark.parametrize(("prefill", "step"), [(2, 1), (6, 2), (9, 1)])
def test_jax_sharded_window_keeps_a_ring_of_w_minus_1_plus_step_slots_per_device(jax_sharded, prefill, step):
    cfg, _ = DECODE_CASES["window_outgrown"]  # W = 3, 9 tokens, 4 heads on 4 devices, 2 kv heads
    x, _ = decode_run_inputs(cfg, None)
    prepared = assert_decode_matches(jax_sharded, cfg, x, None, prefill, step, "float64", stages=False)
    cache = prepared.info["cache"]
    assert cache["slots"] == ring_capacity(cfg, step) == cfg.window - 1 + step < TOKENS  # O(W), not O(N)
    assert cache["kind"] == "static" and cache["layout"] == "(B, T, Hkv_local, Dk) per device"
    world = prepared.info["devices"]
    assert world == 4  # 2 kv heads over 4 devices: one kv head per device, each on 2 devices
    # K and V of B=2 items, one kv head of d_k = d_v = 4 per device, float64
    assert cache["bytes_per_device"] == 2 * cache["slots"] * 1 * (4 + 4) * 8
    assert cache["bytes"] == world * cache["bytes_per_device"]


@requires("jax")
def test_jax_sharded_12_token_decode_compiles_one_prefill_and_one_step(jax_sharded):
    # A configuration no other test decodes: the programs are shared within the worker (by cfg, world, slots).
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", rope_base=321.0)
    params = init_params(cfg, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 12, cfg.d_model))
    prepared, _ = jax_sharded.prepare_decode_run(cfg, params, x, prefill=3, step=1)
    assert prepared.info["compilations"] == {"prefill": 0, "step": 0}  # nothing traced before the run
    prepared.output()  # 1 prefill + 9 steps
    assert prepared.info["compilations"] == {"prefill": 1, "step": 1}
    prepared.output()  # again: both programs found compiled
    assert prepared.info["compilations"] == {"prefill": 0, "step": 0}
    # Another run of the same shapes, prepared anew: still nothing to compile.
    again, _ = jax_sharded.prepare_decode_run(cfg, params, x, prefill=3, step=1)
    again.output()
    assert again.info["compilations"] == {"prefill": 0, "step": 0}
    # Two tokens per step (3 + 2 + 2 + 2 + 2 + 1): the prefill and the last step of 1 are compiled; 2 is new.
    two, _ = jax_sharded.prepare_decode_run(cfg, params, x, prefill=3, step=2)
    two.output()
    assert two.info["compilations"] == {"prefill": 0, "step": 1}


@requires("jax")
def test_jax_sharded_unsupported_decode_says_why(jax_sharded):
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    params, (x, _) = init_params(cfg), decode_run_inputs(cfg, None)
    with pytest.raises(
        UnsupportedCase, match="decodes with the standard, naive, absorbed strategies only, not 'named_sharding'"
    ):
        jax_sharded.run_decode(cfg, params, x, prefill=2, strategy="named_sharding")
    with pytest.raises(UnsupportedCase, match=r"has no 'dynamic' cache \(it has static\)"):
        jax_sharded.run_decode(cfg, params, x, prefill=2, cache="dynamic")
    with pytest.raises(ValueError, match="prefill must be between 1 and the sequence's 9 tokens, got 0"):
        jax_sharded.run_decode(cfg, params, x, prefill=0)


@requires("jax")
@pytest.mark.parametrize("case", ["gqa_rope_half", "window_outgrown"])
def test_jax_sharded_benchmark_step_is_the_jax_adapters_step_split_by_heads(jax_sharded, case):
    """One seed gives jax and jax-sharded the same step on the same cache (each device its kv heads' slice)."""
    from mha_rosetta.backends import get_backend
    from mha_rosetta.core import assert_close

    cfg, _ = DECODE_CASES[case]
    params = init_params(cfg, seed=0)
    options = {"context": 20, "batch": 2, "step": 2, "dtype": "float64", "seed": 4}
    expected = get_backend("jax").prepare_decode(cfg, params, **options).output()  # (B, 2, D)
    prepared = jax_sharded.prepare_decode(cfg, params, **options)
    first, second = prepared.output(), prepared.output()
    assert_close(first, expected, "float64", what="jax-sharded's benchmark step")
    np.testing.assert_array_equal(first, second)  # not donated: the same step on the same cache
    assert prepared.info["compilations"] == {"step": 1}  # compiled ahead, called twice
    info = prepared.info["cache"]
    assert info["slots"] == (22 if cfg.window is None else ring_capacity(cfg, 2))
    assert info["bytes"] == prepared.info["devices"] * info["bytes_per_device"]
    stages = jax_sharded.canonical_stages(prepared)
    assert_close(stages["output"], expected, "float64", what="the step's stages' output")
    assert stages["k_rotated"].shape == (2, cfg.n_kv_heads, 2, cfg.d_k)  # the new keys of every kv head, once


@requires("jax")
def test_jax_sharded_refuses_heads_that_do_not_split(jax_sharded_4):
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True)
    reason = jax_sharded_4.decode_reason(cfg, "float64", "cpu", STANDARD, None)
    assert reason is not None and "jax-sharded: world=4 does not divide n_heads=3" in reason


# -- torch-tp -----------------------------------------------------------------------------------------
@requires("torch")
@pytest.mark.parametrize("strategy", [STANDARD, MANUAL])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_torch_tp_decode_equals_the_full_causal_forward(torch_tp, case, strategy):
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    if not _runs_or_says_why(torch_tp, cfg, strategy):  # 3 heads on 2 ranks: the reason names the split
        return
    for cache in torch_tp.decode_caches:
        for prefill, step in SPLITS:
            prepared = assert_decode_matches(
                torch_tp, cfg, x, mask, prefill, step, "float64", strategy=strategy, cache=cache
            )
            assert prepared.info["world"] == 2 and prepared.info["cache"]["kind"] == cache


@requires("torch")
@pytest.mark.parametrize("strategy", [STANDARD, MANUAL])
@pytest.mark.parametrize("variant", sorted(VARIANT_CFGS))
def test_torch_tp_decode_of_each_variant(torch_tp, variant, strategy):
    cfg = VARIANT_CFGS[variant]
    x, mask = decode_run_inputs(cfg, None)
    for prefill, step in [(1, 1), (5, 2)]:
        assert_decode_matches(torch_tp, cfg, x, mask, prefill, step, "float64", strategy=strategy, cache="static")


@requires("torch")
def test_torch_tp_declares_what_it_tests():
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    assert TorchTPBackend.decode_variants == adapted_variants("torch")  # MLA's in its forms: test_sharded_mla.py
    assert TorchTPBackend.decode_caches == ("dynamic", "static")
    assert TorchTPBackend.decode_strategies == (STANDARD, MANUAL, *MLA_STRATEGIES)
    assert set(TorchTPBackend.decode_layouts) == set(TorchTPBackend.decode_caches)


@requires("torch")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tp_decode_in_lower_precision(torch_tp, dtype):
    cfg, padding = DECODE_CASES["left_padded_window"]
    x, mask = decode_run_inputs(cfg, padding)
    assert_decode_matches(torch_tp, cfg, x, mask, 2, 2, dtype, strategy=MANUAL)


@requires("torch")
@pytest.mark.parametrize("case", ["gqa_rope_half", "window_outgrown", "left_padded", "right_padded"])
def test_torch_tp_manual_decode_with_fewer_kv_heads_than_ranks(torch_tp_4, case):
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    for prefill, step in [(1, 1), (6, 2), (TOKENS, 1)]:
        prepared = assert_decode_matches(torch_tp_4, cfg, x, mask, prefill, step, "float64", strategy=MANUAL)
        assert prepared.info["plan"] == "4 ranks x 1 query head(s), each kv head replicated on 2 ranks"
    # The projection-wide QK-norm's k statistic counts a replicated kv head once per replica, then divides.
    normed = VARIANT_CFGS["qk_norm_projection"]
    assert_decode_matches(torch_tp_4, normed, *decode_run_inputs(normed, None), 3, 2, "float64", strategy=MANUAL)


@requires("torch")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_torch_tp_window_keeps_a_ring_of_w_minus_1_plus_step_slots_per_rank(torch_tp, cache):
    cfg, _ = DECODE_CASES["window_outgrown"]  # W = 3, 9 tokens, 2 kv heads: one per rank
    x, _ = decode_run_inputs(cfg, None)
    for prefill, step in [(2, 1), (6, 2)]:
        prepared = assert_decode_matches(torch_tp, cfg, x, None, prefill, step, "float64", stages=False, cache=cache)
        info = prepared.info["cache"]
        assert info["slots"] == ring_capacity(cfg, step) == cfg.window - 1 + step < TOKENS  # O(W), not O(N)
        assert info["layout"] == "(B, Hkv_local, T, Dk), (B, Hkv_local, T, Dv) per rank"
        # K and V of B=2 items, one kv head of d_k = d_v = 4 per rank, float64; 2 ranks
        assert info["bytes_per_rank"] == 2 * 1 * info["slots"] * (4 + 4) * 8
        assert info["bytes"] == 2 * info["bytes_per_rank"]


@requires("torch")
def test_torch_tp_unsupported_decode_says_why(torch_tp, torch_tp_4):
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    params, (x, _) = init_params(cfg), decode_run_inputs(cfg, None)
    with pytest.raises(UnsupportedCase, match=r"torch-tp has no 'paged' cache \(it has dynamic, static\)"):
        torch_tp.run_decode(cfg, params, x, prefill=2, cache="paged")
    # Fewer kv heads than ranks: the standard strategy's ColwiseParallel would cut a kv head in half.
    with pytest.raises(UnsupportedCase, match="ColwiseParallel would cut a kv head in half"):
        torch_tp_4.run_decode(cfg, params, x, prefill=2)
    mha = MHAConfig(d_model=12, n_heads=3, causal=True)
    with pytest.raises(UnsupportedCase, match=r"torch-tp: world=2 does not divide n_heads=3"):
        torch_tp.run_decode(mha, init_params(mha), np.zeros((9, 12)), prefill=2, strategy=MANUAL)
    with pytest.raises(ValueError, match="step must be at least 1"):
        torch_tp.run_decode(cfg, params, x, prefill=2, step=0)


@requires("torch")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("case", ["gqa_rope_half", "window_outgrown"])
def test_torch_tp_benchmark_step_is_the_torch_adapters_step_split_by_heads(torch_tp, torch_tp_4, case, cache):
    """One seed gives torch and torch-tp the same step on the same cache (each rank keeps its kv heads' part)."""
    from mha_rosetta.backends import get_backend
    from mha_rosetta.core import assert_close

    cfg, _ = DECODE_CASES[case]
    params = init_params(cfg, seed=0)
    options = {"context": 20, "batch": 2, "step": 2, "dtype": "float64", "cache": cache, "seed": 4}
    expected = get_backend("torch").prepare_decode(cfg, params, **options).output()  # (B, 2, D)
    for backend, strategy in [(torch_tp, STANDARD), (torch_tp, MANUAL), (torch_tp_4, MANUAL)]:
        prepared = backend.prepare_decode(cfg, params, strategy=strategy, **options)
        first, second = prepared.output(), prepared.output()
        assert_close(first, expected, "float64", what=f"{backend.world}-rank {strategy} step")
        np.testing.assert_array_equal(first, second)  # the cache is put back: every call is the same step
        slots = 22 if cfg.window is None else ring_capacity(cfg, 2)
        info = prepared.info["cache"]
        assert info["slots"] == slots and info["bytes"] == backend.world * info["bytes_per_rank"]
        stages = backend.canonical_stages(prepared)
        assert_close(stages["output"], expected, "float64", what="the step's stages' output")
        assert stages["k_rotated"].shape == (2, cfg.n_kv_heads, 2, cfg.d_k)  # the step's new keys, every kv head
