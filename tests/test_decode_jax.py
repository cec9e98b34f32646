"""KV-cache decoding in JAX: the jax adapter's static (B, T, Hkv, Dk) cache, and Flax's decode=True oracle.

The property (`core.decode`): prefill, then steps through the cache, equals the full causal
forward (`reference_decode`) within the dtype's tolerance, for several (prefill, step) splits,
GQA with rotary (half, partial interleaved), a window the sequence outgrows, two tokens per
step, padded batches and every variant the decode path declares. Plus what makes it the JAX
convention: one compilation of the step, the ring buffer's wrapped write, the O(W) cache, and
`CacheFull` where a static cache would otherwise clamp its write index.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the jax adapter's decode path needs JAX (the jax extra)")

from decode_property_cases import GQA, variant_configs  # noqa: E402

from mha_rosetta.backends import CHUNKED, STANDARD, UnsupportedCase, get_backend, missing_backends  # noqa: E402
from mha_rosetta.core import MHAConfig, assert_close, init_params  # noqa: E402
from mha_rosetta.core.decode import (  # noqa: E402
    CacheFull,
    prepare_decode_inputs,
    reference_decode,
    reference_decode_stages,
    ring_capacity,
)
from mha_rosetta.core.variants import adapted_variants  # noqa: E402

N = 12  # tokens of every sequence below
GQA_ROPE = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="half")
PARTIAL_INTERLEAVED = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="interleaved", rope_dims=4)
WINDOW = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="half", window=4)  # ring of 3 + step
CASES = {"gqa_rope": GQA_ROPE, "partial_interleaved": PARTIAL_INTERLEAVED, "window": WINDOW}
# (prefill, step): one token at a time from the first, the whole sequence at once, two per step
# (with a last shorter step), three per step, and, with the window, prefills shorter and longer than the ring.
SPLITS = [(1, 1), (N, 1), (5, 2), (2, 3), (9, 1)]

# One configuration per variant the jax decode path declares (every adapted one), from the registry: each entry's
# demonstration fields on GQA + rotary (tests/decode_property_cases.py). Then ALiBi under a window of 5, and dynamic
# NTK, which reads the sequence's length: 12 tokens > 6, so the frequencies are scaled.
VARIANT_CFGS = {
    **variant_configs(GQA, adapted_variants("jax", strategy=STANDARD)),
    "alibi_window": MHAConfig(d_model=16, n_heads=4, causal=True, alibi=True, window=5),
    "rope_scaling_dynamic": MHAConfig(
        d_model=16,
        n_heads=4,
        causal=True,
        rope="half",
        rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6},
    ),
}


def _x(cfg: MHAConfig, batch: int = 2, tokens: int = N, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, cfg.d_model))


def _params(cfg: MHAConfig):
    return init_params(cfg, seed=0)  # random biases too: a row mapped to the empty-row answer b_o shows


def _assert_decodes(backend, cfg, x, *, prefill, step, dtype="float64", **kwargs):
    params = _params(cfg)
    prepared, inputs = backend.prepare_decode_run(cfg, params, x, prefill=prefill, step=step, dtype=dtype, **kwargs)
    out = inputs.unbatch(prepared.output())
    expected = reference_decode(cfg, params, x, prefill=prefill, step=step, **kwargs)
    assert_close(out, expected, dtype, what=f"{backend.name} decode prefill={prefill} step={step} {dtype}")
    return prepared, inputs


# -- the jax adapter --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("prefill", "step"), SPLITS)
def test_jax_decode_equals_the_full_causal_forward(case, prefill, step):
    _assert_decodes(get_backend("jax"), CASES[case], _x(CASES[case]), prefill=prefill, step=step)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_decode_in_lower_precision_is_within_its_tolerance(dtype):
    _assert_decodes(get_backend("jax"), WINDOW, _x(WINDOW), prefill=3, step=2, dtype=dtype)


@pytest.mark.parametrize("cfg", [GQA_ROPE, WINDOW], ids=["gqa_rope", "window"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_jax_decode_of_a_padded_batch(cfg, side):
    mask = np.ones((2, N), dtype=bool)
    if side == "left":
        mask[0, :4] = False  # item 0: four pads, at position -1 (cumsum - 1), which see only pads
    else:
        if cfg.window is not None:
            pytest.skip("a ring buffer needs positions that advance by one per real token (core.decode refuses it)")
        mask[1, 8:] = False  # item 1: pads after its real tokens, repeating the last real position
    backend = get_backend("jax")
    for prefill, step in [(1, 1), (6, 2), (5, 3)]:
        _assert_decodes(backend, cfg, _x(cfg), prefill=prefill, step=step, mask=mask)


def test_every_variant_the_jax_decode_path_declares_has_a_case():
    # and MLA's, decoded in its naive and absorbed strategies through the latent cache (tests/test_mla_adapters.py)
    assert get_backend("jax").decode_variants == adapted_variants("jax")
    for name in adapted_variants("jax", strategy=STANDARD):  # all but MLA, which runs in its own strategies
        assert name in VARIANT_CFGS[name].variants, name  # its demonstration fields switch it on
    assert {name for cfg in VARIANT_CFGS.values() for name in cfg.variants} == adapted_variants(
        "jax", strategy=STANDARD
    )


@pytest.mark.parametrize("variant", sorted(VARIANT_CFGS))
def test_jax_decode_of_each_variant(variant):
    cfg = VARIANT_CFGS[variant]
    backend = get_backend("jax")
    for prefill, step in [(1, 1), (5, 2)]:
        _assert_decodes(backend, cfg, _x(cfg), prefill=prefill, step=step)


@pytest.mark.parametrize("case", ["gqa_rope", "window"])
def test_jax_step_stages_agree_with_the_full_forward_chunk_by_chunk(case):
    cfg = CASES[case]
    params, x = _params(cfg), _x(cfg)
    backend = get_backend("jax")
    prepared, inputs = backend.prepare_decode_run(cfg, params, x, prefill=3, step=2)
    chunks = backend.decode_stages(prepared, cfg)
    expected = reference_decode_stages(cfg, params, inputs)
    assert len(chunks) == len(expected) == len(inputs.chunks()) == 6  # 3, then 2, 2, 2, 2, 1
    for (start, stop), got, want in zip(inputs.chunks(), chunks, expected, strict=True):
        assert set(got) == set(want)
        for name in want:
            assert_close(got[name], want[name], "float64", what=f"tokens {start}..{stop - 1} {name}")


@pytest.mark.parametrize(("prefill", "step"), [(2, 1), (3, 2), (9, 4)])
def test_a_window_keeps_a_ring_buffer_of_w_minus_1_plus_step_slots(prefill, step):
    prepared, _ = _assert_decodes(get_backend("jax"), WINDOW, _x(WINDOW), prefill=prefill, step=step)
    cache = prepared.info["cache"]
    assert cache["slots"] == ring_capacity(WINDOW, step) == WINDOW.window - 1 + step < N  # O(W), not O(N)
    assert cache["kind"] == "static" and cache["layout"] == "(B, T, Hkv, Dk)"
    # K and V of 2 items, Hkv = 2 heads of d_k = d_v = 6, float64
    assert cache["bytes"] == 2 * cache["slots"] * 2 * (6 + 6) * 8


def test_without_a_window_the_static_cache_holds_every_token():
    prepared, _ = _assert_decodes(get_backend("jax"), GQA_ROPE, _x(GQA_ROPE), prefill=3, step=1)
    assert prepared.info["cache"]["slots"] == N


def test_a_12_token_decode_compiles_the_step_once():
    backend = get_backend("jax")
    # A configuration no other test decodes: the programs are shared within the process (by cfg and slots).
    cfg = MHAConfig(d_model=20, n_heads=5, causal=True, rope="half", rope_base=321.0)
    window = MHAConfig(d_model=20, n_heads=5, causal=True, rope="half", rope_base=321.0, window=3)
    params, x = _params(cfg), _x(cfg)
    prepared, _ = backend.prepare_decode_run(cfg, params, x, prefill=3, step=1)
    assert prepared.info["compilations"] == {"prefill": 0, "step": 0}  # nothing traced before the run
    prepared.output()  # 1 prefill + 9 steps
    assert prepared.info["compilations"] == {"prefill": 1, "step": 1}
    # Run again: every program is found compiled.
    prepared.output()
    assert prepared.info["compilations"] == {"prefill": 0, "step": 0}
    # 3 + 2 + 2 + 2 + 2 + 1: the prefill of 3 and the step of 1 are compiled already; the step of 2 is new.
    prepared, _ = backend.prepare_decode_run(cfg, params, x, prefill=3, step=2)
    prepared.output()
    assert prepared.info["compilations"] == {"prefill": 0, "step": 1}
    # Other slots (12 -> 13 tokens) are another program: prefill and step compile once each.
    prepared, _ = backend.prepare_decode_run(cfg, params, _x(cfg, tokens=13), prefill=3, step=1)
    prepared.output()
    assert prepared.info["compilations"] == {"prefill": 1, "step": 1}
    # A window's ring: the write wraps inside the same program, 12 tokens through 3 slots.
    prepared, _ = backend.prepare_decode_run(window, _params(window), x, prefill=1, step=1)
    prepared.output()
    assert prepared.info["compilations"] == {"prefill": 1, "step": 1}
    assert prepared.info["cache"]["slots"] == 3


def test_the_ring_write_that_straddles_the_end_wraps_to_slot_0():
    import jax.numpy as jnp
    from jax import lax

    from mha_rosetta.backends.jax.decode_programs import _write

    cache = jnp.arange(5.0)[:, None]  # (T=5, 1): slot t holds t
    new = jnp.array([[10.0], [11.0]])  # (s=2, 1): tokens 9 and 10 of the sequence
    index = jnp.int32(9)  # token 9 -> slot 4, token 10 -> slot 0
    wrapped = _write(cache, new, index, slots=5, ring=True)
    np.testing.assert_array_equal(np.asarray(wrapped)[:, 0], [11.0, 1.0, 2.0, 3.0, 10.0])
    # Why not one dynamic_update_slice: it clamps a start past T - s and would overwrite slots 3, 4.
    clamped = lax.dynamic_update_slice(cache, new, (jnp.int32(4), jnp.int32(0)))
    np.testing.assert_array_equal(np.asarray(clamped)[:, 0], [0.0, 1.0, 2.0, 10.0, 11.0])
    # One token: a dynamic slice at index % T.
    one = _write(cache, new[:1], jnp.int32(7), slots=5, ring=True)
    np.testing.assert_array_equal(np.asarray(one)[:, 0], [0.0, 1.0, 10.0, 3.0, 4.0])


def test_a_run_whose_steps_straddle_the_ring_end_is_right():
    # W = 4, step 2: a ring of 5 slots; prefill 4, then tokens 4-5 (slots 4, 0), 6-7, 8-9 (4, 0), 10-11.
    prepared, _ = _assert_decodes(get_backend("jax"), WINDOW, _x(WINDOW), prefill=4, step=2)
    assert prepared.info["cache"]["slots"] == 5


def _decoder(cfg, capacity):
    from mha_rosetta.backends.jax.decode import JaxDecoder

    return JaxDecoder(
        cfg,
        _params(cfg),
        batch=1,
        capacity=capacity,
        dtype="float64",
        device="cpu",
        matmul_precision="highest",
        span=N,
    )


def test_a_static_cache_past_its_capacity_is_cache_full():
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True)
    decoder = _decoder(cfg, capacity=4)
    x, positions, valid = _x(cfg, batch=1), np.arange(N)[None], np.ones((1, N), bool)
    decoder.prefill(x[:, :3], positions[:, :3], valid[:, :3], None)
    decoder.step(x[:, 3:4], positions[:, 3:4], valid[:, 3:4], None)
    with pytest.raises(CacheFull, match=r"capacity exceeded: it holds 4 of 4 slots and cannot take 1 more"):
        decoder.step(x[:, 4:5], positions[:, 4:5], valid[:, 4:5], None)
    assert decoder.used == 4  # the refused step wrote nothing
    with pytest.raises(CacheFull, match=r"holds 0 of 4 slots and cannot take 5 more"):
        _decoder(cfg, capacity=4).prefill(x[:, :5], positions[:, :5], valid[:, :5], None)


def test_bad_decode_input_names_the_argument():
    backend, cfg = get_backend("jax"), GQA_ROPE
    with pytest.raises(ValueError, match="prefill must be between 1 and the sequence's 12 tokens, got 0"):
        backend.run_decode(cfg, _params(cfg), _x(cfg), prefill=0)
    with pytest.raises(ValueError, match="step must be at least 1"):
        backend.run_decode(cfg, _params(cfg), _x(cfg), prefill=2, step=0)


def test_unsupported_decode_strategy_cache_and_libraries_say_why():
    backend, cfg, params, x = get_backend("jax"), GQA_ROPE, _params(GQA_ROPE), _x(GQA_ROPE)
    with pytest.raises(
        UnsupportedCase, match="decodes with the standard, naive, absorbed strategies only, not 'chunked'"
    ):
        backend.run_decode(cfg, params, x, prefill=2, strategy=CHUNKED)
    with pytest.raises(UnsupportedCase, match=r"has no 'dynamic' cache \(it has static, paged\)"):
        backend.run_decode(cfg, params, x, prefill=2, cache="dynamic")
    fragments = {
        "jax-dpa": "no KV cache object to step",
        "equinox": "keeps no state between calls",
    }
    missing = missing_backends()  # equinox is not installed in the jax-only env: its reason is read where it is
    for name, fragment in fragments.items():
        if name in missing:
            continue
        reason = get_backend(name).decode_reason(cfg, "float32", "cpu", "standard", None)
        assert reason is not None and "has no KV-cache decoding" in reason and fragment in reason, (name, reason)


@pytest.mark.parametrize("cfg", [GQA_ROPE, WINDOW], ids=["gqa_rope", "window"])
def test_the_benchmark_step_is_one_compiled_step_on_a_full_cache(cfg):
    backend = get_backend("jax")
    prepared = backend.prepare_decode(cfg, _params(cfg), context=20, batch=1, step=2, dtype="float32")
    prepared.compile()
    first = prepared.output()
    second = prepared.output()
    assert first.shape == (1, 2, cfg.d_model) and np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)  # the same step on the same cache: repeatable
    assert prepared.info["compilations"] == {"step": 1}  # compiled ahead, called twice
    slots = 22 if cfg.window is None else ring_capacity(cfg, 2)
    assert prepared.info["cache"]["slots"] == slots


# -- the flax oracle: Flax's own decode=True cache ------------------------------------------------
FLAX_CFG = MHAConfig(d_model=16, n_heads=4, causal=True)


def _flax():
    pytest.importorskip("flax", reason="the flax oracle needs flax (the jax extra)")
    return get_backend("flax")


@pytest.mark.parametrize(("prefill", "mask_side"), [(1, None), (N, None), (5, None), (4, "left"), (3, "right")])
def test_flax_decode_cache_equals_the_full_causal_forward(prefill, mask_side):
    backend = _flax()
    mask = None
    if mask_side == "left":
        mask = np.ones((2, N), dtype=bool)
        mask[0, :3] = False
    elif mask_side == "right":
        mask = np.ones((2, N), dtype=bool)
        mask[1, 9:] = False
    prepared, inputs = _assert_decodes(backend, FLAX_CFG, _x(FLAX_CFG), prefill=prefill, step=1, mask=mask)
    assert prepared.info["cache"]["slots"] == N and prepared.info["compilations"] == {"allocate": 1, "step": 1}
    assert prepared.info["empty_rows_mapped"] == (3 if mask_side == "left" else 0)  # the left pads see only pads
    stages = backend.decode_stages(prepared, FLAX_CFG)
    expected = reference_decode_stages(FLAX_CFG, _params(FLAX_CFG), inputs)
    for got, want in zip(stages, expected, strict=True):
        assert_close(got["output"], want["output"], "float64", what="flax step output")


@pytest.mark.parametrize(
    ("cfg", "fragment"),
    [
        (MHAConfig(d_model=16, n_heads=4, causal=True, rope="half"), "no rotary embedding"),
        (MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True), "no grouped kv heads"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, window=3), "no ring buffer"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, alibi=True), "decode path does not implement alibi"),
        (MHAConfig(d_model=16, n_heads=4, causal=True, softcap=2.0), "no softcap"),
    ],
)
def test_flax_decode_is_unsupported_where_its_cache_cannot_express_the_case(cfg, fragment):
    reason = _flax().decode_reason(cfg, "float64", "cpu", "standard", None)
    assert reason is not None and fragment in reason


def test_flax_decode_takes_one_token_per_call_and_positions_on_its_cache_index():
    backend, params, x = _flax(), _params(FLAX_CFG), _x(FLAX_CFG)
    with pytest.raises(UnsupportedCase, match=r"one token per call.*step=2"):
        backend.run_decode(FLAX_CFG, params, x, prefill=2, step=2)
    # Repeated positions: token 2 (position 1) would be visible to token 1 by positions, not by index: core refuses.
    repeated = np.array([0, 1, *range(1, N - 1)])
    with pytest.raises(ValueError, match="strictly increase"):
        backend.run_decode(FLAX_CFG, params, x, prefill=2, positions=repeated)
    # Positions with gaps still follow the index: supported, and equal to the full forward.
    _assert_decodes(backend, FLAX_CFG, x, prefill=2, step=1, positions=np.arange(N) * 2)


def test_decode_inputs_split_as_the_tests_assume():
    inputs = prepare_decode_inputs(GQA_ROPE, _x(GQA_ROPE), prefill=3, step=2)
    assert inputs.chunks() == [(0, 3), (3, 5), (5, 7), (7, 9), (9, 11), (11, 12)]
