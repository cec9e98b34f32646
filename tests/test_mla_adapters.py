"""MLA in the conventions (issue 45): each adapter that applies it runs its ``naive`` and ``absorbed`` strategies,
forward, decode through a latent cache and backward, against the float64 oracle; the two forms agree with each
other to about 1e-12; every other strategy, and every other adapter, refuses it by name. The einops adapters
(on NumPy, torch and JAX arrays) run both forms in named axes and agree with the numpy adapter's column samples;
einops-numpy has no backward (NumPy has no autodiff) and says so.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.backends.vocabulary import STANDARD
from mha_rosetta.core import MHAConfig, init_params, reference_mha, reference_mha_vjp, reference_stages
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.tolerances import assert_close
from mha_rosetta.core.variants import VARIANT_REGISTRY, adapted_variants, strategy_forms
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE, MLA_ADAPTERS
from mha_rosetta.core.variants.models import MISTRAL4_LIKE

FORMS = ("naive", "absorbed")
# The adapters that apply MLA, each with the library it needs (the numpy env has NumPy only).
ADAPTERS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", id="torch", marks=requires("torch")),
    pytest.param("jax", id="jax", marks=requires("jax")),
    pytest.param("einops-numpy", id="einops-numpy", marks=requires("einops")),
    pytest.param("einops-torch", id="einops-torch", marks=[requires("einops"), requires("torch")]),
    pytest.param("einops-jax", id="einops-jax", marks=[requires("einops"), requires("jax")]),
]
# einops-numpy has no backward: NumPy has no autodiff (`backends.einops.vjp`).
VJP_ADAPTERS = [param for param in ADAPTERS if param.values[0] != "einops-numpy"]
EINOPS = [param for param in ADAPTERS if param.values[0].startswith("einops-")]
CONFIGS = {
    "v3": MHAConfig(**DEEPSEEK_V3_LIKE),  # q LoRA, YaRN on both sides, interleaved pairs
    "v2_lite": MHAConfig(**DEEPSEEK_V2_LITE_LIKE),  # one q_proj, attention_bias on kv_a and o_proj
    "v3_half_window": MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_interleave=False, window=3)),
    "v3_softcap_chunks": MHAConfig(**dict(DEEPSEEK_V3_LIKE, softcap=4.0, attention_chunk_size=3)),
    # Mistral 4's temperature on both query parts, at the positions (a decode step's with the cache offset)
    "mistral4": MHAConfig(**MISTRAL4_LIKE),
}


def _backend(name):
    from mha_rosetta.backends import get_backend

    return get_backend(name)


def _x(cfg, shape, seed=1):
    return np.random.default_rng(seed).standard_normal((*shape, cfg.d_model))


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("config", CONFIGS)
def test_both_strategies_agree_with_the_oracle_and_each_other_to_1e_12(name, config):
    cfg = CONFIGS[config]
    params = init_params(cfg, seed=4)
    x = _x(cfg, (2, 9))
    ref = reference_mha(cfg, params, x)
    backend = _backend(name)
    naive, absorbed = (backend.run(cfg, params, x, strategy=form, dtype="float64") for form in FORMS)
    scale = np.abs(ref).max()
    assert np.abs(naive - ref).max() <= 1e-12 * scale
    assert np.abs(absorbed - ref).max() <= 1e-12 * scale
    assert np.abs(absorbed - naive).max() <= 1e-12 * scale


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
def test_a_mask_positions_and_float32(name, form):
    cfg = CONFIGS["v2_lite"]
    params = init_params(cfg, seed=0)
    x = _x(cfg, (2, 6))
    mask = np.random.default_rng(3).random((6, 6)) < 0.7
    positions = np.array([0, 2, 3, 5, 8, 9])
    ref = reference_mha(cfg, params, x, mask=mask, positions=positions)
    backend = _backend(name)
    out = backend.run(cfg, params, x, mask=mask, positions=positions, strategy=form, dtype="float64")
    assert_close(out, ref, "float64")
    assert_close(backend.run(cfg, params, x, strategy=form, dtype="float32"), reference_mha(cfg, params, x), "float32")


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("config", ["v3", "v3_half_window", "mistral4"])
def test_decode_through_the_latent_cache_equals_the_full_forward(name, form, config):
    cfg = CONFIGS[config]
    params = init_params(cfg, seed=5)
    x = _x(cfg, (2, 8), seed=2)
    mask = np.ones((2, 8), dtype=bool)
    mask[1, :2] = False  # left padding in one sequence
    prepared, inputs = _backend(name).prepare_decode_run(
        cfg, params, x, prefill=3, step=2, mask=mask, strategy=form, dtype="float64"
    )
    out = inputs.unbatch(prepared.output())
    expected = reference_decode(cfg, params, x, prefill=3, step=2, mask=mask)
    assert_close(out[mask], expected[mask], "float64")
    cache = prepared.info["cache"]
    R, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert cache["bytes_per_token"] == (R + dr) * 8  # 16 numbers a token: the latent and the shared key
    assert cache["expanded_bytes_per_token"] == cfg.n_heads * (cfg.d_k + cfg.d_v) * 8  # 3 * (10 + 5) = 45 numbers
    assert cache["bytes"] == 2 * 8 * (R + dr) * 8


@pytest.mark.parametrize("name", VJP_ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("config", ["v3", "v2_lite", "v3_softcap_chunks", "mistral4"])
def test_the_backward_agrees_with_the_oracle(name, form, config):
    cfg = CONFIGS[config]
    params = init_params(cfg, seed=6)
    x = _x(cfg, (2, 7), seed=3)
    cotangent = np.random.default_rng(9).standard_normal((2, 7, cfg.d_model))
    expected = reference_mha_vjp(cfg, params, x, cotangent=cotangent)
    grads = _backend(name).run_vjp(cfg, params, x, cotangent=cotangent, strategy=form, dtype="float64")
    assert_close(grads.d_query, expected.d_query, "float64")
    checked = 0
    for field in fields(expected.d_params):
        want = getattr(expected.d_params, field.name)
        if want is not None:
            assert_close(getattr(grads.d_params, field.name), want, "float64", what=field.name)
            checked += 1
    assert checked >= 7  # w_q, w_k, w_v, w_o, w_kv_a, kv_a_norm and more


@requires("einops")
@pytest.mark.parametrize("form", FORMS)
def test_einops_numpy_refuses_the_backward_with_the_reason(form):
    from mha_rosetta.backends.base import UnsupportedCase

    cfg = CONFIGS["v3"]
    x = _x(cfg, (1, 4))
    with pytest.raises(UnsupportedCase, match="einops-numpy has no backward: NumPy has no autodiff"):
        _backend("einops-numpy").run_vjp(cfg, init_params(cfg, seed=0), x, cotangent=x, strategy=form)


@pytest.mark.parametrize("name", EINOPS)
@pytest.mark.parametrize("config", CONFIGS)
def test_einops_forms_agree_with_the_numpy_adapters_column_samples(name, config):
    cfg = CONFIGS[config]
    params = init_params(cfg, seed=7)
    x = _x(cfg, (2, 8), seed=4)
    scale = np.abs(reference_mha(cfg, params, x)).max()
    for form in FORMS:
        numpy_out = _backend("numpy").run(cfg, params, x, strategy=form, dtype="float64")
        einops_out = _backend(name).run(cfg, params, x, strategy=form, dtype="float64")
        assert np.abs(einops_out - numpy_out).max() <= 1e-12 * scale, form
    backend = _backend(name)
    prepared, _ = backend.prepare(cfg, params, x, strategy="absorbed", dtype="float64")
    stages = backend.canonical_stages(prepared)  # the latent, the shared key and the queries, in the oracle's layout
    expected = reference_stages(cfg, params, x)
    for stage in ("kv_latent", "k_rope", "q", "output") + (("q_latent",) if cfg.q_lora_rank else ()):
        assert_close(stages[stage], expected[stage], "float64", what=stage)


@requires("einops")
def test_the_einops_mla_module_names_its_axes_and_never_swaps_them():
    import inspect

    from test_backend_einops import axis_swaps  # the einops convention's checker, one place

    from mha_rosetta.backends.einops import mla

    assert axis_swaps(inspect.getsource(mla)) == []


@pytest.mark.parametrize("name", ADAPTERS)
def test_mla_runs_only_in_its_strategies_and_they_run_only_mla(name):
    backend = _backend(name)
    v3, plain = CONFIGS["v3"], MHAConfig(d_model=12, n_heads=3)
    for strategy in backend.strategies:
        reason = backend.variant_reason(v3, strategy) or backend.unsupported_reason(v3, "float64", "cpu", strategy)
        assert (reason is None) == (strategy in FORMS), (strategy, reason)
    for form in FORMS:
        assert "needs MHAConfig.kv_lora_rank" in backend.unsupported_reason(plain, "float64", "cpu", form)
        sinks = MHAConfig(**dict(DEEPSEEK_V3_LIKE, sinks=True))
        assert "sinks" in backend.variant_reason(sinks, form)
        assert "latent cache" in backend.decode_reason(v3, "float64", "cpu", form, "paged")
    assert "naive' and 'absorbed' strategies only" in backend.decode_reason(v3, "float64", "cpu", "standard", None)


def test_the_entries_name_the_libraries_and_the_strategies_that_run_them():
    assert VARIANT_REGISTRY["mla"].implemented_by == MLA_ADAPTERS == VARIANT_REGISTRY["mla_q_lora"].implemented_by
    assert MLA_ADAPTERS == ("numpy", "torch", "jax")
    assert VARIANT_REGISTRY["mla"].strategies == MLA_STRATEGIES == VARIANT_REGISTRY["mla_q_lora"].strategies
    assert MLA_STRATEGIES == FORMS
    # The forms that run only in those strategies, read from the registry: what a standard path never declares.
    assert strategy_forms(MLA_STRATEGIES) == {"mla", "mla_q_lora"}
    assert adapted_variants("numpy") - adapted_variants("numpy", strategy=STANDARD) == {"mla", "mla_q_lora"}
    assert strategy_forms(("standard", "naive")) == set()  # both strategies, or none of the form


def test_an_adapter_declares_mla_only_with_its_strategies_and_refuses_it_by_name_without():
    from mha_rosetta.backends.base import Backend
    from mha_rosetta.backends.frameworks.ops import RegistryVariants

    class Plain(Backend):
        name = "plain"
        variants = RegistryVariants("numpy")

    class WithForms(Plain):
        strategies = (STANDARD, *MLA_STRATEGIES)

    assert not {"mla", "mla_q_lora"} & Plain.variants
    assert {"mla", "mla_q_lora"} <= WithForms.variants
    assert Plain.variants == WithForms.variants - {"mla", "mla_q_lora"}
    reason = Plain().variant_reason(CONFIGS["v3"], STANDARD)
    assert reason.startswith("plain does not implement mla, mla_q_lora (it implements: "), reason


@requires("torch")
def test_the_third_party_oracles_refuse_mla():
    assert "mla" in _backend("torch-sdpa").variant_reason(CONFIGS["v3"], "standard")
