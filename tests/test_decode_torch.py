"""KV-cache decoding in torch (`backends/torch/decode.py`, both cache kinds) and the torch-sdpa oracle's decoding.

The property: prefill, then steps through the implementation's own cache, give every token the
full causal forward's output (`core.decode.reference_decode`) within the dtype's tolerance, for
many (prefill, step) splits, GQA with rotary, a window the sequence outgrows, padded batches and
every declared variant. Plus the step stages chunk by chunk, the ring's O(W) memory, the static
cache's `CacheFull`, the benchmark's one timed step, and the reasons where there is no decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_property_cases import variant_configs

from conftest import requires
from mha_rosetta.backends import PER_HEAD, STANDARD, UnsupportedCase, get_backend
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.core import VARIANTS, MHAConfig, compare, init_params
from mha_rosetta.core.decode import (
    CacheFull,
    decode_stage_names,
    prepare_decode_inputs,
    reference_decode,
    reference_decode_stages,
    ring_capacity,
)
from mha_rosetta.core.variants import adapted_variants, strategy_forms

pytestmark = requires("torch")

# (backend, cache): ours in both kinds, and the SDPA oracle's own growing cache.
PATHS = [("torch", "dynamic"), ("torch", "static"), ("torch-sdpa", "dynamic")]
PATH_IDS = [f"{name}-{cache}" for name, cache in PATHS]

BASE = {"d_model": 24, "n_heads": 4, "d_k": 6, "causal": True}
CASES = {
    "mha": {},
    "gqa_rope_half": {"n_kv_heads": 2, "rope": "half"},
    "gqa_rope_partial_interleaved": {"n_kv_heads": 2, "rope": "interleaved", "rope_dims": 4},
    "mqa_window": {"n_kv_heads": 1, "rope": "half", "window": 3},
    "gqa_rope_window": {"n_kv_heads": 2, "rope": "half", "window": 4},
}
# (prefill, step): one token at a time from the first, the whole sequence at once, two per step,
# and prefills shorter and longer than the window's ring (3 or 4 with step 1; 4 or 5 with step 2).
SPLITS = [(1, 1), (2, 1), (5, 1), (16, 1), (1, 2), (3, 2), (9, 2), (6, 3)]
TOKENS = 16  # several times every ring: the window is well past full (transformers #37574)

# One configuration per registered variant, from the registry: each entry's demonstration fields on GQA + rotary
# (tests/decode_property_cases.py; the forms no adapter applies are refused by name). Then dynamic NTK, whose
# frequencies depend on the sequence's length past original_max_position_embeddings, and sinks with a window of 4.
VARIANT_CFGS = {
    **variant_configs({**BASE, "rope": "half", "n_kv_heads": 2}),
    "rope_scaling_dynamic": MHAConfig(
        **BASE,
        rope="half",
        n_kv_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4},
    ),
    "sinks_window": MHAConfig(**BASE, sinks=True, window=4, rope="half", n_kv_heads=2),
}


def config(**overrides) -> MHAConfig:
    return MHAConfig(**{**BASE, **overrides})


def sequence(batch: int = 2, tokens: int = TOKENS, seed: int = 3, d_model: int = BASE["d_model"]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, d_model))


def assert_decode_close(actual, expected, dtype: str, what: str) -> None:
    result = compare(actual, expected, dtype)
    assert result.ok, f"{what}: {result.max_abs:.3g} max abs error ({result.reason or 'over the tolerance'})"


def decoded(name: str, cache: str, cfg, params, x, **kwargs):
    return get_backend(name).run_decode(cfg, params, x, cache=cache, **kwargs)


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("case", CASES)
def test_decode_equals_the_full_causal_forward(name, cache, case):
    cfg = config(**CASES[case])
    params, x = init_params(cfg, seed=5), sequence()
    expected = reference_decode(cfg, params, x, prefill=1)
    for prefill, step in SPLITS:
        actual = decoded(name, cache, cfg, params, x, prefill=prefill, step=step)
        assert actual.shape == (2, TOKENS, cfg.d_model)
        assert_decode_close(actual, expected, "float64", f"{case} prefill={prefill} step={step}")


def left_padded_mask() -> np.ndarray:
    mask = np.ones((2, TOKENS), dtype=bool)
    mask[1, :5] = False  # item 1: five pads on the left (positions -1, then 0 .. 10 for its real tokens)
    return mask


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("case", ["gqa_rope_half", "gqa_rope_window"])
def test_a_left_padded_batch_decodes_with_per_item_positions(name, cache, case):
    """Positions cumsum(mask) - 1, as generate computes them; the pads (position -1) give the spec's empty rows."""
    cfg = config(**CASES[case])
    params, x, mask = init_params(cfg, seed=6), sequence(), left_padded_mask()
    expected = reference_decode(cfg, params, x, prefill=1, mask=mask)
    for prefill, step in [(1, 1), (3, 2), (7, 1), (16, 1)]:
        actual = decoded(name, cache, cfg, params, x, prefill=prefill, step=step, mask=mask)
        assert_decode_close(actual, expected, "float64", f"{case} left-padded prefill={prefill} step={step}")
    # The pads' rows attend to nothing: their output is b_o, on every item position they occupy.
    np.testing.assert_allclose(actual[1, :5], np.broadcast_to(params.b_o, (5, cfg.d_model)), atol=1e-12)


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
def test_a_right_padded_batch_decodes(name, cache):
    """Right pads are masked as keys; as queries they repeat the last real position (cumsum - 1)."""
    cfg = config(**CASES["gqa_rope_partial_interleaved"])
    params, x = init_params(cfg, seed=7), sequence()
    mask = np.ones((2, TOKENS), dtype=bool)
    mask[0, -4:] = False
    expected = reference_decode(cfg, params, x, prefill=1, mask=mask)
    for prefill, step in [(1, 1), (4, 2), (16, 1)]:
        actual = decoded(name, cache, cfg, params, x, prefill=prefill, step=step, mask=mask)
        assert_decode_close(actual, expected, "float64", f"right-padded prefill={prefill} step={step}")


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
def test_unbatched_input_and_given_positions(name, cache):
    """(N, D) in, (N, D) out; positions that start at 100 (a continuation) turn rotary and ALiBi the same way."""
    cfg = config(n_kv_heads=2, rope="half", window=3)
    params, x = init_params(cfg, seed=8), sequence(batch=1)[0]
    positions = np.arange(100, 100 + TOKENS)
    expected = reference_decode(cfg, params, x, prefill=1, positions=positions)
    actual = decoded(name, cache, cfg, params, x, prefill=2, step=2, positions=positions)
    assert actual.shape == (TOKENS, cfg.d_model)
    assert_decode_close(actual, expected, "float64", "unbatched, positions from 100")


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("variant", list(VARIANT_CFGS))
def test_every_declared_variant_decodes(name, cache, variant):
    backend = get_backend(name)
    cfg = VARIANT_CFGS[variant]
    params, x = init_params(cfg, seed=9), sequence(d_model=cfg.d_model)
    if not set(cfg.variants) <= backend.decode_variants:
        first = next(name for name in cfg.variants if name not in backend.decode_variants)  # mla before mla_q_lora
        with pytest.raises(UnsupportedCase, match=f"decode path does not implement {first}"):
            backend.run_decode(cfg, params, x, prefill=1, cache=cache)
        return
    expected = reference_decode(cfg, params, x, prefill=1)
    strategy = STANDARD
    if variant in strategy_forms(
        MLA_STRATEGIES
    ):  # MLA decodes in its naive and absorbed strategies only, through its latent cache
        with pytest.raises(UnsupportedCase, match="'naive' and 'absorbed' strategies only"):
            backend.run_decode(cfg, params, x, prefill=1, cache=cache)
        if cache != backend.decode_caches[0]:
            with pytest.raises(UnsupportedCase, match="latent cache"):
                backend.run_decode(cfg, params, x, prefill=1, cache=cache, strategy=MLA_STRATEGIES[0])
            return
        strategy = MLA_STRATEGIES[len(variant) % 2]  # mla: naive, mla_q_lora: absorbed
    for prefill, step in [(1, 1), (6, 2), (16, 1)]:
        actual = backend.run_decode(cfg, params, x, prefill=prefill, step=step, cache=cache, strategy=strategy)
        assert_decode_close(actual, expected, "float64", f"{variant} prefill={prefill} step={step}")


def test_the_declared_decode_variants():
    """Ours decodes every variant; the SDPA oracle those its forward has (no softcap, no sinks, no output gate)."""
    for variant in VARIANTS:  # each entry's demonstration fields switch it on
        assert variant in VARIANT_CFGS[variant].variants, variant
    assert get_backend("torch").decode_variants == adapted_variants("torch")  # MLA among them: backends._mla
    assert get_backend("torch-sdpa").decode_variants == adapted_variants() - {"softcap", "sinks", "gate"}


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_lower_precision_decodes_within_the_dtype_tolerance(name, cache, dtype):
    cfg = config(n_kv_heads=2, rope="half", window=4, qk_norm="head")
    params, x = init_params(cfg, seed=10), sequence()
    expected = reference_decode(cfg, params, x, prefill=1)
    for prefill, step in [(1, 1), (7, 2)]:
        actual = decoded(name, cache, cfg, params, x, prefill=prefill, step=step, dtype=dtype)
        assert_decode_close(actual, expected, dtype, f"{dtype} prefill={prefill} step={step}")


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("variants", [{}, {"qk_norm": "projection", "window": 3}])
def test_step_stages_agree_with_the_full_forward_chunk_by_chunk(name, cache, variants):
    backend = get_backend(name)
    cfg = config(n_kv_heads=2, rope="interleaved", rope_dims=4, **variants)
    params, x = init_params(cfg, seed=11), sequence()
    prepared, inputs = backend.prepare_decode_run(cfg, params, x, prefill=5, step=2, cache=cache)
    stages = backend.decode_stages(prepared, cfg)
    expected = reference_decode_stages(cfg, params, inputs)
    assert len(stages) == len(expected) == len(inputs.chunks()) == 7  # the prefill of 5, then 5 steps of 2 and 1
    for i, (chunk, want) in enumerate(zip(stages, expected, strict=True)):
        assert set(chunk) == set(decode_stage_names(cfg)), f"chunk {i}"
        for stage in decode_stage_names(cfg):
            assert_decode_close(chunk[stage], want[stage], "float64", f"chunk {i} stage {stage}")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(("prefill", "step"), [(1, 1), (2, 2), (11, 1), (12, 3)])
def test_a_window_keeps_a_ring_of_w_minus_1_plus_step_slots(cache, prefill, step):
    """Memory O(W): the cache the run leaves holds ring_capacity(cfg, step) slots of Hkv heads, measured on it."""
    cfg = config(n_kv_heads=2, rope="half", window=4)
    params, x = init_params(cfg, seed=12), sequence(tokens=30)
    prepared, _ = get_backend("torch").prepare_decode_run(cfg, params, x, prefill=prefill, step=step, cache=cache)
    assert_decode_close(prepared.output(), reference_decode(cfg, params, x, prefill=1), "float64", "ring")
    ring = ring_capacity(cfg, step)
    assert ring == 3 + step
    info = prepared.info["cache"]
    assert info["kind"] == cache and info["slots"] == ring
    assert info["bytes"] == 2 * cfg.n_kv_heads * ring * (cfg.d_k + cfg.d_v) * 8  # K and V, Hkv heads (never H)
    assert info["layout"] == "(B, Hkv, T, Dk), (B, Hkv, T, Dv)"
    assert get_backend("torch").decode_layouts[cache].startswith(f"(B, Hkv, {'T' if cache == 'dynamic' else 'C'}, Dk)")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_sequence_shorter_than_the_ring_keeps_its_tokens_only(cache):
    """cache_capacity: min(ring, tokens) slots, allocated whole by the static cache, grown to by the dynamic one."""
    cfg = config(n_kv_heads=2, rope="half", window=8)
    params, x = init_params(cfg, seed=22), sequence(tokens=6)
    prepared, _ = get_backend("torch").prepare_decode_run(cfg, params, x, prefill=2, step=2, cache=cache)
    assert_decode_close(prepared.output(), reference_decode(cfg, params, x, prefill=1), "float64", "short")
    assert prepared.info["cache"]["slots"] == 6 < ring_capacity(cfg, 2)


def test_without_a_window_the_caches_hold_every_token():
    cfg = config(n_kv_heads=2, rope="half")
    params, x = init_params(cfg, seed=13), sequence()
    for name, cache in PATHS:
        prepared, _ = get_backend(name).prepare_decode_run(cfg, params, x, prefill=3, step=2, cache=cache)
        prepared.output()
        assert prepared.info["cache"]["slots"] == TOKENS, (name, cache)
        assert prepared.info["cache"]["bytes"] == 2 * 2 * TOKENS * 12 * 8


def test_the_sdpa_oracle_masks_bottom_right_and_never_is_causal():
    """causal_lower_right on steps of several queries, no mask for one query, an explicit mask with a window."""
    sdpa = get_backend("torch-sdpa")
    params_cfg = config(n_kv_heads=2, rope="half")
    params, x = init_params(params_cfg, seed=14), sequence()
    prepared, _ = sdpa.prepare_decode_run(params_cfg, params, x, prefill=6, step=3)
    assert prepared.info["masks"] == ["causal_lower_right"] * 4 + ["none"]  # 6, then 3 + 3 + 3, then the last 1
    assert "top-left" in prepared.info["is_causal"]
    assert any("is_causal=True is top-left" in d and "causal_lower_right" in d for d in sdpa.known_differences)
    windowed = config(n_kv_heads=2, rope="half", window=3)
    prepared, _ = sdpa.prepare_decode_run(windowed, init_params(windowed, seed=14), x, prefill=2, step=1)
    assert prepared.info["masks"][:2] == ["causal_lower_right", "none"] and set(prepared.info["masks"][3:]) == {"bool"}


def test_top_left_causality_on_a_step_would_be_wrong():
    """Why is_causal=True is refused: on a step of 3 queries over 8 cached keys it lets query 0 see key 0 only."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    q, k = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 8, 4, dtype=torch.float64)
    v = torch.eye(8, dtype=torch.float64)[None, None]  # the weights themselves come out
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0, 0]
    bottom_right = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 8))[0, 0]
    assert torch.equal(top_left[0, 1:], torch.zeros(7, dtype=torch.float64)) and top_left[0, 0] == 1.0
    assert (bottom_right[0, :6] > 0).all() and torch.equal(bottom_right[0, 6:], torch.zeros(2, dtype=torch.float64))


def test_a_static_cache_larger_than_the_run_masks_its_empty_slots():
    """transformers #30400: SDPA attended a static cache's empty slots. Here 9 of 25 are never written."""
    backend = get_backend("torch")
    cfg = config(n_kv_heads=2, rope="half")
    params, x = init_params(cfg, seed=15), sequence()
    inputs = prepare_decode_inputs(cfg, x, prefill=3, step=1)
    prepared = backend._prepare_decode_run(cfg, params, inputs, "float64", "cpu", STANDARD, "static", capacity=25)
    assert_decode_close(prepared.output(), reference_decode(cfg, params, x, prefill=1), "float64", "capacity 25")
    assert prepared.info["cache"]["slots"] == 25


def test_a_static_cache_past_its_capacity_is_cache_full():
    backend = get_backend("torch")
    cfg = config(n_kv_heads=2, rope="half")
    params, x = init_params(cfg, seed=16), sequence()
    inputs = prepare_decode_inputs(cfg, x, prefill=3, step=2)

    def prepared(capacity: int, cache: str = "static", cfg=cfg, params=params, inputs=inputs):
        return backend._prepare_decode_run(cfg, params, inputs, "float64", "cpu", STANDARD, cache, capacity=capacity)

    full = prepared(10)
    with pytest.raises(CacheFull, match=r"capacity exceeded: it holds 9 of 10 slots and cannot take 2 more"):
        full.output()
    exact = prepared(TOKENS).output()
    assert_decode_close(exact, reference_decode(cfg, params, x, prefill=1), "float64", "exact capacity")
    with pytest.raises(ValueError, match="capacity applies to a static cache without a window"):
        prepared(10, "dynamic")
    windowed = config(window=3)
    windowed_inputs = prepare_decode_inputs(windowed, x, prefill=3, step=2)
    with pytest.raises(ValueError, match="a window's ring has ring_capacity"):
        prepared(10, cfg=windowed, params=init_params(windowed), inputs=windowed_inputs)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        prepared(0)


@pytest.mark.parametrize(("name", "cache"), PATHS, ids=PATH_IDS)
def test_bad_decode_input_is_a_clear_error(name, cache):
    cfg = config(rope="half")
    params, x = init_params(cfg), sequence()
    backend = get_backend(name)
    with pytest.raises(ValueError, match=r"prefill must be between 1 and the sequence's 16 tokens, got 0"):
        backend.run_decode(cfg, params, x, prefill=0, cache=cache)
    with pytest.raises(ValueError, match=r"prefill must be between 1 and the sequence's 16 tokens, got 17"):
        backend.run_decode(cfg, params, x, prefill=17, cache=cache)
    with pytest.raises(ValueError, match=r"step must be at least 1"):
        backend.run_decode(cfg, params, x, prefill=2, step=0, cache=cache)
    backwards = np.arange(TOKENS)
    backwards[5] = 2
    with pytest.raises(ValueError, match="positions must not go backwards"):
        backend.run_decode(cfg, params, x, prefill=2, positions=backwards, cache=cache)


def test_an_unsupported_cache_or_strategy_says_why():
    cfg = config()
    params, x = init_params(cfg), sequence()
    torch_backend, sdpa = get_backend("torch"), get_backend("torch-sdpa")
    with pytest.raises(UnsupportedCase, match=r"torch has no 'rolling' cache \(it has dynamic, static, paged\)"):
        torch_backend.run_decode(cfg, params, x, prefill=1, cache="rolling")
    with pytest.raises(UnsupportedCase, match=r"torch-sdpa has no 'static' cache \(it has dynamic\)"):
        sdpa.run_decode(cfg, params, x, prefill=1, cache="static")
    with pytest.raises(
        UnsupportedCase, match="decodes with the standard, naive, absorbed strategies only, not 'per_head'"
    ):
        torch_backend.run_decode(cfg, params, x, prefill=1, strategy=PER_HEAD)
    softcapped = config(softcap=2.0)
    with pytest.raises(UnsupportedCase, match="torch-sdpa's decode path does not implement softcap"):
        sdpa.run_decode(softcapped, init_params(softcapped), x, prefill=1)


@pytest.mark.parametrize(("name", "why"), [("torch-mha", "nn.MultiheadAttention's API has no KV cache")])
def test_the_other_torch_paths_say_why_they_do_not_decode(name, why):  # torch-tp decodes: test_decode_sharded.py
    cfg = config()
    backend = get_backend(name)
    assert backend.decode_caches == () and why in backend.decode_unsupported
    with pytest.raises(UnsupportedCase, match=f"{name} has no KV-cache decoding: .*{why}"):
        backend.run_decode(cfg, init_params(cfg), sequence(), prefill=1)


# -- torch-flex: eager flex_attention is slow on the CPU (a BlockMask per chunk), so fewer runs --------------

FLEX_CASES = {
    "gqa_rope_window_left_padded": ({"n_kv_heads": 2, "rope": "half", "window": 3}, True, [(1, 1), (6, 2)]),
    "partial_interleaved_right_padded": ({"n_kv_heads": 2, "rope": "interleaved", "rope_dims": 4}, False, [(3, 2)]),
    "softcap_alibi": ({"softcap": 2.0, "alibi": True, "bias": False}, None, [(2, 3)]),
    "sinks_t5_qk_norm": ({"sinks": True, "rel_buckets": 6, "rel_max_distance": 8, "qk_norm": "head"}, None, [(5, 1)]),
}


@pytest.mark.parametrize("case", FLEX_CASES)
def test_the_flex_oracle_decodes_through_a_block_mask_over_its_cache(case):
    overrides, left_padded, splits = FLEX_CASES[case]
    cfg = config(**overrides)
    params, x = init_params(cfg, seed=20), sequence(tokens=10)
    mask = None
    if left_padded is not None:
        mask = np.ones((2, 10), dtype=bool)
        if left_padded:
            mask[1, :3] = False
        else:
            mask[0, -3:] = False
    expected = reference_decode(cfg, params, x, prefill=1, mask=mask)
    flex = get_backend("torch-flex")
    for prefill, step in splits:
        prepared, inputs = flex.prepare_decode_run(cfg, params, x, prefill=prefill, step=step, mask=mask)
        assert_decode_close(prepared.output(), expected, "float64", f"flex {case} prefill={prefill} step={step}")
        assert prepared.info["cache"]["slots"] == 10
        last = inputs.chunks()[-1]
        assert prepared.info["masks"][-1] == f"BlockMask (2, {cfg.n_heads}, {last[1] - last[0]}, 10)"


def test_the_flex_oracle_step_stages():
    cfg = config(n_kv_heads=2, rope="half", qk_norm="projection", window=3)
    params, x = init_params(cfg, seed=21), sequence(tokens=7)
    flex = get_backend("torch-flex")
    prepared, inputs = flex.prepare_decode_run(cfg, params, x, prefill=3, step=2)
    for i, (chunk, want) in enumerate(
        zip(flex.decode_stages(prepared, cfg), reference_decode_stages(cfg, params, inputs), strict=True)
    ):
        assert set(chunk) == set(decode_stage_names(cfg))
        for stage in decode_stage_names(cfg):
            assert_decode_close(chunk[stage], want[stage], "float64", f"flex chunk {i} stage {stage}")


# -- the benchmark's step (prepare_decode) ------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("variants", [{}, {"window": 3}, {"alibi": True, "window": 5, "sinks": True}])
def test_the_timed_step_on_an_empty_cache_is_the_forward(cache, variants):
    """context=0: the step's tokens (x drawn first from the seed) through an empty cache are a full forward."""
    cfg = config(n_kv_heads=2, rope="half", **variants)
    params = init_params(cfg, seed=17)
    prepared = get_backend("torch").prepare_decode(
        cfg, params, context=0, batch=2, step=3, dtype="float64", cache=cache
    )
    x = np.random.default_rng(0).standard_normal((2, 3, cfg.d_model))
    assert_decode_close(prepared.output(), reference_decode(cfg, params, x, prefill=3), "float64", "context 0")


@pytest.mark.parametrize("variants", [{}, {"window": 4}, {"rel_buckets": 6, "rel_max_distance": 8, "window": 6}])
@pytest.mark.parametrize(("context", "step"), [(2, 1), (9, 1), (9, 2), (40, 3)])
def test_the_timed_step_is_the_same_step_every_call_in_both_caches(variants, context, step):
    """The same random cache (same seed) in both kinds gives the same step; a second call repeats the first."""
    cfg = config(n_kv_heads=2, rope="half", **variants)
    params, backend = init_params(cfg, seed=18), get_backend("torch")
    outputs = {}
    for cache in ("dynamic", "static"):
        prepared = backend.prepare_decode(cfg, params, context=context, step=step, dtype="float64", cache=cache)
        first, second = prepared.output(), prepared.output()
        np.testing.assert_array_equal(first, second)  # the cache's state is put back after each call
        assert first.shape == (1, step, cfg.d_model)
        outputs[cache] = first
        ring = ring_capacity(cfg, step)
        slots = context + step if ring is None else min(ring, context + step)
        assert prepared.info["cache"]["slots"] == slots and prepared.info["cache"]["kind"] == cache
        assert prepared.info["cache"]["bytes"] == cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * 8
    np.testing.assert_allclose(outputs["dynamic"], outputs["static"], rtol=0, atol=1e-14)


def test_the_timed_step_refuses_bad_sizes():
    cfg = config()
    with pytest.raises(ValueError, match="context must be an int >= 0"):
        get_backend("torch").prepare_decode(cfg, init_params(cfg), context=-1)
    with pytest.raises(UnsupportedCase, match="torch-mha has no KV-cache decoding"):
        get_backend("torch-mha").prepare_decode(cfg, init_params(cfg), context=4)


@pytest.mark.parametrize(
    ("variants", "context", "step"),
    [({}, 0, 3), ({}, 12, 1), ({}, 12, 3), ({"window": 5}, 3, 2), ({"alibi": True}, 7, 2), ({"qk_norm": "head"}, 5, 1)],
)
@pytest.mark.parametrize("oracle_name", ["torch-sdpa", "torch-flex"])
def test_the_oracles_time_the_same_step_as_ours(oracle_name, variants, context, step):
    """One seed, one random cache (`random_cache`): each oracle's step equals torch's, dynamic and static."""
    cfg = config(n_kv_heads=2, rope="half", **variants)
    params = init_params(cfg, seed=19)
    oracle = get_backend(oracle_name).prepare_decode(cfg, params, context=context, step=step, dtype="float64")
    expected = oracle.output()
    np.testing.assert_array_equal(expected, oracle.output())
    assert oracle.info["cache"]["slots"] == context + step
    for cache in ("dynamic", "static"):
        ours = get_backend("torch").prepare_decode(
            cfg, params, context=context, step=step, dtype="float64", cache=cache
        )
        assert_decode_close(ours.output(), expected, "float64", f"{cache} step at context {context}")
