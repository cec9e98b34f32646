"""The float64 oracle: hand-computed values, invariants and every feature of MHAConfig."""

import numpy as np
import pytest

from conftest import BATCH, D_MODEL, HEADS, KV_TOKENS, Q_TOKENS, requires
from mha_rosetta.core import (
    BASE_STAGE_NAMES,
    MHAConfig,
    MHAParams,
    assert_close,
    init_params,
    reference_mha,
    reference_stages,
    stage_names,
    stage_shapes,
)


def _identity_params(d_model: int) -> MHAParams:
    eye = np.eye(d_model)
    return MHAParams(w_q=eye, w_k=eye, w_v=eye, w_o=eye)


def test_seed_worked_score_is_2_5():
    # Seed: token0 = [1, 0, 2, 0, ...] and head 0's first scorer [0.5, 0, 1.0, 0, ...] give 2.5.
    cfg = MHAConfig(d_model=12, n_heads=3, bias=False)
    params = init_params(cfg, seed=0)
    w_q = params.w_q.copy()
    w_q[0] = 0.0
    w_q[0, 0], w_q[0, 2] = 0.5, 1.0  # row 0 of the canonical (out, in) weight is scorer 0 of head 0
    params = MHAParams(w_q=w_q, w_k=params.w_k, w_v=params.w_v, w_o=params.w_o)
    x = np.zeros((6, 12))
    x[0, 0], x[0, 2] = 1.0, 2.0
    _, stages = reference_mha(cfg, params, x, return_stages=True)
    assert stages["q"][0, 0, 0] == 2.5
    assert stages["q_heads"][0, 0, 0, 0] == 2.5  # head 0, token 0, feature 0 of the head


def test_hand_computed_two_token_single_head():
    # Identity projections, one head: scores = x x^T / sqrt(2).
    cfg = MHAConfig(d_model=2, n_heads=1, bias=False)
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    out, weights = reference_mha(cfg, _identity_params(2), x, return_weights=True)
    e = np.exp(1 / np.sqrt(2))
    p = e / (e + 1)  # weight on the matching token
    assert_close(weights[0], [[p, 1 - p], [1 - p, p]])
    assert_close(out, [[p, 1 - p], [1 - p, p]])


def test_causal_first_row_copies_first_value():
    cfg = MHAConfig(d_model=2, n_heads=1, bias=False, causal=True)
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out, weights = reference_mha(cfg, _identity_params(2), x, return_weights=True)
    assert_close(out[0], x[0])
    assert np.all(np.triu(weights[0], k=1) == 0.0)


def test_softmax_rows_sum_to_one(cfg, params, rng):
    x = rng.standard_normal((BATCH, Q_TOKENS, D_MODEL))
    _, weights = reference_mha(cfg, params, x, return_weights=True)
    assert weights.shape == (BATCH, HEADS, Q_TOKENS, Q_TOKENS)
    assert_close(weights.sum(-1), np.ones((BATCH, HEADS, Q_TOKENS)))
    assert np.all(weights >= 0)


def test_cross_attention_shapes_and_stage_contract(rng):
    cfg = MHAConfig(d_model=15, n_heads=3, d_v=4, kdim=11, vdim=13)
    params = init_params(cfg, seed=3)
    q = rng.standard_normal((BATCH, Q_TOKENS, 15))
    k = rng.standard_normal((BATCH, KV_TOKENS, 11))
    v = rng.standard_normal((BATCH, KV_TOKENS, 13))
    out, stages = reference_mha(cfg, params, q, k, v, return_stages=True)
    assert out.shape == (BATCH, Q_TOKENS, 15)
    assert tuple(stages) == BASE_STAGE_NAMES == stage_names(cfg)  # no variant: the base list
    expected = stage_shapes(cfg, BATCH, Q_TOKENS, KV_TOKENS)
    assert {name: t.shape for name, t in stages.items()} == expected


def test_unbatched_equals_batch_of_one(cfg, params, rng):
    x = rng.standard_normal((Q_TOKENS, D_MODEL))
    assert_close(reference_mha(cfg, params, x), reference_mha(cfg, params, x[None])[0])


def test_gqa_equals_mha_with_repeated_kv_heads(rng):
    gqa = MHAConfig(d_model=12, n_heads=6, n_kv_heads=2, d_k=3)
    mha = MHAConfig(d_model=12, n_heads=6, d_k=3)
    p = init_params(gqa, seed=5)
    # Repeat each kv head's rows group_size times: kv head g serves query heads 3g..3g+2.
    w_k = np.repeat(p.w_k.reshape(2, 3, 12), 3, axis=0).reshape(18, 12)  # (Hkv, Dk, D) -> (H*Dk, D)
    w_v = np.repeat(p.w_v.reshape(2, 3, 12), 3, axis=0).reshape(18, 12)
    b_k = np.repeat(p.b_k.reshape(2, 3), 3, axis=0).reshape(18)
    b_v = np.repeat(p.b_v.reshape(2, 3), 3, axis=0).reshape(18)
    repeated = MHAParams(w_q=p.w_q, w_k=w_k, w_v=w_v, w_o=p.w_o, b_q=p.b_q, b_k=b_k, b_v=b_v, b_o=p.b_o)
    x = rng.standard_normal((BATCH, Q_TOKENS, 12))
    assert_close(reference_mha(gqa, p, x), reference_mha(mha, repeated, x))


def test_mask_blocks_exactly_the_false_positions(cfg, params, rng):
    x = rng.standard_normal((BATCH, Q_TOKENS, D_MODEL))
    mask = np.ones((BATCH, 1, 1, Q_TOKENS), dtype=bool)
    mask[1, ..., 4:] = False  # key padding on batch item 1
    _, weights = reference_mha(cfg, params, x, mask=mask, return_weights=True)
    assert np.all(weights[1, :, :, 4:] == 0.0)
    assert np.all(weights[0, :, :, 4:] > 0.0)
    # Padding tokens do not influence the unpadded tokens' outputs at all.
    y = x.copy()
    y[1, 4:] = 100.0
    assert_close(reference_mha(cfg, params, y, mask=mask)[1, :4], reference_mha(cfg, params, x, mask=mask)[1, :4])


def test_row_with_nothing_to_attend_gives_output_bias(cfg, params, rng):
    x = rng.standard_normal((Q_TOKENS, D_MODEL))
    mask = np.ones((Q_TOKENS, Q_TOKENS), dtype=bool)
    mask[2] = False  # query token 2 may attend to nothing
    out, weights = reference_mha(cfg, params, x, mask=mask, return_weights=True)
    assert np.all(weights[:, 2] == 0.0)
    assert_close(out[2], params.b_o)
    assert np.all(np.isfinite(out))


def test_causal_with_more_keys_than_queries_is_top_left_aligned(rng):
    cfg = MHAConfig(d_model=6, n_heads=2, causal=True)
    p = init_params(cfg, seed=1)
    q = rng.standard_normal((1, 3, 6))
    kv = rng.standard_normal((1, 5, 6))
    _, weights = reference_mha(cfg, p, q, kv, return_weights=True)
    allowed = weights[0, 0] > 0
    assert allowed.tolist() == [[j <= i for j in range(5)] for i in range(3)]


def test_large_logits_stay_finite():
    cfg = MHAConfig(d_model=2, n_heads=1, bias=False, scale=1.0)
    x = np.array([[1e4, 0.0], [-1e4, 0.0]])
    out = reference_mha(cfg, _identity_params(2), x)
    assert np.all(np.isfinite(out))
    assert_close(out, x)  # each token attends only to itself: exp(1e8 - 1e8) vs exp(-2e8)


def test_bias_free_config_has_no_biases(rng):
    cfg = MHAConfig(d_model=15, n_heads=3, bias=False)
    p = init_params(cfg, seed=0)
    assert p.b_q is None and p.b_o is None
    x = rng.standard_normal((Q_TOKENS, 15))
    # Without biases the layer is homogeneous of degree 1 in the values path: scaling v scales out.
    out = reference_mha(cfg, p, x, x, 2.0 * x)
    assert_close(out, 2.0 * reference_mha(cfg, p, x))


def test_init_params_is_deterministic_and_seeded(cfg):
    a, b, c = init_params(cfg, seed=7), init_params(cfg, seed=7), init_params(cfg, seed=8)
    assert all(np.array_equal(a.as_dict()[k], b.as_dict()[k]) for k in a.as_dict())
    assert not np.array_equal(a.w_q, c.w_q)


def test_stages_are_consistent_with_each_other(cfg, params, rng):
    x = rng.standard_normal((BATCH, Q_TOKENS, D_MODEL))
    s = reference_stages(cfg, params, x)
    # head h of q_heads is columns h*Dk:(h+1)*Dk of q
    assert np.array_equal(s["q_heads"][:, 1], s["q"][:, :, 5:10])
    assert np.array_equal(s["merged"][:, :, 5:10], s["context"][:, 1])


@requires("torch")
def test_reference_matches_torch_multihead_attention_loaded_through_converter(rng):
    import torch

    from mha_rosetta.core import to_torch_mha_state_dict

    cfg = MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=13)
    p = init_params(cfg, seed=2)
    module = torch.nn.MultiheadAttention(15, 3, kdim=11, vdim=13, batch_first=True, dtype=torch.float64)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in to_torch_mha_state_dict(cfg, p).items()})
    q = rng.standard_normal((BATCH, Q_TOKENS, 15))
    k = rng.standard_normal((BATCH, KV_TOKENS, 11))
    v = rng.standard_normal((BATCH, KV_TOKENS, 13))
    with torch.no_grad():
        out, weights = module(*(torch.from_numpy(a) for a in (q, k, v)), average_attn_weights=False)
    ref, ref_weights = reference_mha(cfg, p, q, k, v, return_weights=True)
    assert_close(out.numpy(), ref, "float64")
    assert_close(weights.numpy(), ref_weights, "float64")


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4, 15)])
def test_wrong_rank_inputs_are_rejected(cfg, params, shape):
    with pytest.raises(ValueError, match="query must have shape"):
        reference_mha(cfg, params, np.zeros(shape))
