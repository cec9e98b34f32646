"""Llama 4's temperature and QK-norm after rotary, and Gemma 4's value norm, in every convention we write.

Each form against the float64 oracle in numpy (column samples, hand-written backward), torch, jax, einops (on
NumPy, torch and JAX) and mlx: the forward in every strategy, the backward, and decode, where the temperature's
positions include the cache offset (the cases step the factor inside the decoded steps, so an adapter that
restarted the positions at each step would fail them). The norms are per head: each head's recorded stage has
RMS 1 on its own, which a norm across heads (vllm #16311) does not give. The third-party oracles refuse the
forms by name (`Variant.implemented_by`).
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends import CHUNKED, DIRECT_RESHAPE, UnsupportedCase, get_backend, missing_backends
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.core import MHAConfig, assert_close, compare, init_params, reference_mha
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.grad import reference_mha_vjp
from mha_rosetta.core.variants import BUILTIN_VARIANTS, VARIANT_REGISTRY, temperature_scales

OURS = ("numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax", "mlx")
FORMS = ("temperature", "qk_norm_after_rope", "value_norm")
BASE = dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, bias=False)
CFGS = {
    # Llama 4's NoPE layer: floor_scale 3 steps the factor at positions 2, 5, 8 (inside 9 tokens).
    "temperature": MHAConfig(**BASE, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5),
    # Llama 4's rotary layer: interleaved rotary, chunks of 4, the weightless norm after rotary.
    "qk_norm_after_rope": MHAConfig(
        **BASE, rope="interleaved", attention_chunk_size=4, norm_eps=1e-5, qk_norm_after_rope=True
    ),
    # Gemma 4's sliding layer: QK-norm with weights, scale 1, a window, and the values normed per kv head.
    "value_norm": MHAConfig(
        **dict(BASE, d_model=32, d_k=8), rope="half", qk_norm="head", scale=1.0, window=4, value_norm=True
    ),
}
MISSING = missing_backends()


def _backend(name: str):
    if name in MISSING:
        pytest.skip(f"{name}: {MISSING[name]}")
    return get_backend(name)


def _level(name: str) -> str:
    """The tolerance an adapter is held to in a float64 run: MLX's float64 exp is float32-accurate (its known
    difference, `frameworks.mlx.FLOAT64_LIMIT`); every other adapter computes in float64."""
    return "float32" if name == "mlx" else "float64"


def _x(cfg: MHAConfig, batch: int = 2, tokens: int = 9, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, cfg.d_model))


def test_the_entries_name_every_library_and_no_oracle_claims_them():
    for form in FORMS:
        assert VARIANT_REGISTRY[form].implemented_by == ("numpy", "torch", "jax", "mlx"), form
        assert form not in BUILTIN_VARIANTS, form  # what a third-party kernel may claim


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", OURS)
def test_every_strategy_agrees_with_the_oracle_in_float64(name, form):
    backend, cfg = _backend(name), CFGS[form]
    assert form in backend.variants and form in backend.decode_variants
    params, x = init_params(cfg, seed=2), _x(cfg)
    expected = reference_mha(cfg, params, x)
    # The known mistake is caught apart; MLA's strategies refuse a layer without its latent (tests/test_mla_adapters.py).
    for strategy in (s for s in backend.strategies if s not in (DIRECT_RESHAPE, *MLA_STRATEGIES)):
        out = backend.run(cfg, params, x, dtype="float64", strategy=strategy)
        assert_close(out, expected, _level(name), what=f"{name}/{strategy} {form}")


@pytest.mark.parametrize("form", ["qk_norm_after_rope", "value_norm"])
@pytest.mark.parametrize("name", OURS)
def test_the_norms_are_per_head_in_every_convention(name, form):
    """Each head's normed stage has RMS 1 over its own features (mean of squares 1 - eps / (ms + eps)): a norm
    taken across the heads (vllm #16311) gives RMS 1 over all heads together and not per head."""
    backend, cfg = _backend(name), CFGS[form]
    params, x = init_params(cfg, seed=2), _x(cfg)
    _, stages = backend.run(cfg, params, x, dtype="float64", return_stages=True)
    before, after = ("v_heads", "v_normed") if form == "value_norm" else ("k_rotated", "k_rotated_normed")
    raw, normed = stages[before], stages[after]  # (B, Hkv, N, d), canonical
    mean_square = np.mean(raw * raw, axis=-1)  # (B, Hkv, N): each head's own
    per_head = np.mean(normed * normed, axis=-1)
    rtol = 1e-5 if name == "mlx" else 1e-12  # MLX's float64 rsqrt is float32-accurate
    np.testing.assert_allclose(per_head, mean_square / (mean_square + cfg.norm_eps), rtol=rtol)
    assert np.ptp(mean_square, axis=1).max() > 0.1  # the heads' own RMS differ, so a norm across them is caught


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [n for n in OURS if n != "einops-numpy"])  # einops on NumPy has no backward
def test_the_backward_agrees_with_the_oracle_in_float64(name, form):
    backend, cfg = _backend(name), CFGS[form]
    params, x = init_params(cfg, seed=2), _x(cfg, tokens=7)
    cot = np.random.default_rng(4).standard_normal(x.shape)
    want = reference_mha_vjp(cfg, params, x, cotangent=cot).tensors()
    # chunked: forward only; MLA's strategies need its latent
    strategies = [s for s in backend.strategies if s not in (DIRECT_RESHAPE, CHUNKED, *MLA_STRATEGIES)]
    for strategy in strategies:
        got = backend.run_vjp(cfg, params, x, cotangent=cot, dtype="float64", strategy=strategy).tensors()
        assert set(got) == set(want), (name, strategy)
        bad = [grad for grad, value in want.items() if not compare(got[grad], value, _level(name)).ok]
        assert not bad, (name, strategy, bad)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", OURS)
def test_decode_agrees_with_the_full_forward(name, form):
    """Prefill 4, steps of 2 and of 1: with floor_scale 3 the factor steps at positions 5 and 8, inside the
    decoded steps, where positions restarted at 0 would give factor 1 (asserted below, so the case can fail)."""
    backend, cfg = _backend(name), CFGS[form]
    params, x = init_params(cfg, seed=3), _x(cfg)
    expected = reference_decode(cfg, params, x, prefill=4)
    for step in (2, 1):
        got = backend.run_decode(cfg, params, x, prefill=4, step=step)
        assert_close(got, expected, _level(name), what=f"{name} decode step={step} {form}")
    if form == "temperature":
        with_offset = temperature_scales(np.arange(4, 9), cfg.floor_scale, cfg.attn_scale)
        restarted = temperature_scales(np.arange(4, 9) - 4, cfg.floor_scale, cfg.attn_scale)
        assert np.abs(with_offset - restarted).min() > 0.1  # every decoded position's factor differs


@pytest.mark.parametrize("name", ["torch", "numpy"])
def test_a_decode_step_at_a_late_position_takes_that_position_s_factor(name):
    """One step at positions 100 and 101 after a prefill of 2 at 98, 99 (floor_scale 3): the step's factors are
    those of 100 and 101 (floor 33 and 34), not of 0 and 1 (factor 1)."""
    backend, cfg = _backend(name), CFGS["temperature"]
    params, x = init_params(cfg, seed=5), _x(cfg, tokens=4)
    positions = np.arange(98, 102)[None].repeat(2, 0)
    expected = reference_decode(cfg, params, x, prefill=2, step=2, positions=positions)
    got = backend.run_decode(cfg, params, x, prefill=2, step=2, positions=positions)
    assert_close(got, expected, "float64", what=f"{name} decode from position 98")
    plain = reference_decode(MHAConfig(**BASE), params, x, prefill=2, step=2, positions=positions)
    assert np.abs(expected - plain).max() > 1e-3  # the factors (about 2.76) change the answer


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["torch-sdpa", "jax-dpa", "torch-flex", "torch-mha", "mlx-sdpa", "numpy-best"])
def test_the_third_party_oracles_refuse_the_forms_by_name(name, form):
    backend = _backend(name)
    reason = backend.variant_reason(CFGS[form], "standard")
    assert reason is not None and form in reason, reason
    with pytest.raises(UnsupportedCase, match=form):
        backend.run(CFGS[form], init_params(CFGS[form]), _x(CFGS[form]), dtype="float64")
