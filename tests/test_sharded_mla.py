"""MLA on the sharded backends (issue 45): torch-tp and jax-sharded run its naive and absorbed forms over heads.

Tensor parallelism as Megatron and vLLM shard DeepSeek's latent attention: each rank its heads' rows of ``w_q``,
``w_k``, ``w_v`` and columns of ``w_o``; the latent's down projections and norms replicated, so every rank computes
(and in decode caches) the whole latent ``[c | k_rope]``. Checked here: the split itself in NumPy (exact round trip,
the partial outputs summing to the layer's), both forms on 2 and 4 ranks against the float64 oracle, decode step
by step against the full causal forward, each rank's latent cache equal to the single-device one, and the refusals.

The backends' worker processes start once per module (module-scoped fixtures); the machine has few cores, so the
ranks stay at 2 and 4 and the cases small.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends import UnsupportedCase
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.core import MHAConfig, init_params, reference_mha, shard_params, shard_plan, unshard_params
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.mla_forms import mla_decode
from mha_rosetta.core.sharding import LATENT_PARAMS
from mha_rosetta.core.tolerances import assert_close
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE

FORMS = MLA_STRATEGIES  # ("naive", "absorbed")
CONFIGS = {
    # DeepSeek V3's layer (q LoRA, YaRN on the rotary and the softmax scale) with 4 heads: splits on 2 and 4 ranks.
    "v3": MHAConfig(**dict(DEEPSEEK_V3_LIKE, n_heads=4)),
    # V2-Lite's: one q_proj, attention_bias on kv_a_proj_with_mqa and o_proj (b_o added once, after the sum).
    "v2_lite": MHAConfig(**DEEPSEEK_V2_LITE_LIKE),
}
V3_THREE_HEADS = MHAConfig(**DEEPSEEK_V3_LIKE)  # the check's own case: 3 heads split over 1 or 3 ranks only
CASES = [("v3", 2), ("v2_lite", 2), ("v3", 4)]
PREFILL, STEP = 3, 2


def _forward_inputs(cfg: MHAConfig):
    """(x (2, 6, D), a per-head mask (2, H, 6, 6) with a row that may attend to nothing)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 6, cfg.d_model))
    mask = rng.random((2, cfg.n_heads, 6, 6)) > 0.3
    mask[1, -1, 4] = False  # the last head (the last rank's) of item 1: query 4 attends to nothing
    return x, mask


def _decode_inputs(cfg: MHAConfig):
    """(x (2, 8, D), a left-padded (2, 8) mask): item 0's first two tokens are pads."""
    x = np.random.default_rng(8).standard_normal((2, 8, cfg.d_model))
    mask = np.ones((2, 8), dtype=bool)
    mask[0, :2] = False
    return x, mask


# -- the split, in NumPy --------------------------------------------------------------------------
@pytest.mark.parametrize(("config", "world"), CASES)
def test_each_rank_holds_its_heads_rows_and_the_whole_latent(config, world):
    cfg = CONFIGS[config]
    params = init_params(cfg, seed=3)
    plan = shard_plan(cfg, world)
    shards = shard_params(cfg, params, world)
    Hl, dn, dv, Dk = plan.local_heads, cfg.qk_nope_head_dim, cfg.d_v, cfg.d_k
    for rank, shard in enumerate(shards):
        first = rank * Hl
        assert np.array_equal(shard.w_q, params.w_q[first * Dk : (first + Hl) * Dk])  # q_b_proj rows, nope + rope
        assert np.array_equal(shard.w_k, params.w_k[first * dn : (first + Hl) * dn])  # kv_b_proj's k_nope rows
        assert np.array_equal(shard.w_v, params.w_v[first * dv : (first + Hl) * dv])  # kv_b_proj's v rows
        assert np.array_equal(shard.w_o, params.w_o[:, first * dv : (first + Hl) * dv])  # o_proj's columns
        for name in LATENT_PARAMS:  # the down projections and latent norms: whole on every rank
            whole, held = getattr(params, name), getattr(shard, name)
            assert (whole is None and held is None) or np.array_equal(whole, held), name
    assert cfg.q_lora_rank is None or shards[-1].w_q_a.shape == (cfg.q_lora_rank, cfg.d_model)
    restored = unshard_params(cfg, shards)
    assert all(
        (a is None and b is None) or np.array_equal(a, b)
        for a, b in zip(restored.as_dict().values(), params.as_dict().values(), strict=True)
    )
    # Tensor parallelism's identity: the ranks' partial outputs (their heads, b_o zeroed) sum to the layer's output.
    x, mask = _forward_inputs(cfg)
    partials = [
        reference_mha(
            plan.local_cfg,
            dataclasses.replace(shard, b_o=None if shard.b_o is None else 0 * shard.b_o),
            x,
            mask=mask[:, rank * Hl : (rank + 1) * Hl],
        )
        for rank, shard in enumerate(shards)
    ]
    total = sum(partials) + (0 if params.b_o is None else params.b_o)
    assert_close(total, reference_mha(cfg, params, x, mask=mask), "float64", what="sum of the partial outputs")


def test_the_sharding_explainer_shows_the_latent_replicated_and_checks_the_identity():
    from mha_rosetta.explain.sharding import explain_sharding

    cfg = CONFIGS["v3"]
    result = explain_sharding(cfg, 2)
    assert result.identity_error < 1e-12  # the partial outputs, summed, + b_o: the oracle's output
    cuts = {cut.weight: cut for cut in result.cuts}
    assert cuts["w_k"].shard == (2 * cfg.qk_nope_head_dim, cfg.kv_lora_rank)  # two heads' k_nope rows of kv_b_proj
    assert cuts["w_k"].rank_slice.startswith(f"rows r*{2 * cfg.qk_nope_head_dim} ")
    replicated = {name for name, cut in cuts.items() if cut.cut.startswith("none: replicated")}
    assert replicated == {"w_kv_a", "kv_a_norm", "w_q_a", "q_a_norm"}  # no attention_bias in V3: no b_kv_a, b_q_a
    assert all(cuts[name].shard == cuts[name].stored for name in replicated)


# -- refusals (no framework needed) -----------------------------------------------------------------
def _backends():
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    return TorchTPBackend(world=2), JaxShardedBackend(world=2)


def test_mla_runs_in_its_forms_only_and_a_layout_that_does_not_split_is_refused():
    v3, plain = CONFIGS["v3"], MHAConfig(d_model=12, n_heads=4)
    for backend in _backends():
        assert {"mla", "mla_q_lora"} <= backend.variants
        for strategy in backend.strategies:
            reason = backend.unsupported_reason(v3, "float64", "cpu", strategy)
            assert (reason is None) == (strategy in FORMS), (backend.name, strategy, reason)
            if strategy not in FORMS:
                assert "'naive' and 'absorbed' strategies only" in reason, reason
        for form in FORMS:
            assert "needs MHAConfig.kv_lora_rank" in backend.unsupported_reason(plain, "float64", "cpu", form)
            three = backend.unsupported_reason(V3_THREE_HEADS, "float64", "cpu", form)
            assert f"{backend.name}: world=2 does not divide n_heads=3" in three, three
            assert "world=2 does not divide" in backend.decode_reason(V3_THREE_HEADS, "float64", "cpu", form, None)
            sinks = MHAConfig(**dict(DEEPSEEK_V3_LIKE, n_heads=4, sinks=True))
            assert "sinks" in backend.unsupported_reason(sinks, "float64", "cpu", form)
            assert backend.decode_reason(v3, "float64", "cpu", form, None) is None
            with pytest.raises(UnsupportedCase, match=r"no timed decode step yet"):
                backend.prepare_decode(v3, init_params(v3), context=4, strategy=form)
        assert "naive' and 'absorbed' strategies only" in backend.decode_reason(v3, "float64", "cpu", "standard", None)
    torch_tp, _ = _backends()
    assert "latent cache" in torch_tp.decode_reason(v3, "float64", "cpu", "naive", "static")


# -- torch-tp ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_tp():
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    made = {}
    yield lambda world: made.setdefault(world, TorchTPBackend(world=world))
    for backend in made.values():
        backend.close()


@pytest.fixture(scope="module")
def jax_sharded():
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    backend = JaxShardedBackend(world=2)  # one worker, 8 simulated devices: each test sets the mesh's size

    def with_world(world):
        backend.world = world
        return backend

    yield with_world
    backend.close()


def _sharded(name, torch_tp, jax_sharded):
    return {"torch-tp": torch_tp, "jax-sharded": jax_sharded}[name]


SHARDED = [
    pytest.param("torch-tp", id="torch-tp", marks=requires("torch")),
    pytest.param("jax-sharded", id="jax-sharded", marks=requires("jax")),
]


@pytest.mark.parametrize("name", SHARDED)
@pytest.mark.parametrize(("config", "world"), CASES)
@pytest.mark.parametrize("form", FORMS)
def test_both_forms_on_2_and_4_ranks_match_the_oracle(name, config, world, form, torch_tp, jax_sharded):
    cfg = CONFIGS[config]
    backend = _sharded(name, torch_tp, jax_sharded)(world)
    params = init_params(cfg, seed=3)
    x, mask = _forward_inputs(cfg)
    prepared, _ = backend.prepare(cfg, params, x, mask=mask, dtype="float64", strategy=form)
    output = prepared.to_numpy(prepared.forward())
    assert_close(output, reference_mha(cfg, params, x, mask=mask), "float64", what=f"{name} {form} on {world}")
    assert prepared.info["all_reduces"] == 1  # the partial outputs' sum; the latent is computed on every rank
    assert (
        prepared.info["plan"]
        == f"{world} ranks x {cfg.n_heads // world} query head(s), {cfg.n_heads // world} kv head(s) each"
    )
    stages = backend.canonical_stages(prepared)
    assert set(stages) == {"output"}  # the forms record no inner stage (as the single-device adapters)
    assert_close(stages["output"], output, "float64", what="the output stage")


@pytest.mark.parametrize("name", SHARDED)
@pytest.mark.parametrize(("config", "world"), CASES)
@pytest.mark.parametrize("form", FORMS)
def test_decode_equals_the_full_forward_and_every_rank_caches_the_whole_latent(
    name, config, world, form, torch_tp, jax_sharded
):
    cfg = CONFIGS[config]
    backend = _sharded(name, torch_tp, jax_sharded)(world)
    params = init_params(cfg, seed=3)
    x, mask = _decode_inputs(cfg)
    prepared, inputs = backend.prepare_decode_run(
        cfg, params, x, prefill=PREFILL, step=STEP, mask=mask, dtype="float64", strategy=form
    )
    token = prepared.run()
    output = prepared.to_numpy(token)
    expected = reference_decode(cfg, params, x, prefill=PREFILL, step=STEP, mask=mask)
    assert_close(output, expected, "float64", what=f"{name} {form} decode on {world}")
    # Each rank's cache: the whole latent, equal to the single-device latent cache of the same run.
    _, single = mla_decode(cfg, params, x, prefill=PREFILL, step=STEP, form=form, mask=mask, return_cache=True)
    whole = np.concatenate([single.kv_latent, single.k_rope], axis=-1)  # (B, T, R + dr)
    caches = backend.rank_latent_caches(token)
    assert len(caches) == world
    for rank, cache in enumerate(caches):
        assert_close(cache, whole, "float64", what=f"rank {rank}'s latent cache")
    record = prepared.info["cache"]
    one = 2 * 8 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 8  # B * T * (R + dr) float64 numbers, on each rank
    per_rank = record.get("bytes_per_rank", record.get("bytes_per_device"))
    assert (record["kind"], per_rank, record["bytes"]) == ("latent", one, one * world)
    # The chunks' outputs one by one (the forms expose no inner stage).
    chunks = backend.decode_stages(prepared, cfg)
    assert [set(chunk) for chunk in chunks] == [{"output"}] * len(inputs.chunks())
    for (start, stop), chunk in zip(inputs.chunks(), chunks, strict=True):
        assert_close(chunk["output"], expected[:, start:stop], "float64", what=f"chunk {start}:{stop}")


@requires("jax")
def test_a_run_without_a_latent_has_no_latent_cache_to_read(jax_sharded):
    from mha_rosetta.backends.sharded.workers import WorkerError

    backend = jax_sharded(2)
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True)  # plain attention: each device its kv heads' cache
    x = np.random.default_rng(9).standard_normal((1, 4, 8))
    prepared, _ = backend.prepare_decode_run(cfg, init_params(cfg), x, prefill=2, step=1)
    token = prepared.run()
    with pytest.raises(WorkerError, match=r"keeps no latent cache \(only MLA's naive and absorbed runs do\)"):
        backend.rank_latent_caches(token)
