"""Mistral 4 against transformers' real ``Mistral4Attention`` (issue 45): ``from_module`` reads it, ``to_module``
loads it exactly, the layout's runner agrees with the spec held to float32 with the causes named (its latent norms
and its temperature's factors are float32), the module is proved in float64 once those two keep float64, and it
decodes token by token through its own cache (the temperature from position_ids) as the spec's causal forward.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, init_params, reference_mha
from mha_rosetta.core.variants.models import MISTRAL4_LIKE
from mha_rosetta.models import LayoutError, from_module, get_layout, to_module
from mha_rosetta.models._real import RunOptions
from mha_rosetta.models.hf_mistral4 import FAMILY, rotary_width

CFG = MHAConfig(**MISTRAL4_LIKE)  # YaRN over 3 tokens, the temperature's floor the same 3, beta 0.5
CASES = {
    "interleaved": MISTRAL4_LIKE,
    "half": dict(MISTRAL4_LIKE, rope_interleave=False),
    "no_q_lora_bias": dict(MISTRAL4_LIKE, q_lora_rank=None, bias=True),
}
LAYOUT = get_layout("hf-mistral4")


def _x(cfg, seed=1, tokens=7):
    return np.random.default_rng(seed).standard_normal((2, tokens, cfg.d_model))


def _transformers():
    return pytest.importorskip("transformers", reason="the real Mistral4Attention needs transformers (models extra)")


@pytest.mark.parametrize("case", CASES)
def test_the_state_dict_round_trips_exactly(case):
    cfg = MHAConfig(**CASES[case])
    params = init_params(cfg, seed=3)
    state = LAYOUT.to_state_dict(cfg, params)
    assert state["kv_b_proj.weight"].shape == (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    assert ("q_b_proj.weight" in state) == (cfg.q_lora_rank is not None) != ("q_proj.weight" in state)
    back = LAYOUT.from_state_dict(cfg, state)
    for key, value in params.as_dict().items():
        assert (value is None and getattr(back, key) is None) or np.array_equal(value, getattr(back, key)), key


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(attn_temperature_tuning=False), "always multiplies its queries by 1 + llama_4_scaling_beta"),
        (dict(floor_offset=1), "Mistral4Attention's temperature is Mistral 4: log(1 + floor(p / "),
        (dict(floor_scale=4), "floors by rope_parameters['original_max_position_embeddings'], the rope scaling's"),
        (dict(rope_scaling=None), "default tables ignore partial_rotary_factor"),
        (dict(qk_nope_head_dim=14, qk_rope_head_dim=30), "int(head_dim * partial_rotary_factor) = 29 features"),
        (dict(scale=0.25), "yarn_apply_mscale"),
        (dict(causal=False), "is a decoder layer"),
    ],
)
def test_the_layout_refuses_what_the_module_cannot_hold(change, words):
    reason = LAYOUT.unsupported_reason(MHAConfig(**dict(MISTRAL4_LIKE, **change)))
    assert reason is not None and words in reason, reason


def test_the_rotary_width_is_transformers_float_product():
    """Mistral4Config's partial_rotary_factor = rope / (nope + rope), times head_dim, truncated: 29 for 14 + 30."""
    assert rotary_width(4, 8) == 8 and rotary_width(64, 64) == 64  # the cases', Mistral Small 4's
    assert rotary_width(14, 30) == 29 and rotary_width(9, 58) == 57


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("case", CASES)
def test_the_real_module_agrees_with_the_oracle_held_to_float32_with_the_causes_named(case, implementation):
    _transformers()
    cfg = MHAConfig(**CASES[case])
    params = init_params(cfg, seed=3)
    x = _x(cfg)
    run = LAYOUT.runner(cfg, LAYOUT.to_state_dict(cfg, params), x, None, RunOptions(implementation=implementation))
    ref = reference_mha(cfg, params, x)
    assert run.precision == "float32"
    assert "latent RMSNorms" in run.note and "temperature's factors are float32" in run.note
    assert np.abs(run.output - ref).max() <= 1e-6 * np.abs(ref).max()
    assert np.abs(run.output - ref).max() > 1e-12 * np.abs(ref).max()  # float32 steps really are inside
    untempered = reference_mha(MHAConfig(**dict(CASES[case], attn_temperature_tuning=False)), params, x)
    assert np.abs(run.output - untempered).max() > 1e-2 * np.abs(ref).max()  # and the temperature really is


@pytest.mark.parametrize("case", ["interleaved", "half"])
def test_the_module_is_exact_in_float64_once_its_norms_and_factors_keep_float64(case, monkeypatch):
    torch = pytest.importorskip("torch")
    _transformers()
    modeling = FAMILY.modeling()

    def float64_norm(self, hidden):  # Mistral4RMSNorm without its cast to float32
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def float64_scale(positions_ids, beta, max_position_embeddings):  # get_llama_4_attn_scale in float64
        scaling = 1 + beta * torch.log(1 + torch.floor(positions_ids.double() / max_position_embeddings))
        return scaling[:, None, :, None]

    monkeypatch.setattr(modeling.Mistral4RMSNorm, "forward", float64_norm)
    monkeypatch.setattr(modeling, "get_llama_4_attn_scale", float64_scale)
    cfg = MHAConfig(**CASES[case])
    params = init_params(cfg, seed=4)
    x = _x(cfg, seed=2)
    options = RunOptions(implementation="sdpa", float64_rotary=True)
    run = LAYOUT.runner(cfg, LAYOUT.to_state_dict(cfg, params), x, None, options)
    np.testing.assert_allclose(run.output, reference_mha(cfg, params, x), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_from_module_reads_the_real_module_and_to_module_loads_it(case):
    _transformers()
    cfg = MHAConfig(**CASES[case])
    params = init_params(cfg, seed=5)
    module = to_module(cfg, params, FAMILY.build(cfg, RunOptions()))
    read_cfg, read_params = from_module(module)
    assert read_cfg == cfg  # the temperature (floor_offset 0, beta, the YaRN's original length), the scale, rope
    assert read_cfg.floor_offset == 0 and read_cfg.attn_scale == 0.5 and read_cfg.floor_scale == 3.0
    for key, value in params.as_dict().items():
        assert (value is None and getattr(read_params, key) is None) or np.array_equal(value, getattr(read_params, key))


def test_it_decodes_through_its_own_cache_with_the_temperature_from_position_ids():
    _transformers()
    from mha_rosetta.models.decode_steps import decode_steps

    params = init_params(CFG, seed=6)
    x = _x(CFG, seed=7, tokens=8)
    module = to_module(CFG, params, FAMILY.build(CFG, RunOptions()))
    steps = np.stack(decode_steps(module, x), axis=1)  # (2, 8, 27): one token a call, DynamicCache, eager
    expected = reference_mha(CFG, params, x)  # causal: row t is decode step t
    assert np.abs(steps - expected).max() <= 1e-6 * np.abs(expected).max()  # float32 norms, angles, factors
    # the steps at positions 3.. are tempered (floor(p / 3) >= 1): from position_ids, the cache offset included
    untempered = reference_mha(MHAConfig(**dict(MISTRAL4_LIKE, attn_temperature_tuning=False)), params, x)
    assert np.abs(steps[:, 3:] - untempered[:, 3:]).max() > 1e-2 * np.abs(expected).max()
    np.testing.assert_allclose(steps[:, :3], untempered[:, :3], rtol=1e-5, atol=1e-6)  # factor 1 before 3


def test_the_default_rope_type_cannot_run_and_from_module_says_why():
    """Mistral4RotaryEmbedding's default tables read head_dim = nope + rope and ignore partial_rotary_factor."""
    torch = pytest.importorskip("torch")
    transformers = _transformers()
    config = transformers.Mistral4Config(**FAMILY.config_kwargs(CFG))
    config.rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": 3,
        "partial_rotary_factor": config.rope_parameters["partial_rotary_factor"],
    }
    module = FAMILY.modeling().Mistral4Attention(config, layer_idx=0).double()
    rotary = FAMILY.modeling().Mistral4RotaryEmbedding(config)
    xt = torch.from_numpy(_x(CFG))
    cos, sin = rotary(xt, torch.arange(7)[None])
    assert cos.shape[-1] == CFG.d_k != CFG.qk_rope_head_dim  # 12 features for a rope part of 8
    with pytest.raises(RuntimeError):
        module(xt, position_embeddings=(cos, sin), attention_mask=None, position_ids=torch.arange(7)[None])
    with pytest.raises(LayoutError, match=r"rope_type 'default'.*do not fit the rope part"):
        from_module(module)
