"""MLA in MLX (issue 45, `backends/mlx/mla.py`): what the shared tests (tests/test_mla_adapters.py) do not say.

The absorbed form attends through ``mx.fast.scaled_dot_product_attention`` over the latent, as mlx-lm calls it (the
rotary scores as its additive mask), and the naive form through the score steps on MLX's ops object: so the two
forms agreeing is the fused kernel checked against the ops path. A softcap sends the absorbed form to the ops path;
a query row with no allowed key gets the spec's zeros from the kernel path, forward and backward. Half precision
is held to its tolerance. Decode caches the latent in mlx-lm's ``KVCache`` (keys the latent, values ``k_pe``), and
the timed step gives NumPy's step on the same drawn numbers.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")

from mha_rosetta.backends import UnsupportedCase, get_backend  # noqa: E402
from mha_rosetta.backends._mla import MLA_STRATEGIES  # noqa: E402
from mha_rosetta.backends.mlx import mla  # noqa: E402
from mha_rosetta.backends.mlx.decode import MLX_LM_STEP  # noqa: E402
from mha_rosetta.core import MHAConfig, init_params, reference_mha, reference_mha_vjp  # noqa: E402
from mha_rosetta.core.tolerances import assert_close  # noqa: E402
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE  # noqa: E402

V3 = MHAConfig(**DEEPSEEK_V3_LIKE)  # q LoRA, YaRN, interleaved pairs, d_v 5 != d_k 10
V2_LITE = MHAConfig(**DEEPSEEK_V2_LITE_LIKE)  # one q_proj, biases on kv_a and o_proj
SOFTCAP = MHAConfig(**dict(DEEPSEEK_V3_LIKE, softcap=4.0))
MLX = get_backend("mlx")


def _x(cfg: MHAConfig, shape, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((*shape, cfg.d_model))


def _step(name: str, cfg: MHAConfig, params, **job):
    """``name``'s timed decode step, float64 (`Backend.prepare_decode`)."""
    return get_backend(name).prepare_decode(cfg, params, dtype="float64", **job)


class KernelCalls:
    """Counts the calls of ``mx.fast.scaled_dot_product_attention`` (the module attribute `mla` reads)."""

    def __init__(self, monkeypatch) -> None:
        self.calls, fused = [], mx.fast.scaled_dot_product_attention

        def counted(q, k, v, **options):
            self.calls.append((q.shape, k.shape, v.shape))
            return fused(q, k, v, **options)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)


def test_absorbed_runs_the_fused_kernel_over_the_latent_and_naive_the_score_steps(monkeypatch):
    kernel = KernelCalls(monkeypatch)
    params, x = init_params(V3, seed=3), _x(V3, (2, 7))
    naive = MLX.prepare(V3, params, x, strategy="naive", dtype="float32")[0]
    naive.output()
    assert kernel.calls == [] and naive.info["attention"].startswith("the score steps on MlxOps")
    absorbed = MLX.prepare(V3, params, x, strategy="absorbed", dtype="float32")[0]
    out = absorbed.output()
    R = V3.kv_lora_rank
    # queries, keys and values all of the latent's R = 10 features: one key head (MQA) for 3 query heads
    assert kernel.calls == [((2, 3, 7, R), (2, 1, 7, R), (2, 1, 7, R))]
    assert absorbed.info["attention"] == mla.FUSED
    assert_close(out, reference_mha(V3, params, x), "float32")


def test_a_softcap_sends_the_absorbed_form_to_the_score_steps_with_the_reason(monkeypatch):
    kernel = KernelCalls(monkeypatch)
    params, x = init_params(SOFTCAP, seed=3), _x(SOFTCAP, (2, 7))
    prepared = MLX.prepare(SOFTCAP, params, x, strategy="absorbed", dtype="float64")[0]
    assert_close(prepared.output(), reference_mha(SOFTCAP, params, x), "float32")
    assert kernel.calls == []
    reason = "softcap: mx.fast.scaled_dot_product_attention takes the scores as q.k + mask only"
    assert reason in prepared.info["attention"]
    assert mla.kernel_reason(V3) is None  # the causal mask rides in the kernel's mask


@pytest.mark.parametrize("form", MLA_STRATEGIES)
def test_a_query_with_no_allowed_key_gets_the_specs_zeros_forward_and_backward(form):
    cfg = V2_LITE  # o_proj has a bias: a zero context gives b_o
    params, x = init_params(cfg, seed=2), _x(cfg, (2, 5), seed=4)
    mask = np.ones((2, 1, 5, 5), dtype=bool)
    mask[1, :, 3] = False  # sequence 1's query 3 may attend to nothing
    out = MLX.run(cfg, params, x, mask=mask, strategy=form, dtype="float64")
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[1, 3], params.b_o, rtol=0, atol=1e-6)
    assert_close(out, reference_mha(cfg, params, x, mask=mask), "float32")
    cotangent = np.random.default_rng(5).standard_normal(out.shape)
    grads = MLX.run_vjp(cfg, params, x, mask=mask, cotangent=cotangent, strategy=form, dtype="float64")
    expected = reference_mha_vjp(cfg, params, x, mask=mask, cotangent=cotangent)
    assert_close(grads.d_query, expected.d_query, "float32")
    for field in fields(expected.d_params):
        want = getattr(expected.d_params, field.name)
        if want is not None:
            assert_close(getattr(grads.d_params, field.name), want, "float32", what=field.name)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("form", MLA_STRATEGIES)
def test_each_dtype_within_its_tolerance(form, dtype):
    params, x = init_params(V3, seed=6), _x(V3, (2, 6), seed=7)
    assert_close(MLX.run(V3, params, x, strategy=form, dtype=dtype), reference_mha(V3, params, x), dtype)


def test_the_timed_steps_give_numpys_step_on_mlx_lms_cache():
    params = init_params(V3, seed=4)
    R, dr = V3.kv_lora_rank, V3.qk_rope_head_dim
    job = dict(context=11, batch=2, step=2, seed=7)
    numpy = _step("numpy", V3, params, strategy="naive", **job).output()  # the same numbers drawn: tokens, then cache
    for form in MLA_STRATEGIES:
        prepared = _step("mlx", V3, params, strategy=form, **job)
        out = prepared.output()
        np.testing.assert_array_equal(prepared.output(), out)  # every timed call is the same step
        assert_close(out, numpy, "float32", what=form)
        cache = prepared.info["cache"]
        assert (cache["kind"], cache["slots"]) == ("latent", MLX_LM_STEP)  # 13 tokens in mlx-lm's first 256 slots
        assert cache["bytes"] == 2 * MLX_LM_STEP * (R + dr) * 8 and cache["bytes_per_token"] == (R + dr) * 8
        assert prepared.info["form"] == form
    with pytest.raises(UnsupportedCase, match="mlx: MLA's timed step takes a rectangular batch"):
        MLX.prepare_decode(V3, params, context=4, batch=2, strategy="naive", lengths=[4, 2])


def test_a_windowed_timed_step_holds_a_ring_and_gives_numpys_step():
    cfg = MHAConfig(**dict(DEEPSEEK_V3_LIKE, window=4))
    params = init_params(cfg, seed=4)
    job = dict(context=9, batch=1, step=1, strategy="absorbed", seed=3)
    numpy, prepared = _step("numpy", cfg, params, **job).output(), _step("mlx", cfg, params, **job)
    assert prepared.info["cache"]["slots"] == 4  # mlx-lm's RotatingKVCache: W - 1 + step slots
    assert_close(prepared.output(), numpy, "float32")


def test_the_bench_decode_mla_row_has_mlxs_two_forms():
    from mha_rosetta.benchmarks.decode_mla import mla_implementations

    assert mla_implementations(["mlx"]) == [f"mlx:{form}" for form in MLA_STRATEGIES]
    assert MLX.mla_timed_step and set(MLA_STRATEGIES) <= set(MLX.decode_strategies)
