"""MLX decoding through mlx-lm's caches: KVCache grown in steps, RotatingKVCache for a window.

Each run equals the full causal forward (`core.decode.reference_decode`); the cache grows as mlx-lm's
does (proved against ``mlx_lm.models.cache.KVCache`` itself where mlx-lm is installed), a window keeps a
ring of ``W - 1 + step`` slots, and the bench step runs on a cache already holding its context.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")

from mha_rosetta.backends import get_backend  # noqa: E402
from mha_rosetta.backends.frameworks import to_numpy  # noqa: E402
from mha_rosetta.backends.mlx.decode import MLX_LM_STEP, MlxKVCache  # noqa: E402
from mha_rosetta.core import MHAConfig, compare, init_params  # noqa: E402
from mha_rosetta.core.decode import reference_decode, ring_capacity  # noqa: E402

RNG = np.random.default_rng(11)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"n_kv_heads": 1, "rope": "interleaved"},
        {"window": 3, "rope": "half", "sinks": True},
        {"alibi": True, "softcap": 20.0, "qk_norm": "projection"},
        {"rel_buckets": 8, "rel_bidirectional": False, "bias": "qkv"},
    ],
    ids=lambda f: ",".join(f) or "plain",
)
@pytest.mark.parametrize(("prefill", "step"), [(1, 1), (4, 3), (9, 1)])
def test_decode_equals_the_full_causal_forward(fields, prefill, step):
    cfg = MHAConfig(d_model=18, n_heads=3, causal=True, **fields)
    params = init_params(cfg, seed=1)
    x = RNG.standard_normal((2, 9, 18))
    mask = np.ones((2, 9), dtype=bool)
    mask[1, :2] = False  # left padding: its pads at position -1 see only pads (zero rows)
    out = get_backend("mlx").run_decode(cfg, params, x, prefill=prefill, step=step, mask=mask, dtype="float32")
    expected = reference_decode(cfg, params, x, prefill=prefill, step=step, mask=mask)
    assert compare(out, expected, "float32").ok, compare(out, expected, "float32").summary()


def test_the_cache_grows_in_steps_as_mlx_lm_does():
    keys = [mx.array(RNG.standard_normal((1, 2, n, 4)).astype(np.float32)) for n in (3, 1, 1, 4, 2)]
    ours = MlxKVCache(step=4)
    slots = []
    for k in keys:
        fetched = ours.update_and_fetch(k, k, np.zeros((1, k.shape[2]), np.int64), np.ones((1, k.shape[2]), bool))
        slots.append(ours.slots)
    # ceil(s / 4) * 4 more slots whenever s new tokens do not fit, after a cut to the offset (5, then 9) if not a multiple
    assert slots == [4, 4, 8, 9, 13]
    assert ours.reallocations == 3
    np.testing.assert_array_equal(to_numpy(fetched[0]), np.concatenate([to_numpy(k) for k in keys], axis=2))
    assert MLX_LM_STEP == 256
    cache_module = pytest.importorskip("mlx_lm.models.cache", reason="mlx-lm is not installed")
    theirs = cache_module.KVCache()
    theirs.step = 4
    for k in keys:
        their_keys, _ = theirs.update_and_fetch(k, k)
    assert theirs.keys.shape[2] == ours.slots  # the same allocation
    np.testing.assert_array_equal(to_numpy(their_keys), to_numpy(fetched[0]))


def test_a_window_keeps_a_ring_of_w_minus_1_plus_step_slots():
    cfg = MHAConfig(d_model=15, n_heads=3, causal=True, window=4)
    params = init_params(cfg, seed=2)
    x = RNG.standard_normal((1, 12, 15))
    prepared, _ = get_backend("mlx").prepare_decode_run(cfg, params, x, prefill=2, step=2, dtype="float32")
    assert prepared.info["cache"]["slots"] == ring_capacity(cfg, 2) == 5  # O(W), not O(N)
    assert prepared.info["cache"]["kind"] == "RotatingKVCache"
    assert compare(prepared.output(), reference_decode(cfg, params, x, prefill=2, step=2), "float32").ok


def test_a_long_run_reallocates_in_steps_of_256():
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True)
    x = RNG.standard_normal((1, 300, 8))
    prepared, _ = get_backend("mlx").prepare_decode_run(cfg, init_params(cfg, seed=0), x, prefill=250, step=25)
    # 256 slots for the prefill of 250; the step that does not fit cuts the cache to 250 and adds 256: 506
    assert prepared.info["cache"]["slots"] == 506 and prepared.info["reallocations"] == 1


def test_decode_stages_are_the_steps_tokens():
    cfg = MHAConfig(d_model=15, n_heads=3, causal=True, rope="half", d_k=6, d_v=5)
    params = init_params(cfg, seed=3)
    x = RNG.standard_normal((2, 6, 15))
    backend = get_backend("mlx")
    prepared, _ = backend.prepare_decode_run(cfg, params, x, prefill=3, step=2, dtype="float64")
    chunks = backend.decode_stages(prepared, cfg)
    assert [chunk["k_rotated"].shape for chunk in chunks] == [(2, 3, 3, 6), (2, 3, 2, 6), (2, 3, 1, 6)]
    assert prepared.info["tolerance_dtype"] == "float32"  # float64's declared level holds the decode check too


def test_the_bench_step_runs_on_a_full_cache():
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, window=8)
    prepared = get_backend("mlx").prepare_decode(cfg, init_params(cfg, seed=0), context=20, batch=2, step=1)
    out = prepared.output()
    assert out.shape == (2, 1, 16) and np.isfinite(out).all()
    assert prepared.info["cache"]["slots"] == ring_capacity(cfg, 1)
