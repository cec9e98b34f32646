"""Llama 4's chunked local attention (``attention_chunk_size``): the registry entry, its mask on positions,
the tiles the chunked strategies visit, decode across chunk boundaries, FlexAttention's mask_mod, diagnose.

Hand-computed masks (chunks of 3 over 8 positions), the float64 output of a one-head identity layer
against softmax rows written out, the tile plan against an independent count from the full mask, the
decode rule with a cache offset, and the two planted mistakes named by diagnose.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from mha_rosetta.backends import CHUNKED, get_backend
from mha_rosetta.backends._chunking import plan_tiles
from mha_rosetta.core import MHAConfig, MHAParams, assert_close, init_params, reference_mha
from mha_rosetta.core.decode import decode_allowed
from mha_rosetta.core.variants import VARIANT_REGISTRY, chunk_allowed

# Chunks of 3 over positions 0..7: {0, 1, 2}, {3, 4, 5}, {6, 7}; causal inside each.
CHUNKS_OF_3 = np.array(
    [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 1, 1],
    ],
    dtype=bool,
)
X = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5], [0.5, -1.0], [1.5, 0.5], [0.0, -2.0], [1.0, 0.0]])


def _identity_layer(**variants) -> tuple[MHAConfig, MHAParams]:
    """One head of 2 features, every weight the identity, no bias, scale 1: the scores are x_i . x_j."""
    eye = np.eye(2)
    return MHAConfig(d_model=2, n_heads=1, bias=False, scale=1.0, **variants), MHAParams(eye, eye, eye, eye)


def _attend(allowed: np.ndarray) -> np.ndarray:
    scores = np.where(allowed, X @ X.T, -np.inf)  # (8, 8)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ X


def test_the_chunk_mask_is_written_out_by_hand():
    positions = np.arange(8)[None]
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    np.testing.assert_array_equal(chunk_allowed(3, positions, positions)[0, 0] & (j <= i), CHUNKS_OF_3)
    # On positions, not indices: tokens at 4, 5, 6 cut at 6 (4 and 5 share chunk 1, 6 starts chunk 2).
    shifted = np.array([[4, 5, 6]])
    np.testing.assert_array_equal(chunk_allowed(3, shifted, shifted)[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 1]])


def test_the_float64_forward_is_the_softmax_over_each_chunk():
    cfg, params = _identity_layer(causal=True, attention_chunk_size=3)
    output = reference_mha(cfg, params, X)
    assert_close(output, _attend(CHUNKS_OF_3), "float64")
    # A chunk as long as the sequence is plain causal attention; C = 1 is each token attending to itself.
    long_cfg, _ = _identity_layer(causal=True, attention_chunk_size=8)
    assert_close(reference_mha(long_cfg, params, X), _attend(np.tril(np.ones((8, 8), dtype=bool))), "float64")
    one_cfg, _ = _identity_layer(causal=True, attention_chunk_size=1)
    assert_close(reference_mha(one_cfg, params, X), X, "float64")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"])
def test_a_chunk_size_that_is_not_a_positive_int_is_refused_by_name(bad):
    with pytest.raises((ValueError, TypeError), match="attention_chunk_size"):
        MHAConfig(d_model=4, n_heads=1, causal=True, attention_chunk_size=bad)


def test_the_entry_is_a_positional_mask_of_the_registry():
    entry = VARIANT_REGISTRY["chunked"]
    assert (entry.score_step.place, entry.score_step.op) == ("mask", "positional_mask")
    assert MHAConfig(d_model=4, n_heads=1, attention_chunk_size=2).variants == ("chunked",)
    assert MHAConfig(d_model=4, n_heads=1).attention_chunk_size is None


def test_decode_keeps_the_boundary_across_steps_with_the_cache_offset():
    """A query at position 6 after a cache of 0..5 starts chunk 2: it sees itself only; one at 5 sees 3, 4, 5."""
    cfg = MHAConfig(d_model=4, n_heads=1, causal=True, attention_chunk_size=3)
    cache = np.arange(7)[None]  # (1, T): positions 0..6 in the cache, the step's own included
    valid = np.ones((1, 7), dtype=bool)
    np.testing.assert_array_equal(decode_allowed(cfg, np.array([[6]]), cache, valid)[0, 0, 0], [0] * 6 + [1])
    np.testing.assert_array_equal(decode_allowed(cfg, np.array([[5]]), cache, valid)[0, 0, 0], [0, 0, 0, 1, 1, 1, 0])
    # The rows of a whole decode run are the forward's mask rows.
    every = decode_allowed(cfg, np.arange(8)[None], np.arange(8)[None], np.ones((1, 8), dtype=bool))[0, 0]
    np.testing.assert_array_equal(every, CHUNKS_OF_3)


def _tiles_with_an_allowed_pair(allowed: np.ndarray, chunk: tuple[int, int]) -> int:
    q_block, k_block = chunk
    return sum(
        bool(allowed[i : i + q_block, j : j + k_block].any())
        for i in range(0, allowed.shape[0], q_block)
        for j in range(0, allowed.shape[1], k_block)
    )


def test_the_plan_visits_only_the_tiles_inside_a_chunk_counted_by_hand():
    """12 tokens, blocks of 2, chunks of 4: query block b sees key blocks 2 (b // 2) .. b, so 1, 2, 1, 2, 1, 2
    tiles: 9 planned, 15 above the diagonal, 12 wholly outside every query's chunk, of 36."""
    positions = np.arange(12)[None]
    plan = plan_tiles((2, 2), 12, 12, True, None, positions, positions, chunk_size=4)
    assert plan.counts == {"total": 36, "above_diagonal": 15, "outside_window": 0, "outside_chunk": 12, "planned": 9}
    assert [len(keys) for _, keys in plan.blocks] == [1, 2, 1, 2, 1, 2]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "two_sided"])
@pytest.mark.parametrize(
    ("tokens", "size", "chunk"), [(12, 4, (3, 3)), (20, 3, (4, 2)), (17, 6, (5, 3)), (9, 16, (2, 4))]
)
def test_the_numpy_chunked_strategy_plans_exactly_the_tiles_it_needs(causal, tokens, size, chunk):
    cfg = MHAConfig(d_model=6, n_heads=2, causal=causal, attention_chunk_size=size)
    params = init_params(cfg)
    x = np.random.default_rng(tokens).standard_normal((1, tokens, 6))
    prepared, _ = get_backend("numpy").prepare(cfg, params, x, strategy=CHUNKED, chunk=chunk)
    i, j = np.arange(tokens)[:, None], np.arange(tokens)[None, :]
    allowed = (i // size == j // size) & ((j <= i) if causal else True)
    assert prepared.info["tiles"]["planned"] == _tiles_with_an_allowed_pair(allowed, chunk)
    assert np.max(np.abs(prepared.to_numpy(prepared.forward()) - reference_mha(cfg, params, x))) < 1e-13


@pytest.mark.parametrize("name", ["torch", "jax", "mlx"])
def test_the_other_chunked_strategies_agree_at_shifted_positions(name):
    """Positions 5.. in item 0: chunk boundaries at 6 and 9, not at the indices 3 and 6."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True, attention_chunk_size=3, rope="interleaved")
    params = init_params(cfg)
    x = np.random.default_rng(7).standard_normal((2, 7, 8))
    positions = np.array([[5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6]])
    output = get_backend(name).run(cfg, params, x, strategy=CHUNKED, chunk=(2, 2), positions=positions)
    assert (
        np.max(np.abs(np.asarray(output, dtype=np.float64) - reference_mha(cfg, params, x, positions=positions))) < 1e-5
    )


def test_flex_mask_mod_is_the_chunk_mask_cell_by_cell_and_the_output_follows():
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no FlexAttention (torch >= 2.5)")
    import torch

    from mha_rosetta.backends.oracles.flex import flex_attend
    from mha_rosetta.core import prepare_inputs

    cfg, params = _identity_layer(causal=True, attention_chunk_size=3)
    _, block_mask = flex_attend(cfg, prepare_inputs(cfg, X), "float64", "cpu", compiled=False)
    q_idx, kv_idx = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    np.testing.assert_array_equal(block_mask.mask_mod(zero, zero, q_idx, kv_idx).numpy(), CHUNKS_OF_3)
    assert_close(get_backend("torch-flex").run(cfg, params, X), _attend(CHUNKS_OF_3), "float64")


@pytest.mark.parametrize("bug", ["chunk boundary off by one", "chunk forgotten"])
def test_diagnose_names_each_planted_chunk_mistake(bug):
    from mha_rosetta.diagnose.confusion import confusion

    outcomes = [o for o in confusion(settings=["llama4-chunked"], frameworks=["numpy"]) if o.bug == bug]
    assert outcomes and all(o.named == "chunked" == o.expected for o in outcomes)
