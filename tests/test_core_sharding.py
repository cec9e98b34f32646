"""core.sharding: the head-parallel split of the canonical parameters, in NumPy only.

Exact round trips, the rows and columns each rank holds, and the identity that makes
tensor parallelism work: the sum over ranks of each rank's partial output (its heads,
its columns of w_o, no b_o) plus b_o is the layer's output.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_rosetta.core import (
    MHAConfig,
    init_params,
    prepare_inputs,
    reference_mha,
    shard_mask,
    shard_params,
    shard_plan,
    unshard_params,
)


def _same(a, b) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for x, y in zip(a.as_dict().values(), b.as_dict().values(), strict=True)
    )


@settings(max_examples=60, deadline=None)
@given(
    n_kv=st.integers(1, 4),
    group=st.integers(1, 4),
    world=st.integers(1, 16),
    d_k=st.integers(1, 3),
    bias=st.booleans(),
)
def test_round_trip_is_exact_or_the_split_is_refused(n_kv, group, world, d_k, bias):
    cfg = MHAConfig(d_model=5, n_heads=n_kv * group, n_kv_heads=n_kv, d_k=d_k, d_v=d_k + 1, kdim=3, vdim=4, bias=bias)
    params = init_params(cfg, seed=world)
    try:
        plan = shard_plan(cfg, world)
    except ValueError as error:
        # Refused exactly when no head-aligned split exists.
        assert cfg.n_heads % world or (cfg.n_kv_heads % world and world % cfg.n_kv_heads), str(error)
        return
    shards = shard_params(cfg, params, world)
    assert len(shards) == world
    assert _same(unshard_params(cfg, shards), params)
    assert plan.local_heads * world == cfg.n_heads
    assert plan.local_cfg.group_size * plan.local_kv_heads == plan.local_heads


def test_each_rank_holds_rows_of_w_q_k_v_and_columns_of_w_o():
    cfg = MHAConfig(d_model=12, n_heads=4, d_k=3, d_v=2)
    params = init_params(cfg)
    shards = shard_params(cfg, params, 2)
    # Rank 1 holds heads 2 and 3: rows 6..11 of w_q (d_k 3), columns 4..7 of w_o (d_v 2).
    assert np.array_equal(shards[1].w_q, params.w_q[6:12])
    assert np.array_equal(shards[1].b_q, params.b_q[6:12])
    assert np.array_equal(shards[1].w_v, params.w_v[4:8])
    assert np.array_equal(shards[1].w_o, params.w_o[:, 4:8])
    assert np.array_equal(shards[0].b_o, params.b_o) and np.array_equal(shards[1].b_o, params.b_o)
    assert not np.shares_memory(shards[1].w_q, params.w_q)  # copies, safe to send or change


def test_fewer_kv_heads_than_ranks_replicates_them_on_whole_groups():
    cfg = MHAConfig(d_model=16, n_heads=8, n_kv_heads=2, d_k=2)
    params = init_params(cfg)
    plan = shard_plan(cfg, 8)
    assert (plan.local_heads, plan.local_kv_heads, plan.kv_replicas) == (1, 1, 4)
    shards = shard_params(cfg, params, 8)
    # Query heads 0..3 read kv head 0, 4..7 kv head 1 (h // G with G = 4).
    for rank in range(8):
        kv = rank // 4
        assert np.array_equal(shards[rank].w_k, params.w_k[kv * 2 : (kv + 1) * 2])
    broken = [dataclasses.replace(shard) for shard in shards]
    broken[2] = dataclasses.replace(broken[2], w_k=broken[2].w_k + 1.0)
    with pytest.raises(ValueError, match=r"w_k \(kv heads of ranks 0..3\) differs between the ranks holding it"):
        unshard_params(cfg, broken)


def test_partial_outputs_sum_to_the_output():
    """The all-reduce identity, with the oracle on each rank's local configuration."""
    cfg = MHAConfig(d_model=10, n_heads=6, n_kv_heads=3, d_k=2, kdim=7, vdim=5, causal=True)
    params = init_params(cfg, seed=3)
    rng = np.random.default_rng(4)
    query, key, value = (rng.standard_normal((2, n, w)) for n, w in ((5, 10), (6, 7), (6, 5)))
    mask = rng.random((2, 6, 5, 6)) > 0.3  # per head: each rank must get its own heads' rows
    expected = reference_mha(cfg, params, query, key, value, mask)
    inputs = prepare_inputs(cfg, query, key, value, mask)
    for world in (3, 6):  # kv heads split over 3 ranks, replicated on pairs of 6
        plan = shard_plan(cfg, world)
        partials = [
            reference_mha(
                plan.local_cfg,
                dataclasses.replace(shard, b_o=np.zeros_like(shard.b_o)),
                query,
                key,
                value,
                shard_mask(inputs.mask, plan, rank),
            )
            for rank, shard in enumerate(shard_params(cfg, params, world))
        ]
        assert np.max(np.abs(sum(partials) + params.b_o - expected)) < 1e-13


@pytest.mark.parametrize(
    ("world", "error", "message"),
    [
        (3, ValueError, r"world=3 does not divide n_heads=4: .*choose a world size among \[1, 2, 4\]"),
        (0, ValueError, r"world must be a positive int \(the number of ranks\), got 0"),
        (2.0, TypeError, r"world must be an int \(the number of ranks\), got 2.0"),
    ],
)
def test_bad_world_sizes(world, error, message):
    with pytest.raises(error, match=message):
        shard_plan(MHAConfig(d_model=8, n_heads=4), world)


def test_kv_heads_that_fit_no_split_are_refused():
    cfg = MHAConfig(d_model=12, n_heads=6, n_kv_heads=3, d_k=2)
    with pytest.raises(ValueError, match=r"world=2 and n_kv_heads=3: neither divides the other"):
        shard_plan(cfg, 2)


def test_unshard_checks_what_it_is_given():
    cfg = MHAConfig(d_model=8, n_heads=4)
    with pytest.raises(TypeError, match=r"shards must be a non-empty list of MHAParams"):
        unshard_params(cfg, [])
    shards = shard_params(cfg, init_params(cfg), 2)
    with pytest.raises(ValueError, match=r"shards\[1\] does not fit one rank of 2 ranks x 2 query head\(s\)"):
        unshard_params(cfg, [shards[0], shard_params(cfg, init_params(cfg), 4)[0]])
