"""The JAX adapter (vmap over heads and batch, jit) against the float64 oracle.

Every comparison is against `core.reference_mha` at the dtype's tolerance. JIT compiles
dominate the run time, so the sizes are tiny and each case compiles once or twice.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from adapter_cases import random_inputs

from conftest import BATCH, D_MODEL, HEADS, KV_TOKENS, Q_TOKENS, gpu_skipif, requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha, reference_stages

pytestmark = requires("jax")

CASES = {
    "self": MHAConfig(d_model=D_MODEL, n_heads=HEADS),
    # cross-attention: key/value inputs of other widths, d_v != d_k, d_model != H*d_k
    "cross": MHAConfig(d_model=16, n_heads=HEADS, d_k=6, d_v=4, kdim=11, vdim=9),
    "gqa": MHAConfig(d_model=18, n_heads=6, n_kv_heads=2),  # 6 query heads, 2 kv heads, d_k 3
    "causal": MHAConfig(d_model=D_MODEL, n_heads=HEADS, causal=True),
    "no_bias": MHAConfig(d_model=D_MODEL, n_heads=HEADS, bias=False),
    "custom_scale": MHAConfig(d_model=D_MODEL, n_heads=HEADS, scale=0.37),
}


# (query, key, value, mask) with distinct sizes; with padding=True batch item 1 has its last two keys padded.
make_inputs = partial(random_inputs, padding=False, padded_item=1)


@pytest.fixture(scope="module")
def backend():
    from mha_rosetta.backends import get_backend

    return get_backend("jax")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["cross", "gqa"])
def test_half_precision_matches_reference(backend, case, dtype):
    cfg = CASES[case]
    params = init_params(cfg, seed=2)
    query, key, value, mask = make_inputs(cfg, cross=case == "cross", padding=True)
    prepared, _ = backend.prepare(cfg, params, query, key, value, mask, dtype=dtype)
    result = prepared.forward()
    assert str(result.dtype) == dtype  # computed in the dtype asked for, not upcast
    assert_close(prepared.to_numpy(result), reference_mha(cfg, params, query, key, value, mask), dtype)


def test_unbatched_call_returns_unbatched_output(backend):
    cfg = CASES["self"]
    params = init_params(cfg, seed=3)
    query = np.random.default_rng(3).standard_normal((Q_TOKENS, D_MODEL))  # (Nq, D): no batch axis
    mask = np.tril(np.ones((HEADS, Q_TOKENS, Q_TOKENS), dtype=bool))  # (H, Nq, Nk), per head
    mask[1] = True  # head 1 sees everything, heads 0 and 2 are causal
    out = backend.run(cfg, params, query, mask=mask)
    assert out.shape == (Q_TOKENS, D_MODEL)
    assert_close(out, reference_mha(cfg, params, query, mask=mask), "float64")


def test_every_stage_equals_the_reference_stage(backend):
    """GQA, a per-head mask and an empty row at once: every stage, in canonical layout."""
    cfg = CASES["gqa"]
    params = init_params(cfg, seed=4)
    query = make_inputs(cfg, cross=False)[0]
    mask = np.ones((BATCH, cfg.n_heads, Q_TOKENS, Q_TOKENS), dtype=bool)  # (B, H, Nq, Nk): per head
    mask[0, 4, :, 3:] = False  # head 4 of item 0 sees keys 0..2 only
    mask[1, :, 5, :] = False  # query 5 of item 1 may attend to nothing
    out, stages = backend.run(cfg, params, query, mask=mask, return_stages=True)
    expected = reference_stages(cfg, params, query, mask=mask)
    assert list(stages) == list(expected)
    for name, value in expected.items():
        assert_close(stages[name], value, "float64", what=f"stage {name}")
    assert_close(out, expected["output"], "float64")


def test_empty_row_follows_the_spec(backend):
    """A query row with no allowed key: zero weights and output b_o, no NaN anywhere."""
    cfg = CASES["self"]
    params = init_params(cfg, seed=5)
    query, _, _, _ = make_inputs(cfg, cross=False)
    mask = np.ones((BATCH, 1, Q_TOKENS, Q_TOKENS), dtype=bool)
    mask[0, :, 3, :] = False
    out, weights = backend.run(cfg, params, query, mask=mask, return_weights=True, dtype="float32")
    assert not np.isnan(out).any() and not np.isnan(weights).any()
    assert np.array_equal(weights[0, :, 3], np.zeros((HEADS, Q_TOKENS)))
    np.testing.assert_allclose(out[0, 3], params.b_o, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(weights[1].sum(axis=-1), 1.0, rtol=1e-6)


def test_float32_stays_float32_after_float64_switched_x64_on(backend):
    import jax

    cfg = CASES["self"]
    params = init_params(cfg, seed=6)
    query, _, _, _ = make_inputs(cfg, cross=False)
    backend.run(cfg, params, query, dtype="float64")
    assert jax.config.jax_enable_x64  # float64 needs it, and it is process-global
    prepared, _ = backend.prepare(cfg, params, query, dtype="float32")
    assert prepared.forward().dtype == np.float32
    assert {str(stage.value.dtype) for stage in prepared.native_stages().values()} == {"float32"}


def test_compile_is_separate_and_forward_reuses_it(backend):
    cfg = CASES["causal"]
    params = init_params(cfg, seed=7)
    query, _, _, _ = make_inputs(cfg, cross=False)
    prepared, _ = backend.prepare(cfg, params, query, dtype="float32")
    assert prepared.compile is not None
    prepared.compile()
    first = prepared.to_numpy(prepared.forward())
    second = prepared.to_numpy(prepared.forward())
    assert np.array_equal(first, second)
    assert prepared.info["matmul_precision"] == "highest"
    assert_close(first, reference_mha(cfg, params, query), "float32")


def test_native_stages_keep_tokens_before_heads(backend):
    """The vmap layout: q_heads and context are (B, N, H, d), scores (B, H, Nq, Nk)."""
    cfg = CASES["cross"]
    params = init_params(cfg, seed=8)
    query, key, value, _ = make_inputs(cfg, cross=True)
    prepared, _ = backend.prepare(cfg, params, query, key, value)
    stages = prepared.native_stages()
    assert stages["q_heads"].axes == ("B", "Nq", "H", "Dk")
    assert stages["q_heads"].value.shape == (BATCH, Q_TOKENS, HEADS, 6)
    assert stages["context"].value.shape == (BATCH, Q_TOKENS, HEADS, 4)
    assert stages["scores"].value.shape == (BATCH, HEADS, Q_TOKENS, KV_TOKENS)
    assert "XLA-managed layout" in stages["merged"].note
    assert (stages["merged"].relation, stages["merged"].parent) == ("copy", "context")


def test_rejects_an_unknown_matmul_precision():
    from mha_rosetta.backends.jax.adapter import JaxBackend

    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        JaxBackend(matmul_precision="fastest")


def test_gpu_is_reported_only_when_jax_sees_one(backend):
    import jax

    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    assert backend.devices() == (("cpu", "gpu") if has_gpu else ("cpu",))
    if not has_gpu:
        reason = backend.unsupported_reason(CASES["self"], "float32", "gpu", "standard")
        assert reason is not None and "gpu" in reason


def _jax_has_gpu() -> bool:
    try:
        import jax

        return bool(jax.devices("gpu"))
    except (ImportError, RuntimeError):
        return False


@pytest.mark.gpu
@gpu_skipif(not _jax_has_gpu(), "JAX sees no GPU on this machine")
def test_tf32_changes_float32_results_on_gpu():
    """float32 at "highest" meets the float32 tolerance; at "default" (TF32 on) it drifts further."""
    from mha_rosetta.backends.jax.adapter import JaxBackend

    cfg = MHAConfig(d_model=256, n_heads=4)
    params = init_params(cfg, seed=9)
    query = np.random.default_rng(9).standard_normal((2, 64, 256))
    expected = reference_mha(cfg, params, query)
    exact = JaxBackend(matmul_precision="highest").run(cfg, params, query, dtype="float32", device="gpu")
    tf32 = JaxBackend(matmul_precision="default").run(cfg, params, query, dtype="float32", device="gpu")
    exact_error = np.abs(exact - expected).max()
    tf32_error = np.abs(tf32 - expected).max()
    assert_close(exact, expected, "float32")
    assert tf32_error > 10 * exact_error, (exact_error, tf32_error)
