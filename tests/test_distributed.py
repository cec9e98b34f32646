"""The sharded backends on real distributed engines: jax-sharded (2, 4 and 8 simulated CPU
devices) and torch-tp (two gloo processes), against the single-device float64 oracle.

Also: exactly one all-reduce per forward (read from the compiled XLA program, counted by
torch's CommDebugMode), GQA with fewer kv heads than ranks, clear errors for world sizes
that do not divide the heads or exceed the devices, and a rank that dies: reported as an
error naming it (never a hang), the check going on with the rest.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends import STANDARD, UnsupportedCase, get_backend
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.checks import Status, get_cases, run_check
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha, reference_stages

# 8 heads over 2 kv heads, cross-attention with a per-head mask and a row with nothing to attend to.
CFG = MHAConfig(d_model=16, n_heads=8, n_kv_heads=2, d_k=3, d_v=2, kdim=10, vdim=14, causal=True)


def _inputs(cfg: MHAConfig = CFG, seed: int = 0):
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((2, 7, cfg.d_model))
    key = rng.standard_normal((2, 5, cfg.kdim))
    value = rng.standard_normal((2, 5, cfg.vdim))
    mask = rng.random((2, cfg.n_heads, 7, 5)) > 0.3
    mask[1, -1, 2] = False  # query 2 of the last head in item 1 may attend to nothing
    return query, key, value, mask


def _run(backend, strategy, cfg=CFG, dtype="float64"):
    params = init_params(cfg, seed=5)
    prepared, _ = backend.prepare(cfg, params, *_inputs(cfg), dtype=dtype, strategy=strategy)
    output = prepared.to_numpy(prepared.forward())
    return output, prepared, reference_mha(cfg, params, *_inputs(cfg))


# -- jax-sharded ----------------------------------------------------------------------------
@requires("jax")
@pytest.mark.parametrize("world", (2, 4, 8))
@pytest.mark.parametrize("strategy", (STANDARD, "named_sharding"))
def test_jax_sharded_on_2_4_8_devices_matches_the_oracle(world, strategy):
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    output, prepared, expected = _run(JaxShardedBackend(world=world), strategy)
    assert np.max(np.abs(output - expected)) < 1e-13
    assert prepared.info["devices"] == world
    # kv heads: split over 2 ranks, replicated on pairs of 4 and on quadruples of 8.
    assert prepared.info["plan"].startswith(f"{world} ranks x {8 // world} query head(s)")
    if strategy == STANDARD:
        assert prepared.info["all_reduces"] == 1  # the one psum, read from the compiled program
    else:
        assert prepared.info["all_reduces"] >= 1  # XLA's choice, reported as it is


@requires("jax")
def test_jax_sharded_stages_are_the_heads_gathered_in_order():
    backend = get_backend("jax-sharded")
    params = init_params(CFG, seed=5)
    _, stages = backend.run(CFG, params, *_inputs(), return_stages=True)
    expected = reference_stages(CFG, params, *_inputs())
    assert set(stages) == set(expected)  # every stage: each device's heads gathered in rank order
    for name in stages:
        assert_close(stages[name], expected[name], "float64", what=name)


@requires("jax")
def test_jax_sharded_half_precision():
    output, _, expected = _run(get_backend("jax-sharded"), STANDARD, dtype="bfloat16")
    assert_close(output, expected, "bfloat16")


@requires("jax")
def test_jax_sharded_bad_world_sizes():
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    with pytest.raises(ValueError, match=r"world=16 needs more devices than the 8 available .*max_devices=16"):
        JaxShardedBackend(world=16)
    with pytest.raises(UnsupportedCase, match=r"jax-sharded: world=3 does not divide n_heads=8"):
        _run(JaxShardedBackend(world=3), STANDARD)
    # Without a world the backend picks the largest one that splits the heads: 3 heads -> 3 devices.
    _, prepared, _ = _run(get_backend("jax-sharded"), STANDARD, cfg=MHAConfig(d_model=9, n_heads=3, kdim=10, vdim=14))
    assert prepared.info["devices"] == 3


def test_jax_sharded_worker_keeps_the_callers_xla_flags_and_adds_its_device_count(monkeypatch):
    from mha_rosetta.backends.sharded.jax import JaxShardedBackend

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")  # the check's compile settings
    group = JaxShardedBackend()._new_group()  # not started: only its environment is read
    assert group.env["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=8"
    monkeypatch.delenv("XLA_FLAGS")
    assert JaxShardedBackend()._new_group().env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


# -- torch-tp -------------------------------------------------------------------------------
@requires("torch")
@pytest.mark.parametrize("strategy", (STANDARD, "manual"))
def test_torch_tp_on_two_processes_matches_the_oracle_with_one_all_reduce(strategy):
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=3, d_v=2, kdim=10, vdim=14, causal=True)
    output, prepared, expected = _run(get_backend("torch-tp"), strategy, cfg=cfg)
    assert np.max(np.abs(output - expected)) < 1e-13
    assert prepared.info["world"] == 2
    assert prepared.info["all_reduces"] == 1  # CommDebugMode over one forward pass
    assert sum(prepared.info["collectives"].values()) == 1  # and nothing else


@requires("torch")
@pytest.mark.parametrize("strategy", (STANDARD, "manual"))
def test_torch_tp_splits_the_per_head_variants_by_head_with_no_more_collectives(strategy):
    """6 heads over 2 ranks: rank 1's ALiBi slopes are the interleaved second series (heads 4 and 5 of BLOOM's
    6-head slopes, not the 3-head series), its sinks and T5 columns are heads 3..5; the split costs no collective."""
    cfg = MHAConfig(
        d_model=18, n_heads=6, n_kv_heads=2, d_k=4, causal=True, window=4, alibi=True, sinks=True, rel_buckets=6
    )
    output, prepared, expected = _run(get_backend("torch-tp"), strategy, cfg=cfg)
    assert np.max(np.abs(output - expected)) < 1e-13
    assert prepared.info["all_reduces"] == 1 and sum(prepared.info["collectives"].values()) == 1


@requires("torch")
@pytest.mark.parametrize(
    ("strategy", "n_kv_heads"),
    [(STANDARD, 2), ("manual", 2), ("manual", 1)],  # one kv head: replicated on both ranks, its k sum halved
)
def test_torch_tp_projection_qk_norm_all_reduces_the_sum_of_squares(strategy, n_kv_heads):
    """QK-norm over the whole projection needs every rank's features: one all-reduce each for q and k, 3 in all."""
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=n_kv_heads, d_k=4, qk_norm="projection", rope="half")
    output, prepared, expected = _run(get_backend("torch-tp"), strategy, cfg=cfg)
    assert np.max(np.abs(output - expected)) < 1e-13
    assert prepared.info["all_reduces"] == 3  # the output's, q's sum of squares, k's sum of squares
    head_cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=n_kv_heads, d_k=4, qk_norm="head", rope="half")
    output, prepared, expected = _run(get_backend("torch-tp"), strategy, cfg=head_cfg)
    assert np.max(np.abs(output - expected)) < 1e-13
    assert prepared.info["all_reduces"] == 1  # over each head: the weight is replicated, nothing to add up


@requires("torch")
def test_torch_tp_fewer_kv_heads_than_ranks():
    backend = get_backend("torch-tp")
    cfg = MHAConfig(d_model=12, n_heads=4, n_kv_heads=1, kdim=10, vdim=14)  # MQA: one kv head, two ranks
    with pytest.raises(UnsupportedCase, match=r"ColwiseParallel would cut a kv head in half; the 'manual' strategy"):
        _run(backend, STANDARD, cfg=cfg)
    output, prepared, expected = _run(backend, "manual", cfg=cfg)  # replicated on both ranks
    assert np.max(np.abs(output - expected)) < 1e-13
    assert "each kv head replicated on 2 ranks" in prepared.info["plan"]


@requires("torch")
def test_torch_tp_world_that_does_not_divide_the_heads():
    cfg = MHAConfig(d_model=15, n_heads=3, kdim=10, vdim=14)
    with pytest.raises(UnsupportedCase, match=r"torch-tp: world=2 does not divide n_heads=3"):
        _run(get_backend("torch-tp"), "manual", cfg=cfg)


@requires("torch")
@pytest.mark.parametrize("reaped", [False, True], ids=["dying", "already dead"])
def test_a_dead_rank_is_an_error_and_the_next_prepare_starts_a_new_group(reaped):
    from mha_rosetta.backends.sharded.torch import TorchTPBackend
    from mha_rosetta.backends.sharded.workers import WorkerError

    backend = TorchTPBackend()
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=3, d_v=2, kdim=10, vdim=14)
    try:
        _, prepared, _ = _run(backend, "manual", cfg=cfg)
        backend.group().processes[1].kill()  # rank 1 dies between two forward passes
        if reaped:  # gone before the request: it was restarted silently, or its closed pipe failed the send (CI)
            backend.group().processes[1].wait(10)
        with pytest.raises(WorkerError, match=r"torch-tp: rank 1 of 2 died \(exit code -9\) while running the forward"):
            prepared.forward()
        output, _, expected = _run(backend, "manual", cfg=cfg)  # a fresh group
        assert np.max(np.abs(output - expected)) < 1e-13
    finally:
        backend.close()


@requires("torch")
def test_torch_tp_rendezvous_folder_is_fresh_for_each_start_and_removed_on_close():
    import os

    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    backend = TorchTPBackend()
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=3, d_v=2, kdim=10, vdim=14)
    try:
        _run(backend, "manual", cfg=cfg)
        first = backend.group().folder
        assert os.path.basename(first).startswith("mha-rosetta-tp-") and os.path.isdir(first)
        backend.group().processes[1].kill()  # the group is gone: the next prepare starts another
        backend.group().processes[1].wait(10)
        _run(backend, "manual", cfg=cfg)
        second = backend.group().folder
        assert second != first and os.path.isdir(second)
        assert not os.path.exists(first)  # the dead group's folder went with it
    finally:
        backend.close()
    assert not os.path.exists(second) and backend._group.folder is None


@requires("torch")
def test_the_check_reports_a_dead_rank_and_goes_on():
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    class DiesOnce(TorchTPBackend):
        """Kills rank 0 right after the first prepare of the check."""

        killed = False

        def _prepare(self, *args, **kwargs):
            prepared = super()._prepare(*args, **kwargs)
            if not self.killed:
                DiesOnce.killed = True
                self.group().processes[0].kill()
            return prepared

    backend = DiesOnce(name="torch-tp")
    try:
        result = run_check(
            backends=[backend, "numpy"], cases=get_cases(["heads_split"]), strategies=["manual", "standard"]
        )
    finally:
        backend.close()
    tp_runs = [run for run in result.runs if run.impl.backend == "torch-tp"]
    assert tp_runs[0].status is Status.ERROR and "rank 0 of 2 died" in tp_runs[0].reason
    assert [run.status for run in tp_runs[1:]] == [Status.AGREE] * (len(tp_runs) - 1)  # the rest went on
    assert result.exit_status == 2


@pytest.mark.parametrize("name", ("jax-sharded", "torch-tp"))
def test_sharded_backends_apply_rotary_per_head(name):
    """Rotary turns pairs of features inside each head, so the head split carries it unchanged."""
    missing = {"jax-sharded": "jax", "torch-tp": "torch"}[name]
    if importlib.util.find_spec(missing) is None:
        pytest.skip(f"{missing} is not installed")
    backend = get_backend(name)
    cfg = MHAConfig(d_model=12, n_heads=4, n_kv_heads=2, d_k=6, rope="interleaved", rope_dims=4, causal=True)
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 7, 12))
    positions = np.array([[5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6]])
    expected = reference_mha(cfg, params, x, positions=positions)
    for strategy in (s for s in backend.strategies if s not in MLA_STRATEGIES):  # MLA's: tests/test_sharded_mla.py
        output = backend.run(cfg, params, x, strategy=strategy, positions=positions)
        assert np.max(np.abs(output - expected)) < 1e-13, strategy
