"""The einops adapter's KV-cache decoding (`backends.einops.decode`) on NumPy, torch and JAX arrays.

The cache is the pipeline's own keys, "b s g k" (B, T, Hkv, Dk). Every run equals the full causal
forward (`core.decode.reference_decode`) for every split, case, variant and dtype the library has; the
step stages equal the full forward's chunk by chunk; the cache holds the rotated, QK-normed keys of
the Hkv heads; a window is a ring of ``ring_capacity`` slots; the static cache refuses to overflow.
"""

from __future__ import annotations

import inspect

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

from conftest import requires
from mha_rosetta.backends.base import STANDARD, UnsupportedCase
from mha_rosetta.core import MHAConfig, init_params, reference_stages
from mha_rosetta.core.decode import CacheFull, prepare_decode_inputs, ring_capacity
from mha_rosetta.core.variants import adapted_variants

pytestmark = requires("einops")


def _library_param(library: str):
    marks = [] if library == "numpy" else [requires(library)]
    return pytest.param(library, marks=marks, id=library)


LIBRARIES = [_library_param(name) for name in ("numpy", "torch", "jax")]
# JAX compiles each chunk length of each configuration (twice: the timed step and the stage dump), so it runs
# the splits that differ in kind: one token from the first, the whole sequence as the prefill, a prefill longer
# than a ring with a three-token step (a shorter last one). NumPy and torch arrays run every split.
JAX_SPLITS = [(1, 1), (TOKENS, 1), (5, 3)]
# Every library computes the half types on this machine's CPU as its forward does.
LOW_PRECISION = ["float32", "float16", "bfloat16"]


def _library_splits(splits, jax_splits):
    """(library, split) params: every split for NumPy and torch arrays, ``jax_splits`` for JAX."""
    return [
        pytest.param(
            library.values[0], split, marks=library.marks, id=f"{library.values[0]}-prefill{split[0]}-step{split[1]}"
        )
        for library in LIBRARIES
        for split in (jax_splits if library.values[0] == "jax" else splits)
    ]


def backend_for(library: str):
    from mha_rosetta.backends import get_backend

    return get_backend(f"einops-{library}")


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize(("library", "split"), _library_splits(SPLITS, JAX_SPLITS))
def test_decode_equals_the_full_forward_float64(library, split, case):
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    assert_decode_matches(backend_for(library), cfg, x, mask, *split, "float64")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("case", ["gqa_rope_half", "window_outgrown", "left_padded"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_decode_equals_the_full_forward_in_lower_precision(library, case, dtype):
    cfg, padding = DECODE_CASES[case]
    x, mask = decode_run_inputs(cfg, padding)
    for split in [(6, 2)] if library == "jax" else [(1, 1), (6, 2)]:
        prepared = assert_decode_matches(backend_for(library), cfg, x, mask, *split, dtype)
        itemsize = np.dtype(np.float16 if dtype != "float32" else np.float32).itemsize  # bfloat16 is 2 bytes too
        slots = prepared.info["cache"]["slots"]
        assert prepared.info["cache"]["bytes"] == x.shape[0] * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * itemsize


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_variant_is_declared_for_decoding(library):
    backend = backend_for(library)
    # What the einops layer implements, on any of the three, MLA included: in its naive and absorbed strategies
    # (`Variant.strategies`), decoded through the latent cache (tests/test_mla_adapters.py).
    assert backend.decode_variants == backend.variants == adapted_variants("numpy", "torch", "jax")
    every = adapted_variants("numpy", "torch", "jax", strategy=STANDARD)  # what the standard path runs: the cases
    assert {name for cfg in VARIANT_CFGS.values() for name in cfg.variants} == every


@pytest.mark.parametrize("variant", sorted(VARIANT_CFGS))
@pytest.mark.parametrize(("library", "split"), _library_splits([(1, 1), (2, 2), (6, 1)], [(2, 2)]))
def test_decode_with_each_variant(library, split, variant):
    assert_variant_decodes(backend_for(library), variant, *split)


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_window_is_a_ring_of_w_minus_1_plus_step_slots(library, step):
    cfg, _ = DECODE_CASES["window_outgrown"]
    x, _ = decode_run_inputs(cfg, None)
    prepared = assert_decode_matches(backend_for(library), cfg, x, None, 2, step, "float64")
    ring = ring_capacity(cfg, step)
    assert prepared.info["cache"]["slots"] == ring == cfg.window - 1 + step < TOKENS  # O(W), not O(N)
    assert prepared.info["cache"]["bytes"] == 2 * 2 * cfg.n_kv_heads * ring * cfg.d_k * 8  # B=2, float64
    assert prepared.info["cache"]["layout"].startswith("(B, T, Hkv, Dk) 'b s g k' ring of")


def _decoder_run(library, cfg, prefill, step):
    """A run chunk by chunk through `EinopsDecoder`, returning the cache as it ends and the full forward's stages."""
    from mha_rosetta.backends.einops.decode import EinopsDecoder
    from mha_rosetta.backends.frameworks.ops import OPS_BY_LIBRARY

    x, _ = decode_run_inputs(cfg, None)
    inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step)
    params = init_params(cfg, seed=3)
    decoder = EinopsDecoder(
        OPS_BY_LIBRARY[library]("float64", "cpu"), cfg, params, inputs.x, inputs.positions, "float64"
    )
    cache = decoder.new_cache(inputs.batch, TOKENS, step)
    for start, stop in inputs.chunks():
        tokens = slice(start, stop)
        decoder.chunk(cache, tokens, inputs.positions[:, tokens], inputs.valid[:, tokens])
    return cache, reference_stages(cfg, params, inputs.x, positions=inputs.positions)


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_cache_holds_rotated_normed_keys_of_hkv_heads_tokens_first(library):
    from mha_rosetta.backends.base import tensor_to_numpy

    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="interleaved", qk_norm="projection")
    cache, full = _decoder_run(library, cfg, 3, 2)
    keys, values = tensor_to_numpy(cache.keys), tensor_to_numpy(cache.values)
    assert keys.shape == (2, TOKENS, cfg.n_kv_heads, cfg.d_k)  # "b s g k": Hkv heads, never H
    # canonical k_rotated (B, Hkv, Nk, Dk) -> "b s g k"
    np.testing.assert_allclose(keys, full["k_rotated"].transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(values, full["v_heads"].transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-13)
    assert cache.valid.all() and (cache.positions == np.arange(TOKENS)).all()


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_wrapped_ring_holds_the_last_tokens_at_t_mod_slots(library):
    from mha_rosetta.backends.base import tensor_to_numpy

    cfg, _ = DECODE_CASES["window_outgrown"]
    cache, full = _decoder_run(library, cfg, 5, 1)  # prefill 5 > ring 3: it keeps its last slots
    keys = tensor_to_numpy(cache.keys)
    assert cache.slots == cache.ring == 3
    for t in range(TOKENS - 3, TOKENS):
        np.testing.assert_allclose(keys[:, t % 3], full["k_rotated"][:, :, t], rtol=1e-12, atol=1e-13)
        assert (cache.positions[:, t % 3] == t).all()


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_static_cache_refuses_to_overflow(library):
    from mha_rosetta.backends.einops.decode import NamedCache
    from mha_rosetta.backends.frameworks.ops import OPS_BY_LIBRARY

    cfg = MHAConfig(d_model=8, n_heads=2, causal=True)
    ops = OPS_BY_LIBRARY[library]("float32", "cpu")
    cache = NamedCache(ops, 1, cfg, capacity=4, ring=None)
    keys = ops.asarray(np.ones((1, 3, 2, 4)))
    cache.write(keys, keys, np.arange(3)[None], np.ones((1, 3), bool))
    with pytest.raises(CacheFull, match=r"holds 3 of 4 slots and cannot take 3 more \(allocate at least 6\)"):
        cache.write(keys, keys, np.arange(3, 6)[None], np.ones((1, 3), bool))
    assert cache.written == 3


@pytest.mark.parametrize("library", LIBRARIES)
def test_unsupported_strategy_and_cache_are_refused_with_the_reason(library):
    backend = backend_for(library)
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    params = init_params(cfg)
    x, _ = decode_run_inputs(cfg, None)
    with pytest.raises(UnsupportedCase, match=rf"einops-{library} has no 'columns' cache \(it has static, paged\)"):
        backend.run_decode(cfg, params, x, prefill=2, cache="columns")
    with pytest.raises(
        UnsupportedCase, match=r"decodes with the standard, naive, absorbed strategies only, not 'chunked'"
    ):
        backend.run_decode(cfg, params, x, prefill=2, strategy="chunked")


@pytest.mark.parametrize("library", LIBRARIES)
def test_step_stages_are_tokens_first(library):
    backend = backend_for(library)
    cfg, _ = DECODE_CASES["gqa_rope_half"]
    x, _ = decode_run_inputs(cfg, None)
    prepared, _ = backend.prepare_decode_run(cfg, init_params(cfg), x, prefill=3, step=2)
    chunks = prepared.step_stages()
    assert len(chunks) == 4  # the prefill of 3, then 2 + 2 + 2
    assert chunks[1]["k_rotated"].axes == ("B", "Nk", "Hkv", "Dk")
    assert tuple(chunks[1]["k_rotated"].value.shape) == (2, 2, cfg.n_kv_heads, cfg.d_k)  # the step's new keys
    assert chunks[-1]["output"].axes == ("B", "Nq", "D")


@pytest.mark.parametrize(
    ("cfg", "context", "step"),
    [
        (MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half"), 37, 1),
        (MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, d_v=3, alibi=True), 20, 2),
        (MHAConfig(d_model=16, n_heads=4, causal=True, window=5, rope="half"), 50, 2),
    ],
    ids=["gqa", "d_v_alibi", "window"],
)
@pytest.mark.parametrize("library", LIBRARIES)
def test_the_benchmark_step_runs_and_reports_the_cache_bytes(library, cfg, context, step):
    backend = backend_for(library)
    prepared = backend.prepare_decode(cfg, init_params(cfg), context=context, batch=2, step=step, dtype="float32")
    first = prepared.output()
    assert first.shape == (2, step, cfg.d_model) and np.isfinite(first).all()
    np.testing.assert_array_equal(prepared.output(), first)  # every timed call is the same step at the same context
    slots = ring_capacity(cfg, step) if cfg.window else context + step
    assert prepared.info["cache"]["slots"] == slots
    assert prepared.info["cache"]["bytes"] == 2 * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * 4


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_benchmark_step_on_an_empty_cache_is_a_prefill_of_its_tokens(library):
    backend = backend_for(library)
    cfg = MHAConfig(d_model=8, n_heads=2, n_kv_heads=1, causal=True, rope="half", softcap=3.0)
    params = init_params(cfg)
    prepared = backend.prepare_decode(cfg, params, context=0, batch=2, step=3, dtype="float64", seed=7)
    x = np.random.default_rng(7).standard_normal((2, 3, cfg.d_model))
    np.testing.assert_allclose(prepared.output(), backend.run_decode(cfg, params, x, prefill=3), rtol=1e-12, atol=1e-13)


def test_the_decode_step_never_swaps_axes_by_hand():
    from test_backend_einops import axis_swaps  # the einops convention's checker, one place

    from mha_rosetta.backends.einops import decode

    assert axis_swaps(inspect.getsource(decode)) == []


@requires("jax")
def test_the_jax_step_compiles_once_per_chunk_length_not_per_token():
    backend = backend_for("jax")
    cfg = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="half", softcap=7.0)  # its own programs
    params = init_params(cfg)
    x = np.random.default_rng(5).standard_normal((1, 13, cfg.d_model))
    one = backend.prepare_decode_run(cfg, params, x, prefill=1, step=1)[0]
    one.output()
    assert one.info["compilations"] == 1  # 13 chunks of one token: one program
    mixed = backend.prepare_decode_run(cfg, params, x, prefill=4, step=3)[0]
    mixed.output()
    assert mixed.info["compilations"] == 2  # the prefill of 4, then three steps of 3 (one program each)
    mixed.output()
    assert mixed.info["compilations"] == 0  # each run's own count: the second run compiles nothing
    again = backend.prepare_decode_run(cfg, params, x, prefill=4, step=3)[0]
    again.output()
    assert again.info["compilations"] == 0  # shared across prepares: nothing compiles again
