"""The query temperature in its two forms (Llama 4: floor((p + 1) / f), Mistral 4: floor(p / f), `floor_offset`)
and Mistral 4's combination of it with MLA (issue 45): the factors by hand, the field's validation, the spec's
stages (both query parts, forward and backward), core.mla_forms, every MLA adapter's forms at positions with gaps
and in float32, and the refusal by an MLA owner that does not apply the temperature. The MLA suites run the
``mistral4`` layer too: central differences (tests/test_mla.py), every adapter's forms forward, decode through the
latent cache with the cache offset and backward (tests/test_mla_adapters.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_mla_adapters import ADAPTERS, FORMS, _level  # the adapters with MLA's forms, each with what it needs

from mha_rosetta.backends._mla import QUERY_STEPS, form_variants
from mha_rosetta.core import MHAConfig, init_params, reference_mha, reference_mha_vjp, reference_stages
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.mla_forms import mla_decode, mla_forward
from mha_rosetta.core.tolerances import assert_close
from mha_rosetta.core.variants import temperature_scales
from mha_rosetta.core.variants.models import MISTRAL4_LIKE, MODELS
from mha_rosetta.core.variants.temperature import offset_reason

MISTRAL4 = MHAConfig(**MISTRAL4_LIKE)


def _x(cfg, shape, seed=1):
    return np.random.default_rng(seed).standard_normal((*shape, cfg.d_model))


def _backend(name):
    from mha_rosetta.backends import get_backend

    return get_backend(name)


# -- the factors ------------------------------------------------------------------------------------------------------
def test_both_forms_by_hand():
    positions = np.array([0, 2, 3, 4, 7, 8, 11])
    half_log = [0.5 * math.log(n) for n in (2, 3, 4)]
    # Llama 4: floor((p + 1) / 4) = 0 0 1 1 2 2 3
    llama = [1, 1, 1 + half_log[0], 1 + half_log[0], 1 + half_log[1], 1 + half_log[1], 1 + half_log[2]]
    # Mistral 4: floor(p / 4) = 0 0 0 1 1 2 2, one position later
    mistral = [1, 1, 1, 1 + half_log[0], 1 + half_log[0], 1 + half_log[1], 1 + half_log[1]]
    np.testing.assert_allclose(temperature_scales(positions, 4.0, 0.5), llama, rtol=1e-15)
    np.testing.assert_allclose(temperature_scales(positions, 4.0, 0.5, 0), mistral, rtol=1e-15)
    # the models' defaults: floor 8192, 0.1 (Llama4TextConfig; Mistral4Config's llama_4_scaling_beta and original)
    at = np.array([8190, 8191, 8192, 16383, 16384])
    two, three = 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)
    np.testing.assert_allclose(temperature_scales(at, 8192.0, 0.1), [1, two, two, three, three], rtol=1e-15)
    np.testing.assert_allclose(temperature_scales(at, 8192.0, 0.1, 0), [1, 1, two, two, three], rtol=1e-15)


def test_llama4s_factors_are_bit_for_bit_what_they_were():
    """The offset's default is Llama 4's and its formula is unchanged: the same bits as before the field existed."""
    positions = np.arange(40_000).reshape(2, -1)
    before = 1.0 + 0.1 * np.log1p(np.floor((positions.astype(np.float64) + 1.0) / 8192.0))  # the formula of 2026-11
    assert np.array_equal(temperature_scales(positions, 8192.0, 0.1), before)
    assert MHAConfig(d_model=8, n_heads=2, attn_temperature_tuning=True).floor_offset == 1


@pytest.mark.parametrize("bad", [2, -1, True, 0.0, "0", None])
def test_floor_offset_is_zero_or_one_and_the_error_names_both_forms(bad):
    with pytest.raises(ValueError, match=r"MHAConfig\.floor_offset must be 1 \(Llama 4.*\) or 0 \(Mistral 4"):
        MHAConfig(d_model=8, n_heads=2, attn_temperature_tuning=True, floor_offset=bad)


def test_each_module_refuses_the_other_models_form():
    from mha_rosetta.models import get_layout

    llama = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, bias=False, attn_temperature_tuning=True,
                      floor_scale=4, floor_offset=0)  # fmt: skip
    reason = get_layout("hf-llama4").unsupported_reason(llama)
    assert reason.startswith("MHAConfig.floor_offset=0 (Mistral 4") and "Llama4TextAttention's temperature" in reason
    assert "floor_offset=0" in get_layout("mlx-llama4").unsupported_reason(llama)
    assert "Mistral4Attention's temperature is Mistral 4: log(1 + floor(p" in offset_reason(
        MHAConfig(**dict(MISTRAL4_LIKE, floor_offset=1)), "Mistral4Attention", 0
    )
    assert offset_reason(MHAConfig(d_model=8, n_heads=2), "Mistral4Attention", 0) is None  # no temperature: no rule


# -- the spec ---------------------------------------------------------------------------------------------------------
def test_the_spec_tempers_both_query_parts_of_mla_by_position():
    params = init_params(MISTRAL4, seed=2)
    x = _x(MISTRAL4, (2, 7))
    stages = reference_stages(MISTRAL4, params, x)
    factors = temperature_scales(np.arange(7), 3.0, 0.5, 0)  # 1 1 1 1.347 1.347 1.347 1.549
    assert factors[2] == 1 and factors[3] == 1 + 0.5 * math.log(2) and factors[6] == 1 + 0.5 * math.log(3)
    dn = MISTRAL4.qk_nope_head_dim
    for part in (slice(None, dn), slice(dn, None)):  # nope and rope alike
        ratio = stages["q_tempered"][..., part] / stages["q_rotated"][..., part]  # (B, H, Nq, d)
        np.testing.assert_allclose(ratio, np.broadcast_to(factors[:, None], ratio.shape), rtol=1e-14)
    untempered = MHAConfig(**dict(MISTRAL4_LIKE, attn_temperature_tuning=False))
    gap = np.abs(stages["output"] - reference_mha(untempered, params, x)).max()
    assert gap > 1e-2 * np.abs(stages["output"]).max()  # an implementation that forgot it cannot pass
    # its backward is the same factor (central differences through it: tests/test_mla.py's mistral4)
    grads = reference_mha_vjp(MISTRAL4, params, x, cotangent=np.ones_like(x))
    expected = grads.stages["d_q_tempered"] * factors[:, None]  # (B, H, Nq, Dk) times each row's factor
    np.testing.assert_allclose(grads.stages["d_q_rotated"], expected, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("form", FORMS)
def test_core_mla_forms_apply_it_forward_and_through_the_latent_cache(form):
    params = init_params(MISTRAL4, seed=6)
    x = _x(MISTRAL4, (2, 8), seed=2)
    np.testing.assert_allclose(mla_forward(MISTRAL4, params, x, form=form), reference_mha(MISTRAL4, params, x),
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    decoded = mla_decode(MISTRAL4, params, x, prefill=3, step=2, form=form)
    np.testing.assert_allclose(
        decoded, reference_decode(MISTRAL4, params, x, prefill=3, step=2), rtol=1e-12, atol=1e-12
    )


# -- the adapters -----------------------------------------------------------------------------------------------------
def test_the_owners_that_apply_it_declare_it_and_the_models_table_runs_it():
    assert QUERY_STEPS == ("temperature",)
    assert "temperature" not in form_variants() and "temperature" in form_variants(QUERY_STEPS)
    with pytest.raises(ValueError, match="query_steps must be among temperature, got qk_norm_after_rope"):
        form_variants(("qk_norm_after_rope",))
    assert MODELS["mistral4"].config == MISTRAL4_LIKE and MODELS["mistral4"].check and MODELS["mistral4"].decode


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_takes_the_factors_of_the_positions_and_holds_float32(name, form):
    """Both forms against the spec at positions with gaps (the factors follow the positions, not the indices) and in
    float32; float64 at the positions 0..N-1, decode and the backward: tests/test_mla_adapters.py's ``mistral4``."""
    params = init_params(MISTRAL4, seed=4)
    x = _x(MISTRAL4, (2, 7))
    backend = _backend(name)
    assert "temperature" in backend.strategy_variants[form]
    positions = np.array([0, 2, 3, 5, 8, 9, 12])
    out = backend.run(MISTRAL4, params, x, positions=positions, strategy=form, dtype="float64")
    assert_close(out, reference_mha(MISTRAL4, params, x, positions=positions), _level(backend))  # MLX: float32
    assert_close(backend.run(MISTRAL4, params, x, strategy=form, dtype="float32"), reference_mha(MISTRAL4, params, x),
                 "float32")  # fmt: skip


def test_an_mla_owner_that_does_not_apply_it_refuses_it_by_name():
    """What an owner of the MLA strategies without ``mla_query_steps`` (the default) answers: the refusal, forward,
    backward and decode, never a run without the temperature."""
    from mha_rosetta.backends.numpy.adapter import NumpyBackend

    class Untempered(NumpyBackend):
        name = "numpy-untempered"
        mla_query_steps = ()

    backend = Untempered()
    for form in FORMS:
        assert "temperature" not in backend.strategy_variants[form]
        reason = backend.unsupported_reason(MISTRAL4, "float64", "cpu", form)
        assert reason.startswith(f"numpy-untempered does not implement temperature in its {form!r} strategy"), reason
        assert "temperature" in backend.variant_reason(MISTRAL4, form)
        assert "decode path does not implement temperature" in backend.decode_reason(
            MISTRAL4, "float64", "cpu", form, None
        )
        untempered = MHAConfig(**dict(MISTRAL4_LIKE, attn_temperature_tuning=False))
        assert backend.unsupported_reason(untempered, "float64", "cpu", form) is None  # MLA alone it runs
