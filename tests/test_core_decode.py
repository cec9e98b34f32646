"""The decode contract written down once (`core.decode`, `core.inputs.causal_allowed`, `Backend.run_decode`).

Hand-computed cases: the chunks of a run, the positions a padding mask gives, the ring's
size, the causal and window rule on positions for a decode step, and the oracle's identity
with the full causal forward. A chunk-by-chunk NumPy decode written here from the formulas
(no backend) proves that the rules, applied to a cache, give the oracle's numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends import Backend, UnsupportedCase
from mha_rosetta.core import MHAConfig, causal_allowed, causal_on_indices, init_params, prepare_inputs, reference_mha
from mha_rosetta.core.decode import (
    CacheFull,
    cache_capacity,
    check_capacity,
    decode_allowed,
    decode_stage_names,
    padding_positions,
    prepare_decode_inputs,
    reference_decode,
    reference_decode_stages,
    ring_capacity,
)
from mha_rosetta.core.rotary import apply_rotary, rotary_tables

CFG = MHAConfig(d_model=12, n_heads=3, n_kv_heads=1, rope="half", causal=True)


def _x(batch=2, tokens=9, width=12, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, tokens, width))


# -- causality on positions ------------------------------------------------------------------
def test_causal_on_positions_is_bottom_right_on_a_decode_step():
    # 2 queries at positions 3, 4 over 5 cached keys at 0..4: query 3 sees keys 0..3, query 4 all.
    allowed = causal_allowed(np.array([[3, 4]]), np.arange(5)[None])
    assert allowed.shape == (1, 1, 2, 5)
    assert allowed[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    # The default positions: top-left, the same as the index rule.
    inputs = prepare_inputs(CFG, _x(tokens=4))
    assert causal_on_indices(inputs)
    step = prepare_inputs(CFG, _x(tokens=2), _x(tokens=5), positions=[3, 4], kv_positions=np.arange(5))
    assert not causal_on_indices(step)


def test_the_oracle_reads_causality_on_positions():
    """The last two queries of a full causal forward equal a decode step of those two over all five keys."""
    params = init_params(CFG, seed=1)
    x = _x(tokens=5)
    full = reference_mha(CFG, params, x)
    step = reference_mha(CFG, params, x[:, 3:], x, x, positions=[3, 4], kv_positions=np.arange(5))
    assert np.max(np.abs(step - full[:, 3:])) < 1e-14


class _TopLeft(Backend):
    """A plugin that declares nothing (rule 7): a bottom-right step is unsupported, with the reason."""

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):  # pragma: no cover - never reached
        raise AssertionError("prepare must refuse first")


def test_a_backend_masking_top_left_is_unsupported_on_a_decode_step():
    backend = _TopLeft("top-left")
    x = _x(tokens=5)
    with pytest.raises(UnsupportedCase, match="top-left causal rule on indices"):
        backend.prepare(CFG, init_params(CFG), x[:, 3:], x, x, positions=[3, 4], kv_positions=np.arange(5))


# -- the inputs of a decode run ----------------------------------------------------------------
def test_chunks_are_the_prefill_then_each_step():
    x = _x(tokens=9)
    assert prepare_decode_inputs(CFG, x, prefill=3, step=2).chunks() == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert prepare_decode_inputs(CFG, x, prefill=4, step=2).chunks() == [(0, 4), (4, 6), (6, 8), (8, 9)]
    assert prepare_decode_inputs(CFG, x, prefill=9).chunks() == [(0, 9)]
    assert prepare_decode_inputs(CFG, x, prefill=1).chunks() == [(0, 1)] + [(t, t + 1) for t in range(1, 9)]


def test_positions_from_a_padding_mask_are_cumsum_minus_one():
    mask = np.array([[False, False, True, True, True], [True, True, True, False, False]])
    assert padding_positions(mask).tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 2, 2]]
    inputs = prepare_decode_inputs(CFG, _x(tokens=5), prefill=2, mask=mask)
    assert inputs.positions.tolist() == [[-1, -1, 0, 1, 2], [0, 1, 2, 2, 2]]
    assert inputs.forward_mask().shape == (2, 1, 1, 5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prefill": 0}, ValueError, r"prefill must be between 1 and the sequence's 9 tokens, got 0"),
        ({"prefill": 10}, ValueError, r"prefill must be between 1 and the sequence's 9 tokens, got 10"),
        ({"prefill": 2.0}, TypeError, r"prefill must be an int"),
        ({"prefill": 2, "step": 0}, ValueError, r"step must be at least 1"),
        (
            {"prefill": 2, "positions": [0, 1, 2, 1, 4, 5, 6, 7, 8]},
            ValueError,
            "must not go backwards.*from 2 at token 2",
        ),
        ({"prefill": 2, "positions": np.arange(8)}, ValueError, r"positions must have shape \(9,\) or \(batch=2, 9\)"),
        ({"prefill": 2, "mask": np.ones(9)}, TypeError, "padding mask"),
    ],
)
def test_bad_decode_arguments_name_the_rule(kwargs, error, match):
    with pytest.raises(error, match=match):
        prepare_decode_inputs(CFG, _x(tokens=9), **kwargs)


def test_decoding_needs_a_causal_self_attention_config():
    with pytest.raises(ValueError, match="causal=True"):
        prepare_decode_inputs(MHAConfig(d_model=12, n_heads=3), _x(), prefill=2)
    with pytest.raises(ValueError, match="kdim and vdim must equal d_model"):
        prepare_decode_inputs(MHAConfig(d_model=12, n_heads=3, kdim=5, causal=True), _x(), prefill=2)


def test_a_window_with_right_padding_followed_by_tokens_is_refused():
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True, window=3)
    mask = np.array([[True, True, False, True, True]])
    with pytest.raises(ValueError, match="ring buffer keeps the last 3 slots by index"):
        prepare_decode_inputs(cfg, _x(batch=1, tokens=5), prefill=2, mask=mask)
    left = np.array([[False, False, True, True, True]])  # left padding keeps the rule
    assert prepare_decode_inputs(cfg, _x(batch=1, tokens=5), prefill=2, mask=left).positions.tolist() == [
        [-1, -1, 0, 1, 2]
    ]


# -- caches -----------------------------------------------------------------------------------------
def test_the_ring_holds_w_minus_one_plus_step_slots():
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True, window=4)
    assert ring_capacity(cfg, 1) == 4 and ring_capacity(cfg, 3) == 6
    assert ring_capacity(CFG, 1) is None
    assert cache_capacity(cfg, 100, 1) == 4 and cache_capacity(cfg, 3, 1) == 3 and cache_capacity(CFG, 100, 2) == 100


def test_a_static_cache_past_its_capacity_says_by_how_much():
    check_capacity(8, 6, 2)
    with pytest.raises(CacheFull, match=r"holds 7 of 8 slots and cannot take 2 more \(allocate at least 9\)"):
        check_capacity(8, 7, 2)


def test_decode_allowed_reads_positions_validity_and_the_window():
    cfg = MHAConfig(d_model=12, n_heads=3, causal=True, window=2)
    # A ring of 3 slots holding positions 4, 2, 3 (slot 0 overwritten last); query at position 4.
    allowed = decode_allowed(cfg, np.array([[4]]), np.array([[4, 2, 3]]), np.array([[True, True, True]]))
    assert allowed.shape == (1, 1, 1, 3)
    assert allowed[0, 0, 0].tolist() == [True, False, True]  # window 2: positions 3 and 4
    empty = decode_allowed(CFG, np.array([[1]]), np.array([[0, 1, 0]]), np.array([[True, True, False]]))
    assert empty[0, 0, 0].tolist() == [True, True, False]  # an unwritten slot is never seen


# -- the oracle ----------------------------------------------------------------------------------
def test_reference_decode_is_the_full_causal_forward():
    params = init_params(CFG, seed=3)
    x = _x(tokens=7)
    expected = reference_mha(CFG, params, x)
    for prefill, step in ((1, 1), (3, 2), (7, 1)):
        assert np.array_equal(reference_decode(CFG, params, x, prefill=prefill, step=step), expected)
    assert reference_decode(CFG, params, x[0], prefill=2).shape == (7, 12)  # unbatched in, unbatched out


def test_decode_stages_are_the_token_wise_ones_sliced_per_chunk():
    cfg = MHAConfig(d_model=12, n_heads=3, n_kv_heads=1, rope="half", causal=True, qk_norm="head", softcap=5.0)
    names = decode_stage_names(cfg)
    assert "scores" not in names and "capped_scores" not in names and "weights" not in names
    assert names[:6] == ("q", "k", "v", "q_heads", "k_heads", "v_heads") and names[-1] == "output"
    assert "q_normed" in names and "k_rotated" in names
    params = init_params(cfg, seed=4)
    inputs = prepare_decode_inputs(cfg, _x(tokens=6), prefill=4, step=1)
    chunks = reference_decode_stages(cfg, params, inputs)
    full = reference_mha(cfg, params, inputs.x, return_stages=True)[1]
    assert len(chunks) == 3
    assert np.array_equal(chunks[1]["q_rotated"], full["q_rotated"][:, :, 4:5])  # (B, H, 1, Dk)
    assert np.array_equal(chunks[2]["k"], full["k"][:, 5:6])  # the new key, (B, 1, Hkv*Dk)
    assert np.array_equal(chunks[0]["output"], full["output"][:, :4])


def _numpy_cache_decode(cfg, params, inputs):
    """A decode loop from the formulas: a (B, Hkv, T, Dk) cache of rotated keys, each chunk attending to it."""
    p = params.as_dict()
    B, N = inputs.batch, inputs.tokens
    k_cache = np.zeros((B, cfg.n_kv_heads, 0, cfg.d_k))
    v_cache = np.zeros((B, cfg.n_kv_heads, 0, cfg.d_v))
    pos_cache, valid_cache = np.zeros((B, 0), dtype=np.int64), np.zeros((B, 0), dtype=bool)
    out = np.zeros((B, N, cfg.d_model))
    for start, stop in inputs.chunks():
        x, pos, valid = inputs.x[:, start:stop], inputs.positions[:, start:stop], inputs.valid[:, start:stop]
        n = stop - start
        q = (x @ p["w_q"].T + p["b_q"]).reshape(B, n, cfg.n_heads, cfg.d_k).transpose(0, 2, 1, 3)
        k = (x @ p["w_k"].T + p["b_k"]).reshape(B, n, cfg.n_kv_heads, cfg.d_k).transpose(0, 2, 1, 3)
        v = (x @ p["w_v"].T + p["b_v"]).reshape(B, n, cfg.n_kv_heads, cfg.d_v).transpose(0, 2, 1, 3)
        tables = rotary_tables(cfg, prepare_inputs(cfg, x, positions=pos))
        q = apply_rotary(q, tables.q_cos[:, None], tables.q_sin[:, None], tables.style)
        k = apply_rotary(k, tables.k_cos[:, None], tables.k_sin[:, None], tables.style)
        k_cache, v_cache = np.concatenate([k_cache, k], axis=2), np.concatenate([v_cache, v], axis=2)
        pos_cache, valid_cache = np.concatenate([pos_cache, pos], 1), np.concatenate([valid_cache, valid], 1)
        allowed = decode_allowed(cfg, pos, pos_cache, valid_cache)  # (B, 1, n, T)
        group = cfg.n_heads // cfg.n_kv_heads
        keys, values = np.repeat(k_cache, group, axis=1), np.repeat(v_cache, group, axis=1)  # the GQA repeat
        scores = np.where(allowed, cfg.scale * q @ np.swapaxes(keys, -1, -2), -np.inf)
        peak = scores.max(-1, keepdims=True)
        weights = np.where(np.isneginf(peak), 0.0, np.exp(scores - np.where(np.isneginf(peak), 0, peak)))
        weights = weights / np.where(weights.sum(-1, keepdims=True) == 0, 1, weights.sum(-1, keepdims=True))
        context = (weights @ values).transpose(0, 2, 1, 3).reshape(B, n, cfg.n_heads * cfg.d_v)
        out[:, start:stop] = context @ p["w_o"].T + p["b_o"]
    return out


@pytest.mark.parametrize(("prefill", "step"), [(1, 1), (3, 2), (5, 3), (8, 1)])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_a_cache_applying_the_rules_gives_the_oracle(prefill, step, padding):
    params = init_params(CFG, seed=5)
    x = _x(tokens=8, seed=6)
    mask = None
    if padding == "left":
        mask = np.array([[False, False, True, True, True, True, True, True], [True] * 8])
    elif padding == "right":
        mask = np.array([[True, True, True, False, True, True, True, True], [True] * 5 + [False] * 3])
    inputs = prepare_decode_inputs(CFG, x, prefill=prefill, step=step, mask=mask)
    expected = reference_decode(CFG, params, x, prefill=prefill, step=step, mask=mask)
    assert np.max(np.abs(_numpy_cache_decode(CFG, params, inputs) - expected)) < 1e-13


# -- the Backend entry points ----------------------------------------------------------------------
def test_a_backend_without_a_cache_is_unsupported_with_its_reason():
    class NoCache(Backend):
        decode_unsupported = "its API takes whole sequences only"

    with pytest.raises(UnsupportedCase, match="no-cache has no KV-cache decoding: its API takes whole sequences only"):
        NoCache("no-cache").run_decode(CFG, init_params(CFG), _x(), prefill=2)
    with pytest.raises(ValueError, match="prefill must be between"):  # bad input is reported before support
        NoCache("no-cache").run_decode(CFG, init_params(CFG), _x(), prefill=0)


def test_decode_reason_names_the_missing_cache_strategy_and_variant():
    class Columns(Backend):
        decode_caches = ("columns",)

    b = Columns("cols")
    assert b.decode_reason(CFG, "float64", "cpu", "standard", "static") == "cols has no 'static' cache (it has columns)"
    assert "standard strategy only, not 'per_head'" in b.decode_reason(CFG, "float64", "cpu", "per_head", None)
    capped = MHAConfig(d_model=12, n_heads=3, causal=True, softcap=4.0)
    assert b.decode_reason(capped, "float64", "cpu", "standard", None) == (
        "cols's decode path does not implement softcap (it implements: none)"
    )
    assert b.decode_reason(CFG, "float64", "cpu", "standard", None) is None
