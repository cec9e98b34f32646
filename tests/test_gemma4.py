"""Gemma 4's attention (issue 45): the value norm, ``attention_k_eq_v``, scale 1 and proportional rotary in the
spec (float64 forward by hand, backward by central differences, the refusals), and ``Gemma4TextAttention`` read
and written by `from_module` / `to_module`, proved on the real module.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import normal
from mha_rosetta.backends.registry import get_backend
from mha_rosetta.core import MHAConfig, MHAParams, default_cotangent, init_params, reference_mha, reference_mha_vjp
from mha_rosetta.core.rope_scaling import scaled_frequencies, validate_rope_scaling
from mha_rosetta.core.rotary import rotary_pairs
from mha_rosetta.core.stages import stage_names
from mha_rosetta.core.variants import BUILTIN_VARIANTS, VARIANT_REGISTRY
from mha_rosetta.core.variants.k_eq_v import GEMMA4_GLOBAL
from mha_rosetta.core.variants.value_norm import GEMMA4_SLIDING

SLIDING = MHAConfig(**dict(GEMMA4_SLIDING, value_norm=True, window=3))
GLOBAL = MHAConfig(**GEMMA4_GLOBAL)


def test_the_value_norm_divides_each_kv_heads_values_by_their_rms_and_the_context_reads_them():
    params = init_params(SLIDING, seed=3)
    x = normal((2, 5, SLIDING.d_model))
    out, stages = reference_mha(SLIDING, params, x, return_stages=True)
    v = stages["v_heads"]  # (B, Hkv, N, Dv)
    by_hand = v / np.sqrt((v**2).mean(axis=-1, keepdims=True) + SLIDING.norm_eps)
    np.testing.assert_allclose(stages["v_normed"], by_hand, rtol=1e-15, atol=0)
    np.testing.assert_allclose(np.sqrt((stages["v_normed"] ** 2).mean(axis=-1)), 1.0, atol=1e-5)  # eps 1e-6
    for h in range(SLIDING.n_heads):  # the context is the weights times the normed values, not the raw ones
        g = SLIDING.kv_head_of(h)
        np.testing.assert_allclose(stages["context"][:, h], stages["weights"][:, h] @ by_hand[:, g], atol=1e-14)
    off = MHAConfig(**dict(GEMMA4_SLIDING, window=3))
    assert "v_normed" not in stage_names(off) and stage_names(SLIDING).index("v_normed") == 6
    assert np.max(np.abs(reference_mha(off, params, x) - out)) > 1e-2  # the norm changes the layer


def test_scale_one_is_the_existing_scale_field():
    params = init_params(SLIDING, seed=1)
    stages = reference_mha(SLIDING, params, normal((1, 4, SLIDING.d_model)), return_stages=True)[1]
    raw = np.einsum("bhqd,bhkd->bhqk", stages["q_rotated"], np.repeat(stages["k_rotated"], 2, axis=1))
    np.testing.assert_allclose(stages["scores"], raw, rtol=1e-14, atol=1e-14)  # no 1/sqrt(d_k)


@pytest.mark.parametrize("cfg", [SLIDING, GLOBAL, MHAConfig(**dict(GEMMA4_GLOBAL, value_norm=False))], ids=str)
def test_the_float64_backward_matches_central_differences(cfg):
    params = init_params(cfg, seed=5)
    x = normal((2, 4, cfg.d_model), seed=1)
    cot = default_cotangent((2, 4, cfg.d_model))
    grads = reference_mha_vjp(cfg, params, x, cotangent=cot)
    assert ("d_v_normed" in grads.stages) == cfg.value_norm

    def loss(p, query):
        return float(np.sum(cot * reference_mha(cfg, p, query)))

    eps, rng = 1e-6, np.random.default_rng(7)
    moved_names = ("w_k",) if cfg.attention_k_eq_v else ("w_v", "w_k")
    for name in (*moved_names, "w_q", "w_o", "k_norm"):
        direction = rng.standard_normal(getattr(params, name).shape)
        tied = ("w_k", "w_v") if cfg.attention_k_eq_v and name == "w_k" else (name,)  # one weight moves both
        moved = [
            MHAParams(**{**params.as_dict(), **{n: getattr(params, n) + t * direction for n in tied}})
            for t in (eps, -eps)
        ]
        fd = (loss(moved[0], x) - loss(moved[1], x)) / (2 * eps)
        analytic = float(sum(np.sum(getattr(grads.d_params, n) * direction) for n in tied))  # d_w_k + d_w_v
        assert abs(fd - analytic) <= 1e-8 * max(1.0, abs(analytic)), (name, fd, analytic)
    direction = rng.standard_normal(x.shape)
    fd = (loss(params, x + eps * direction) - loss(params, x - eps * direction)) / (2 * eps)
    analytic = float(np.sum(grads.d_query * direction))
    assert abs(fd - analytic) <= 1e-8 * max(1.0, abs(analytic)), (fd, analytic)


def test_k_eq_v_ties_w_v_to_w_k_so_v_is_the_raw_key_projection():
    params = init_params(GLOBAL, seed=2)
    assert np.array_equal(params.w_v, params.w_k) and params.w_v is not params.w_k
    stages = reference_mha(GLOBAL, params, normal((1, 5, GLOBAL.d_model)), return_stages=True)[1]
    np.testing.assert_array_equal(stages["v"], stages["k"])  # before k_norm and rotary
    assert not np.allclose(stages["v_heads"], stages["k_rotated"])
    untied = MHAParams(**{**params.as_dict(), "w_v": params.w_v + 1e-3})
    with pytest.raises(ValueError, match=r"params.w_v must equal params.w_k because cfg.attention_k_eq_v is True"):
        reference_mha(GLOBAL, untied, normal((1, 3, GLOBAL.d_model)))


def test_bad_gemma4_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"attention_k_eq_v=True needs d_v == d_k.*got d_k=8, d_v=4"):
        MHAConfig(d_model=32, n_heads=4, d_k=8, d_v=4, attention_k_eq_v=True)
    with pytest.raises(ValueError, match=r"attention_k_eq_v=True needs vdim == kdim.*kdim=32, vdim=16"):
        MHAConfig(d_model=32, n_heads=4, vdim=16, attention_k_eq_v=True)
    with pytest.raises(TypeError, match=r"MHAConfig\.value_norm must be a bool, got 1"):
        MHAConfig(d_model=32, n_heads=4, value_norm=1)
    with pytest.raises(ValueError, match=r"'partial_rotary_factor'\] is the share of the head's pairs.*got 1.5"):
        validate_rope_scaling({"rope_type": "proportional", "partial_rotary_factor": 1.5})


def test_proportional_rotary_turns_the_first_quarter_of_the_half_pairs_at_the_whole_heads_frequencies():
    d, base = 16, 1e6
    inv, factor = scaled_frequencies(d, base, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, 8)
    # int(0.25 * 16 // 2) = 2 pairs turn, at base**(-2i/16); the other 6 stand still; no factor on cos and sin.
    np.testing.assert_array_equal(inv, [1.0, base ** (-2 / 16), 0, 0, 0, 0, 0, 0])
    assert factor == 1.0
    # Not partial rotary (rope_dims=4): that pairs (i, i + 2) at base**(-2i/4); proportional pairs (i, i + 8).
    assert list(zip(*rotary_pairs("half", d), strict=True))[:2] == [(0, 8), (1, 9)]
    halved, _ = scaled_frequencies(d, base, {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2}, 8)
    np.testing.assert_array_equal(halved, np.r_[base ** (-np.arange(0, 8, 2) / 16) / 2, np.zeros(4)])
    stages = reference_mha(GLOBAL, init_params(GLOBAL), normal((1, 5, GLOBAL.d_model)), return_stages=True)[1]
    still = [i for i in range(16) if i % 8 >= 2]  # the features of the pairs that stand still
    np.testing.assert_array_equal(stages["k_rotated"][..., still], stages["k_normed"][..., still])


@pytest.mark.parametrize("name", ["torch-sdpa", "jax-dpa", "mlx-sdpa"])
def test_every_implementation_without_the_value_norm_refuses_it_by_name(name):
    """The kernels' oracles; every convention adapter applies it (tests/test_forms_adapters.py)."""
    assert VARIANT_REGISTRY["value_norm"].implemented_by == ("numpy", "torch", "jax", "mlx")
    assert "value_norm" not in BUILTIN_VARIANTS
    assert "k_eq_v" in BUILTIN_VARIANTS  # held by the tied parameters in every convention
    try:
        backend = get_backend(name)
    except Exception as error:  # a library missing here: the refusal is its own, not ours to prove
        pytest.skip(f"{name}: {error}")
    reason = backend.variant_reason(SLIDING, "standard")
    assert reason is not None and "value_norm" in reason, reason
    assert backend.variant_reason(MHAConfig(**dict(GEMMA4_GLOBAL, value_norm=False)), "standard") is None


def test_k_eq_v_agrees_in_the_conventions_through_the_tied_weight():
    cfg = MHAConfig(**dict(GEMMA4_GLOBAL, value_norm=False))
    params = init_params(cfg, seed=4)
    x = normal((2, 5, cfg.d_model), seed=3)
    want = reference_mha(cfg, params, x)
    np.testing.assert_allclose(get_backend("numpy").run(cfg, params, x, dtype="float64"), want, atol=1e-12)


# -- the real Gemma4TextAttention -------------------------------------------------------------------------------


def _real(cfg: MHAConfig, params: MHAParams, *, keep_float64: bool):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    from mha_rosetta.models import from_module, hf_gemma4, to_module
    from mha_rosetta.models._real import RunOptions

    options = RunOptions(implementation="sdpa", float64_rotary=keep_float64)
    module = to_module(cfg, params, hf_gemma4.build(cfg, options))
    if keep_float64:  # Gemma4RMSNorm's hidden_states.float(): the only float32 step left with the spec's tables

        def norm64(self, x):
            normed = self._norm(x)
            return normed * self.weight if self.with_scale else normed

        for norm in (module.q_norm, module.k_norm, module.v_norm):
            norm.forward = norm64.__get__(norm)
    return torch, module, options, from_module


@pytest.mark.parametrize("keep_float64", [True, False], ids=["float64", "as-shipped"])
@pytest.mark.parametrize(
    "kw",
    [dict(GEMMA4_SLIDING, value_norm=True, window=3), GEMMA4_GLOBAL, dict(GEMMA4_GLOBAL, attention_k_eq_v=False)],
    ids=["sliding", "global-k_eq_v", "global"],
)
def test_the_spec_is_the_real_gemma4_text_attention(kw, keep_float64):
    from mha_rosetta.models import hf_gemma4

    cfg = MHAConfig(**kw)
    params = init_params(cfg, seed=11)
    _, module, options, from_module = _real(cfg, params, keep_float64=keep_float64)
    read_cfg, read_params = from_module(module)
    assert read_cfg == cfg, (read_cfg.describe(), cfg.describe())
    for name, array in params.as_dict().items():  # exact both ways (with k_eq_v: w_v read back from k_proj)
        assert np.array_equal(array, getattr(read_params, name)) if array is not None else True, name
    assert (module.v_proj is None) == cfg.attention_k_eq_v
    x = normal((2, 6, cfg.d_model), seed=2)
    run = hf_gemma4.forward(module, cfg, x, None, options)
    want = reference_mha(cfg, params, x)
    error = float(np.max(np.abs(run.output - want)) / np.max(np.abs(want)))
    assert run.precision == "float32" and "Gemma4RMSNorm computes in float32" in run.note
    # Float64 with the norms kept float64 and the spec's tables: rounding only. As shipped: float32 norms and angles.
    assert error <= (1e-12 if keep_float64 else 1e-5), error
    if not keep_float64:
        assert error > 1e-12, "the float32 norm should show; if it no longer does, prove it in float64"


def test_the_real_modules_own_proportional_frequencies_are_the_specs():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    from mha_rosetta.models import hf_gemma4
    from mha_rosetta.models._real import RunOptions

    module = hf_gemma4.build(GLOBAL, RunOptions())
    rotary = hf_gemma4._modeling().Gemma4TextRotaryEmbedding(module.config)
    theirs = rotary.full_attention_inv_freq.double().numpy()  # float32 in the module
    ours, _ = scaled_frequencies(GLOBAL.d_k, GLOBAL.rope_base, GLOBAL.rope_scaling, 8)
    np.testing.assert_allclose(theirs, ours, rtol=1e-7, atol=0)
    assert torch.count_nonzero(rotary.full_attention_inv_freq) == 2


def test_the_reader_refuses_what_the_spec_cannot_hold_and_the_writer_stores_one_weight():
    pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    from mha_rosetta.models import LayoutError, get_layout, hf_gemma4
    from mha_rosetta.models._real import RunOptions

    layout = get_layout("hf-gemma4")
    state = layout.to_state_dict(GLOBAL, init_params(GLOBAL))
    assert "v_proj.weight" not in state and set(state) == {"q_proj.weight", "k_proj.weight", "o_proj.weight"} | {
        "q_norm.weight",
        "k_norm.weight",
    }
    reason = layout.unsupported_reason(MHAConfig(**dict(GEMMA4_GLOBAL, window=3)))
    assert reason is not None and "ties V to K on global layers only" in reason, reason
    assert "value_norm" in layout.unsupported_reason(MHAConfig(**dict(GEMMA4_SLIDING, window=3)))
    module = hf_gemma4.build(GLOBAL, RunOptions())
    module.is_kv_shared_layer = True
    with pytest.raises(LayoutError, match=r"reuses another layer's keys and values"):
        from mha_rosetta.models import from_module

        from_module(module)
