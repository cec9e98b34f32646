"""MLA against transformers' real modules: ``DeepseekV2Attention`` and ``DeepseekV3Attention`` read by
``from_module``, loaded by ``to_module``, run by the layouts' runners (held to float32: their latent RMSNorms,
V2's complex64 rotary), and V3 proved in float64 with its norms patched to keep float64 (SDPA, the spec's tables).
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, init_params, reference_mha
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE
from mha_rosetta.models import from_module, get_layout, to_module
from mha_rosetta.models._real import RunOptions

CASES = {
    "v3": ("hf-deepseek-v3", DEEPSEEK_V3_LIKE),
    "v3_half": ("hf-deepseek-v3", dict(DEEPSEEK_V3_LIKE, rope_interleave=False)),
    "v2_lite": ("hf-deepseek-v2", DEEPSEEK_V2_LITE_LIKE),
    "v2_q_lora_yarn": ("hf-deepseek-v2", DEEPSEEK_V3_LIKE),
}


def _x(cfg, seed=1):
    return np.random.default_rng(seed).standard_normal((2, 7, cfg.d_model))


@pytest.mark.parametrize("case", CASES)
def test_the_state_dict_round_trips_exactly_with_kv_b_proj_fused_per_head(case):
    name, fields = CASES[case]
    cfg = MHAConfig(**fields)
    params = init_params(cfg, seed=3)
    layout = get_layout(name)
    state = layout.to_state_dict(cfg, params)
    assert state["kv_b_proj.weight"].shape == (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    dn = cfg.qk_nope_head_dim
    np.testing.assert_array_equal(state["kv_b_proj.weight"][dn + cfg.v_head_dim :][:dn], params.w_k[dn : 2 * dn])
    assert ("q_b_proj.weight" in state) == (cfg.q_lora_rank is not None) != ("q_proj.weight" in state)
    assert ("o_proj.bias" in state) == ("kv_a_proj_with_mqa.bias" in state) == bool(cfg.bias)
    back = layout.from_state_dict(cfg, state)
    for key, value in params.as_dict().items():
        assert (value is None and getattr(back, key) is None) or np.array_equal(value, getattr(back, key)), key


def test_the_layouts_refuse_what_the_modules_cannot_hold():
    v2 = get_layout("hf-deepseek-v2")
    assert "always rotates adjacent pairs" in v2.unsupported_reason(
        MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_interleave=False))
    )
    assert "is a decoder layer" in v2.unsupported_reason(MHAConfig(**dict(DEEPSEEK_V2_LITE_LIKE, causal=False)))
    assert "needs kv_lora_rank" in v2.unsupported_reason(MHAConfig(d_model=12, n_heads=3, causal=True))
    reason = get_layout("hf-deepseek-v3").unsupported_reason(MHAConfig(**dict(DEEPSEEK_V3_LIKE, scale=0.25)))
    assert "yarn_apply_mscale" in reason


@pytest.mark.parametrize("name", ["hf-deepseek-v2", "hf-deepseek-v3", "mlx-deepseek-v3"])
def test_every_deepseek_reader_holds_the_latent_rules_of_hf_deepseek(name):
    """Hugging Face's and mlx-lm's readers share the latent's rules (`hf_deepseek.latent_only`, `latent_norm_eps`,
    `latent_scale`): the same refusals, and the spec's default scale (YaRN's mscale here) accepted when spelled out."""
    layout = get_layout(name)
    fields = dict(DEEPSEEK_V3_LIKE, rope_interleave=True)
    default = MHAConfig(**fields).scale
    assert layout.unsupported_reason(MHAConfig(**dict(fields, scale=default))) is None
    plain = MHAConfig(d_model=12, n_heads=3, causal=True)
    assert layout.unsupported_reason(plain) == f"{layout.module} is latent attention: it needs kv_lora_rank"
    eps = MHAConfig(**dict(fields, norm_eps=1e-5))
    assert layout.unsupported_reason(eps) == "MHAConfig.norm_eps=1e-05: its latent norms use 1e-6"
    assert layout.unsupported_reason(MHAConfig(**dict(fields, scale=default * 1.01))).startswith(
        f"MHAConfig.scale={default * 1.01!r}: {layout.module} scales by"
    )


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("case", CASES)
def test_the_real_modules_agree_with_the_oracle_held_to_float32_with_the_causes_named(case, implementation):
    pytest.importorskip("transformers", reason="the real DeepSeek modules need transformers (the models extra)")
    name, fields = CASES[case]
    cfg = MHAConfig(**fields)
    params = init_params(cfg, seed=3)
    x = _x(cfg)
    layout = get_layout(name)
    run = layout.runner(cfg, layout.to_state_dict(cfg, params), x, None, RunOptions(implementation=implementation))
    ref = reference_mha(cfg, params, x)
    assert run.precision == "float32" and "latent RMSNorms" in run.note
    assert ("complex64" in run.note) == (name == "hf-deepseek-v2")
    # Measured here: 5e-8 to 9e-8 of the output's largest entry (float32 norms and rotary inside float64).
    assert np.abs(run.output - ref).max() <= 1e-6 * np.abs(ref).max()
    assert np.abs(run.output - ref).max() > 1e-12 * np.abs(ref).max()  # float32 steps really are inside


@pytest.mark.parametrize("case", ["v3", "v3_half"])
def test_v3_is_exact_in_float64_once_its_norms_keep_float64(case, monkeypatch):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

    def float64_norm(self, hidden):  # DeepseekV3RMSNorm without its cast to float32
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(modeling.DeepseekV3RMSNorm, "forward", float64_norm)
    name, fields = CASES[case]
    cfg = MHAConfig(**fields)
    params = init_params(cfg, seed=4)
    x = _x(cfg, seed=2)
    layout = get_layout(name)
    options = RunOptions(implementation="sdpa", float64_rotary=True)
    run = layout.runner(cfg, layout.to_state_dict(cfg, params), x, None, options)
    np.testing.assert_allclose(run.output, reference_mha(cfg, params, x), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_from_module_reads_the_real_module_and_to_module_loads_it(case):
    pytest.importorskip("transformers", reason="the real DeepSeek modules need transformers (the models extra)")
    name, fields = CASES[case]
    cfg = MHAConfig(**fields)
    params = init_params(cfg, seed=5)
    module = to_module(cfg, params, _built(name, cfg))
    read_cfg, read_params = from_module(module)
    assert read_cfg == cfg
    for key, value in params.as_dict().items():
        assert (value is None and getattr(read_params, key) is None) or np.array_equal(value, getattr(read_params, key))


def _built(name, cfg):
    from mha_rosetta.models import hf_deepseek

    family = hf_deepseek.V2 if name == "hf-deepseek-v2" else hf_deepseek.V3
    return family.build(cfg, RunOptions())


def test_v3_caches_the_normalised_latent_and_its_rotated_key_de_interleaved():
    """transformers 5.25's cache holds kv_a_layernorm(c) and k_rot; V3's interleaved k_rot is [evens | odds]."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mha_rosetta.models import hf_deepseek

    cfg = MHAConfig(**DEEPSEEK_V3_LIKE)
    params = init_params(cfg, seed=6)
    x = _x(cfg)
    module = to_module(cfg, params, hf_deepseek.V3.build(cfg, RunOptions()))
    rotary = hf_deepseek.V3.modeling().DeepseekV3RotaryEmbedding(module.config).to(torch.float64)
    xt = torch.from_numpy(x)
    cache = transformers.DynamicCache(config=module.config)
    with torch.no_grad():
        module(xt, position_embeddings=rotary(xt, torch.arange(7)[None]), attention_mask=None, cache=cache)
    latent, k_rot = (t[:, 0].numpy() for t in (cache.layers[0].keys, cache.layers[0].values))
    stages = reference_mha(cfg, params, x, return_stages=True)[1]
    np.testing.assert_allclose(latent, stages["kv_latent"], rtol=1e-6, atol=1e-6)
    de_interleaved = np.concatenate([stages["k_rope"][..., 0::2], stages["k_rope"][..., 1::2]], axis=-1)
    np.testing.assert_allclose(k_rot, de_interleaved, rtol=1e-6, atol=1e-6)
    assert np.abs(k_rot - stages["k_rope"]).max() > 1e-3  # the permutation is real
