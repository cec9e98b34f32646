"""The variants (issue 24) in the JAX family: the JAX adapter and its chunked strategy, einops on
every array library, the JAX oracles and jax-sharded, beyond the check's own cases.

`tests/test_adapters.py` and `tests/test_grad.py` already run every variant case on every
implementation that declares it (forward at every stage, backward with the new parameter
gradients). This module adds what those cases do not reach: every variant at once under
grouped kv heads (the per-head entries mapped with the heads as (Hkv, G)), windows longer than
one key block (whole tiles skipped) and on positions that are not the indices (no skipping),
the sinks of a row with no allowed key, the libraries' own spellings (local_window_size,
bias=, the logsumexp residual), the split of per-head parameters over devices, and that a
variant configuration compiles once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import importable, requires
from mha_rosetta.backends import UnsupportedCase, get_backend
from mha_rosetta.core import (
    MHAConfig,
    alibi_slopes,
    assert_close,
    compare,
    grad_tolerance,
    init_params,
    prepare_inputs,
    reference_mha,
    reference_stages,
    stage_names,
)
from mha_rosetta.core.grad import reference_mha_vjp

pytestmark = requires("jax")

# Every variant the spec has but rope_scaling (covered by the llama3 and gpt-oss cases), under
# GQA (4 heads over 2 kv heads), bias on q, k and v only, QK-norm over the projection; T5's buckets one-sided.
GQA_ROTARY = dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=6, bias="qkv", causal=True, rope="half")
T5_BUCKETS = dict(rel_buckets=6, rel_max_distance=7, rel_bidirectional=False)
EVERYTHING = MHAConfig(**GQA_ROTARY, window=3, softcap=2.0, qk_norm="projection", alibi=True, **T5_BUCKETS, sinks=True)


def _inputs(cfg: MHAConfig, n: int = 9, seed: int = 0):
    return np.random.default_rng(seed).standard_normal((2, n, cfg.d_model))


def _library(name: str) -> str:
    return {"einops-numpy": "einops", "einops-torch": "torch", "einops-jax": "einops"}.get(name, "jax")


@pytest.mark.parametrize(
    ("name", "strategy"),
    [("jax", s) for s in ("standard", "chunked")] + [(f"einops-{a}", "standard") for a in ("numpy", "torch", "jax")],
)
def test_every_variant_at_once_under_gqa_matches_every_reference_stage(name, strategy):
    if not importable(_library(name)):
        pytest.skip(f"{_library(name)} is not importable")
    cfg, params, query = EVERYTHING, init_params(EVERYTHING, seed=3), _inputs(EVERYTHING)
    options = {"chunk": (2, 3)} if strategy == "chunked" else {}
    output, stages = get_backend(name).run(cfg, params, query, return_stages=True, strategy=strategy, **options)
    reference = reference_stages(cfg, params, query)
    assert_close(output, reference["output"], "float64")
    hidden = ("scores", "capped_scores", "biased_scores", "masked_scores", "weights") if strategy == "chunked" else ()
    expected = [name for name in stage_names(cfg) if name not in hidden]
    assert sorted(stages) == sorted(expected)
    with np.errstate(invalid="ignore"):  # -inf - -inf in the masked scores
        for stage in expected:
            assert_close(stages[stage], reference[stage], "float64", what=stage)


@pytest.mark.parametrize("name", ["jax", "einops-torch", "einops-jax"])
def test_every_variant_at_once_backward_matches_the_oracle(name):
    if not importable(_library(name)):
        pytest.skip(f"{_library(name)} is not importable")
    cfg, params, query = EVERYTHING, init_params(EVERYTHING, seed=3), _inputs(EVERYTHING)
    expected = reference_mha_vjp(cfg, params, query).tensors()
    actual = get_backend(name).run_vjp(cfg, params, query).tensors()
    assert set(actual) == set(expected)  # q_norm, k_norm, sinks and rel_bias among them; no b_o
    assert {"q_norm", "k_norm", "sinks", "rel_bias"} <= set(actual) and "b_o" not in actual
    for tensor, value in expected.items():
        assert compare(actual[tensor], value, "float64", **vars(grad_tolerance("float64", value))).ok, tensor


# -- the chunked strategy -------------------------------------------------------------------
def test_key_block_range_skips_whole_tiles_outside_the_window():
    """Hand-computed: queries 6..8 (q_block 3), keys in blocks of 4, a window of 3 keys."""
    from mha_rosetta.backends.jax.chunked import _key_block_range

    causal = MHAConfig(d_model=4, n_heads=1, causal=True, window=3)
    two_sided = dataclasses.replace(causal, causal=False)
    # Causal: query 6 sees keys 4..6, query 8 keys 6..8: blocks 1 (keys 4-7) and 2 (8-11) of 5; the
    # causal stop (3) is the block's entry of the k_stop table (next test).
    first, stop = _key_block_range(6, 3, 5, cfg=causal, q_block=3, k_block=4, skip=True)
    assert (int(first), int(stop)) == (1, 3)
    # Two-sided: keys 4..10, the same blocks; without skip (other positions) every block.
    first, stop = _key_block_range(6, None, 5, cfg=two_sided, q_block=3, k_block=4, skip=True)
    assert (int(first), int(stop)) == (1, 3)
    assert _key_block_range(6, None, 5, cfg=two_sided, q_block=3, k_block=4, skip=False) == (0, 5)
    # Causal without skip still stops where the table says.
    first, stop = _key_block_range(6, 3, 5, cfg=causal, q_block=3, k_block=4, skip=False)
    assert (first, int(stop)) == (0, 3)


def test_chunked_trip_counts_follow_the_positions():
    """Hand-computed k_stop: the key blocks (of 4) each query block (of 3) visits under causal, on positions."""
    from mha_rosetta.backends.jax.chunked import chunked_tables

    cfg = MHAConfig(d_model=4, n_heads=1, causal=True)
    # Top-left (default positions, 9 queries over 9 keys): queries 0-2 see keys 0..2 (block 0),
    # 3-5 keys 0..5 (blocks 0-1), 6-8 keys 0..8 (blocks 0-2).
    square = prepare_inputs(cfg, np.zeros((9, 4)))
    np.testing.assert_array_equal(chunked_tables(cfg, square, (3, 4), "float64")[0]["k_stop"], [1, 2, 3])
    # Bottom-right (a decode step: 3 queries at positions 6..8 over 9 cached keys at 0..8): every key
    # up to 8 is visible to the last query, so all 3 blocks; on the indices it would be 1.
    step = prepare_inputs(cfg, np.zeros((3, 4)), np.zeros((9, 4)), positions=np.arange(6, 9), kv_positions=np.arange(9))
    np.testing.assert_array_equal(chunked_tables(cfg, step, (3, 4), "float64")[0]["k_stop"], [3])
    # Queries 6..8 in blocks of 1: query 6 sees keys 0..6 (2 blocks), 7 and 8 their 8 and 9 keys (2, 3).
    np.testing.assert_array_equal(chunked_tables(cfg, step, (1, 4), "float64")[0]["k_stop"], [2, 2, 3])


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_window_longer_than_a_block_matches_the_oracle_and_says_what_it_skips(causal):
    cfg = MHAConfig(d_model=12, n_heads=2, causal=causal, window=5, sinks=True, alibi=True)
    params, query = init_params(cfg, seed=4), _inputs(cfg, n=23)
    prepared, _ = get_backend("jax").prepare(cfg, params, query, strategy="chunked", chunk=(4, 3))
    assert_close(prepared.output(), reference_mha(cfg, params, query), "float64")
    assert prepared.info["tile_skipping"].startswith("key blocks outside the window of 5")


def test_chunked_window_on_positions_that_are_not_the_indices():
    """Positions with gaps: the window counts positions, so no tile is skipped by index, and it still agrees."""
    cfg = MHAConfig(d_model=12, n_heads=2, causal=True, window=4, alibi=True, rel_buckets=6, rel_max_distance=9)
    params, query = init_params(cfg, seed=5), _inputs(cfg, n=11)
    positions = np.array([0, 1, 2, 5, 6, 7, 8, 12, 13, 20, 21])  # two tokens 3 apart are outside the window
    prepared, _ = get_backend("jax").prepare(cfg, params, query, strategy="chunked", chunk=(3, 2), positions=positions)
    assert_close(prepared.output(), reference_mha(cfg, params, query, positions=positions), "float64")
    assert prepared.info["tile_skipping"].startswith("none by index (custom positions)")


def test_chunked_sinks_give_a_row_with_no_allowed_key_a_zero_context():
    cfg = MHAConfig(d_model=12, n_heads=2, sinks=True, softcap=1.5)
    params, query = init_params(cfg, seed=6), _inputs(cfg, n=7)
    mask = np.ones((2, 1, 7, 7), dtype=bool)
    mask[1, :, 4] = False  # query 4 of item 1 may attend to nothing: with a sink the denominator is still > 0
    for strategy, options in (("standard", {}), ("chunked", {"chunk": (2, 3)})):
        output = get_backend("jax").run(cfg, params, query, mask=mask, strategy=strategy, **options)
        expected = reference_mha(cfg, params, query, mask=mask)
        assert_close(output, expected, "float64")
        np.testing.assert_allclose(output[1, 4], params.b_o, rtol=0, atol=1e-15)  # zero context: the output is b_o


# -- the oracles ----------------------------------------------------------------------------
def test_dot_product_attention_spells_the_window_as_local_window_size():
    for causal, spelling in ((True, "(2, 0)"), (False, "(2, 2)")):
        cfg = MHAConfig(d_model=12, n_heads=2, causal=causal, window=3)
        params, query = init_params(cfg, seed=7), _inputs(cfg, n=8)
        prepared, _ = get_backend("jax-dpa").prepare(cfg, params, query, dtype="float32")
        assert prepared.info["window"] == f"local_window_size={spelling}"
        assert prepared.info["is_causal"] is causal
        assert_close(prepared.output(), reference_mha(cfg, params, query), "float32")
    # Positions that are not the indices: the window goes into the mask (and causality with it).
    positions = np.array([0, 1, 4, 5, 6, 9, 10, 11])
    prepared, _ = get_backend("jax-dpa").prepare(cfg, params, query, dtype="float32", positions=positions)
    assert prepared.info["window"] == "in the mask (on the positions)"
    assert_close(prepared.output(), reference_mha(cfg, params, query, positions=positions), "float32")


def test_dot_product_attention_sinks_come_from_its_logsumexp_and_have_no_backward_there():
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True, sinks=True, alibi=True)
    params, query = init_params(cfg, seed=8), _inputs(cfg, n=6)
    backend = get_backend("jax-dpa")
    assert_close(backend.run(cfg, params, query, dtype="float32"), reference_mha(cfg, params, query), "float32")
    with pytest.raises(UnsupportedCase, match="ignores the cotangent of its logsumexp"):
        backend.run_vjp(cfg, params, query, dtype="float32")
    no_sinks = dataclasses.replace(cfg, sinks=False)  # ALiBi alone has its backward
    grads = backend.run_vjp(no_sinks, init_params(no_sinks, seed=8), query, dtype="float32").tensors()
    expected = reference_mha_vjp(no_sinks, init_params(no_sinks, seed=8), query).tensors()
    for tensor, value in expected.items():
        assert compare(grads[tensor], value, "float32", **vars(grad_tolerance("float32", value))).ok, tensor


@pytest.mark.parametrize(
    ("name", "cfg", "fragment"),
    [
        ("jax-dpa", MHAConfig(d_model=12, n_heads=2, softcap=3.0), "never exposed between the product and the softmax"),
        ("flax", MHAConfig(d_model=12, n_heads=2, sinks=True), "no extra logit in the denominator"),
        ("flax", MHAConfig(d_model=12, n_heads=2, qk_norm="head"), "LayerNorm"),
        ("flax", MHAConfig(d_model=12, n_heads=2, bias="qkv"), "one use_bias"),
        ("equinox", MHAConfig(d_model=12, n_heads=2, alibi=True), "process_heads hook sees only q, k and v"),
        (
            "equinox",
            MHAConfig(d_model=12, n_heads=2, rope="half", rope_scaling={"rope_type": "linear", "factor": 2.0}),
            "no frequency scaling",
        ),
    ],
)
def test_a_variant_the_library_cannot_express_is_unsupported_with_the_reason(name, cfg, fragment):
    if not importable(name if name != "jax-dpa" else "jax"):
        pytest.skip(f"{name} is not importable")
    backend = get_backend(name)
    reason = backend.unsupported_reason(cfg, "float32", "cpu", "standard")
    assert reason is not None and fragment in reason
    with pytest.raises(UnsupportedCase):
        backend.prepare(cfg, init_params(cfg), _inputs(cfg, n=4), dtype="float32")


def test_jax_dpa_states_the_registrys_refusals_among_its_known_differences():
    """Each variant it has no hook for is refused with the registry's sentence, and says so in its differences."""
    from mha_rosetta.backends.oracles.jax_dpa import KERNEL, JaxDotProductAttentionOracle
    from mha_rosetta.core.variants import kernel_refusals

    refused = kernel_refusals(KERNEL, JaxDotProductAttentionOracle.variants)
    assert set(refused) == {"softcap", "gate"}  # the sinks come back through its logsumexp
    assert refused["softcap"] == (
        "jax.nn.dot_product_attention has no softcap: the scores are never exposed between the product and the softmax"
    )
    for why in refused.values():
        assert f"{why} (refused)" in JaxDotProductAttentionOracle.known_differences


@requires("flax")
def test_flax_relative_bias_through_its_attention_fn_forward_and_backward():
    """T5's bias at the default scale (the check's T5 cases use scale 1, which Flax cannot): d_rel_bias comes back."""
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True, alibi=True, rel_buckets=6, rel_max_distance=8)
    params, query = init_params(cfg, seed=9), _inputs(cfg, n=7)
    backend = get_backend("flax")
    assert_close(backend.run(cfg, params, query), reference_mha(cfg, params, query), "float64")
    grads = backend.run_vjp(cfg, params, query).tensors()
    expected = reference_mha_vjp(cfg, params, query).tensors()
    assert set(grads) == set(expected)
    for tensor, value in expected.items():
        assert compare(grads[tensor], value, "float64", **vars(grad_tolerance("float64", value))).ok, tensor


@requires("equinox")
def test_equinox_qkv_bias_leaves_the_output_projection_without_one():
    cfg = MHAConfig(d_model=12, n_heads=3, bias="qkv", window=2)
    params, query = init_params(cfg, seed=10), _inputs(cfg, n=6)
    backend = get_backend("equinox")
    assert_close(backend.run(cfg, params, query), reference_mha(cfg, params, query), "float64")
    grads = backend.run_vjp(cfg, params, query).tensors()
    assert "b_o" not in grads and "b_v" in grads
    expected = reference_mha_vjp(cfg, params, query).tensors()
    for tensor, value in expected.items():
        assert compare(grads[tensor], value, "float64", **vars(grad_tolerance("float64", value))).ok, tensor


# -- jax-sharded ----------------------------------------------------------------------------
def test_variant_shards_split_per_head_parameters_with_the_heads():
    from mha_rosetta.backends.sharded.jax import variant_shards

    cfg = MHAConfig(d_model=18, n_heads=6, n_kv_heads=2, qk_norm="projection", alibi=True, sinks=True, rel_buckets=4)
    params = init_params(cfg, seed=11)
    shards = variant_shards(cfg, params, 2)
    # Rank 1 holds heads 3..5 with the 6-head layer's slopes (not those of a 3-head layer).
    np.testing.assert_array_equal(shards[1]["slopes"], alibi_slopes(6)[3:])
    assert not np.allclose(shards[1]["slopes"], alibi_slopes(3))
    np.testing.assert_array_equal(shards[1]["sinks"], params.sinks[3:])
    np.testing.assert_array_equal(shards[1]["rel_bias"], params.rel_bias[:, 3:])
    np.testing.assert_array_equal(shards[1]["q_norm"], params.q_norm[9:])  # features of heads 3..5, d_k 3
    np.testing.assert_array_equal(shards[1]["k_norm"], params.k_norm[3:])  # kv head 1
    head = dataclasses.replace(cfg, qk_norm="head")
    for shard in variant_shards(head, init_params(head, seed=11), 2):  # replicated
        np.testing.assert_array_equal(shard["q_norm"], init_params(head, seed=11).q_norm)


@pytest.mark.parametrize("strategy", ["standard", "named_sharding"])
def test_jax_sharded_alibi_with_six_heads_and_projection_norm_statistics(strategy):
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    backend = JaxShardedBackend(world=3)
    try:
        for cfg in (
            MHAConfig(d_model=18, n_heads=6, causal=True, alibi=True, sinks=True, rel_buckets=4),
            MHAConfig(d_model=18, n_heads=6, n_kv_heads=3, qk_norm="projection", window=2),
        ):
            params, query = init_params(cfg, seed=12), _inputs(cfg, n=5)
            prepared, _ = backend.prepare(cfg, params, query, strategy=strategy)
            assert_close(prepared.output(), reference_mha(cfg, params, query), "float64")
            if strategy == "standard":
                # The partial outputs' psum, and with projection QK-norm the psums of the sums of squares.
                assert prepared.info["all_reduces"] == (2 if cfg.qk_norm == "projection" else 1)
                assert ("sums of squares" in prepared.info["collectives"]) == (cfg.qk_norm == "projection")
    finally:
        backend.close()


# -- compiled once --------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "strategy"), [("jax", "standard"), ("jax", "chunked"), ("einops-jax", "standard")])
def test_a_variant_configuration_compiles_once(monkeypatch, name, strategy):
    import jax

    from mha_rosetta.backends.jax import common

    if not importable(_library(name)):
        pytest.skip(f"{_library(name)} is not importable")
    compiles = [0]

    def count(event: str, duration: float, **kwargs) -> None:
        compiles[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(count)
    monkeypatch.setattr(common, "_PROGRAMS", {})
    backend = get_backend(name)

    def output(seed: int):
        prepared, _ = backend.prepare(
            EVERYTHING,
            init_params(EVERYTHING, seed=seed),
            _inputs(EVERYTHING, seed=seed),
            dtype="float32",
            strategy=strategy,
        )
        prepared.compile()
        return prepared.output()

    try:
        output(1)
        before = compiles[0]
        second = output(2)  # other parameters (sinks, norms, table) and inputs: the same program
        assert compiles[0] == before
        expected = reference_mha(EVERYTHING, init_params(EVERYTHING, seed=2), _inputs(EVERYTHING, seed=2))
        assert_close(second, expected, "float32")  # seed 2's answer: the variant parameters are traced arguments
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
