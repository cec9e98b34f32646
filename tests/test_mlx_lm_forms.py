"""mlx-lm's attentions of the 2025-26 forms read by `from_module`: DeepSeek V3's latent attention
(``DeepseekV3Attention``) and Llama 4's (``llama4.Attention``, ``llama4_text.Attention``): each real module's own
forward, and its decode through mlx-lm's own ``KVCache``, is the spec of what was read; then Hugging Face's module
against it (`compare`).

The modules are mlx-lm's own, built tiny from their ModelArgs, random weights cast to float64, run on the CPU
stream: mlx's exp/sin/cos are float32-accurate there (`models._mlx_io.FLOAT64_NOTE`), so every run is held to
float32's tolerance, with that cause in the run's note.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, reference_mha, tolerance_for
from mha_rosetta.models import from_module, get_layout, to_module

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'mha-rosetta[mlx]'")

from mha_rosetta.models import mlx_deepseek
from mha_rosetta.models.decode_steps import decode_steps
from mha_rosetta.models.real_modules import run_module

TOL = tolerance_for("float32")
# DeepSeek V3's checkpoints: YaRN factor 40 with mscale = mscale_all_dim = 1 (here a tiny L)
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _mla(**fields) -> MHAConfig:
    """Latent attention, all sizes distinct: d_model 16, 2 heads, q rank 7, kv rank 6, nope 3 + rope 4, d_v 5."""
    sizes = dict(d_model=16, n_heads=2, q_lora_rank=7, kv_lora_rank=6, qk_nope_head_dim=3, qk_rope_head_dim=4)
    return MHAConfig(**{**sizes, "v_head_dim": 5, "causal": True, "rope_interleave": True, "norm_eps": 1e-6, **fields})


MLA_CASES = [
    _mla(),
    _mla(q_lora_rank=None, bias=True),
    _mla(rope_scaling=DEEPSEEK_YARN),
]


def _assert_float32(run_output, expected):
    np.testing.assert_allclose(run_output, expected, atol=TOL.atol, rtol=TOL.rtol)


def _assert_round_trips(build, cfg):
    """``to_module`` of what `from_module` read from ``build(cfg)``, read back: every parameter bit for bit."""
    cfg, params = from_module(build(cfg))
    back = from_module(to_module(cfg, params, build(cfg))).params
    for name, array in params.as_dict().items():
        if array is not None:
            assert np.array_equal(getattr(back, name), array), name


@pytest.mark.parametrize("cfg", MLA_CASES, ids=["q_lora", "no_q_lora_bias", "yarn"])
def test_deepseek_v3_module_is_the_spec_of_what_from_module_read(cfg):
    module = mlx_deepseek.build(cfg)
    spec = from_module(module)
    assert spec.cfg == cfg  # the ranks, the head sizes, the biases, the rotary, YaRN's mscale in the scale
    x = np.random.default_rng(5).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(module, x)
    assert run.precision == "float32" and "float32-accurate" in run.note
    _assert_float32(run.output, reference_mha(read_cfg, params, x))


@pytest.mark.parametrize("cfg", MLA_CASES[:2], ids=["q_lora", "no_q_lora_bias"])
def test_deepseek_v3_to_module_round_trips_exactly(cfg):
    _assert_round_trips(mlx_deepseek.build, cfg)


def test_deepseek_v3_multilinears_are_kv_b_proj_split_per_head():
    cfg = MLA_CASES[0]
    module = mlx_deepseek.build(cfg)
    params = from_module(module).params
    embed_q = np.array(module.embed_q.weight)  # (H, R, d_nope) = (2, 6, 3)
    unembed_out = np.array(module.unembed_out.weight)  # (H, d_v, R) = (2, 5, 6)
    assert embed_q.shape == (2, 6, 3) and unembed_out.shape == (2, 5, 6)
    # head 1's key rows of W_UK are embed_q[1] transposed; its value rows of W_UV are unembed_out[1]
    assert np.array_equal(params.w_k[3:6], embed_q[1].T) and np.array_equal(params.w_v[5:10], unembed_out[1])
    # the scale is the module's: (3 + 4)**-0.5
    assert from_module(module).cfg.scale == pytest.approx(7**-0.5, rel=1e-15)
    # with YaRN, m(40, 1)**2 on it, as Hugging Face's yarn_apply_mscale
    scaled = from_module(mlx_deepseek.build(MLA_CASES[2])).cfg.scale
    assert scaled == pytest.approx(7**-0.5 * (0.1 * np.log(40) + 1) ** 2, rel=1e-12)


def test_deepseek_v3_decodes_through_its_latent_cache():
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache

    cfg = MLA_CASES[2]
    module = mlx_deepseek.build(cfg)
    x = np.random.default_rng(6).standard_normal((2, 7, cfg.d_model))
    _, read_cfg, params = run_module(module, x)
    expected = reference_mha(read_cfg, params, x)  # (2, 7, 16): causal, so row t is decode step t
    steps = np.stack(decode_steps(module, x), axis=1)  # one token a call: the absorbed form
    _assert_float32(steps, expected)
    cache = KVCache()
    with mx.stream(mx.cpu):
        h = mx.array(x[:, :3], dtype=mx.float64)
        mx.eval(module(h, mask=create_attention_mask(h, None, return_array=True), cache=cache))
        latent, k_pe = cache.keys_and_values()  # the first offset positions of the grown buffers
    # the cache holds the latent (R = 6 numbers) and the rotated shared key (4), one "head", not H*(d_nope+d_v)
    assert tuple(latent.shape) == (2, 1, 3, 6) and tuple(k_pe.shape) == (2, 1, 3, 4)


def test_deepseek_v3_refuses_rotate_half():
    reasons = [rule(_mla(rope_interleave=False)) for rule in get_layout("mlx-deepseek-v3").rules]
    assert any(reason and "always rotates adjacent pairs" in reason for reason in reasons)


def _hf(build, cfg):
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'mha-rosetta[models]'")
    from mha_rosetta.models._real import RunOptions

    return build(cfg, RunOptions())


@pytest.mark.parametrize("cfg", [MLA_CASES[0], MLA_CASES[2]], ids=["plain", "yarn"])
def test_hf_deepseek_v3_against_mlx_lm_agrees_forward_and_decode(cfg):
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models.hf_deepseek import V3

    hf = _hf(V3.build, cfg)
    port = mlx_deepseek.build(from_module(hf).cfg)
    result = compare(hf, port, decode=True)  # HF's DynamicCache against mlx-lm's latent KVCache
    assert result.differences == [] and result.agrees and result.first_decode_step is None


# -- Llama 4 ---------------------------------------------------------------------------------------------------------
def _l4(**fields) -> MHAConfig:
    """d_model 16, 4 heads of 6 (2 kv heads), causal; rotary interleaved unless ``fields`` say otherwise."""
    base = dict(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, causal=True, rope="interleaved")
    return MHAConfig(**{**base, **fields})


L4_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
L4_CASES = [
    _l4(attention_chunk_size=3, qk_norm_after_rope=True),  # 7 tokens: chunks {0,1,2} {3,4,5} {6}
    _l4(d_k=8, attention_chunk_size=4, rope_scaling=L4_LLAMA3, bias=True),
    # NoPE with the temperature: floor_scale 2, so the factor grows within the 7 tokens (1, 1.35, 1.35, 1.55...)
    _l4(rope=None, attn_temperature_tuning=True, floor_scale=2.0, attn_scale=0.5),
    _l4(rope=None),
]
L4_IDS = ["chunked_norm", "llama3_bias", "nope_temperature", "nope"]


@pytest.mark.parametrize("cfg", L4_CASES, ids=L4_IDS)
def test_llama4_module_is_the_spec_of_what_from_module_read(cfg):
    from mha_rosetta.models import mlx_llama4

    module = mlx_llama4.build(cfg)
    assert from_module(module).cfg == cfg  # the kind, the chunk (from the args), the norm, the temperature
    x = np.random.default_rng(7).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(module, x)
    assert run.precision == "float32" and "float32-accurate" in run.note
    _assert_float32(run.output, reference_mha(read_cfg, params, x))
    steps = np.stack(decode_steps(module, x[:, :3]), axis=1)  # within one chunk: mlx-lm's KVCache, cache.offset
    _assert_float32(steps, reference_mha(read_cfg, params, x[:, :3]))


@pytest.mark.parametrize("cfg", L4_CASES[::2], ids=L4_IDS[::2])
def test_llama4_to_module_round_trips_exactly(cfg):
    from mha_rosetta.models import mlx_llama4

    _assert_round_trips(mlx_llama4.build, cfg)


def test_llama4_mlx_lm_choices_layer_index_norm_eps_and_the_model_chunk():
    from mlx_lm.models.llama4 import Attention

    from mha_rosetta.models import LayoutError, mlx_llama4

    module = mlx_llama4.build(_l4(attention_chunk_size=3, qk_norm_after_rope=True, norm_eps=1e-5))
    # rms_norm_eps 1e-5 in its args, 1e-6 in its call (mx.fast.rms_norm(..., eps=1e-6)): the module's is read
    assert module.args.rms_norm_eps == 1e-5 and from_module(module).cfg.norm_eps == 1e-6
    # every fourth layer is NoPE, by its index (Hugging Face reads no_rope_layers)
    kinds = [bool(Attention(module.args, i).use_rope) for i in range(8)]
    assert kinds == [True, True, True, False, True, True, True, False]
    # the chunk is the model's: without the model args, refused with the reason
    module.args = None
    with pytest.raises(LayoutError, match=r"llama4\.Attention has no model args.*attention_chunk_size"):
        from_module(module)


def test_llama4_chunk_mask_is_the_models():
    from mha_rosetta.models import mlx_llama4

    module = mlx_llama4.build(L4_CASES[0])
    mask = mlx_llama4.model_mask(module, L4_CASES[0], 7)
    assert mask[5].tolist() == [False, False, False, True, True, True, False]  # row 5: keys 3-5, its chunk
    assert mask[6].tolist() == [False] * 6 + [True]  # row 6 opens the third chunk
    assert mlx_llama4.model_mask(mlx_llama4.build(L4_CASES[3]), L4_CASES[3], 7) is None  # NoPE: causal


@pytest.mark.parametrize(
    ("cfg", "decode"),
    [
        (L4_CASES[0], False),
        (_l4(attention_chunk_size=8, qk_norm_after_rope=True), True),
        (L4_CASES[2], True),
        (L4_CASES[0], True),  # chunks {0,1,2} {3,4,5} {6,...}: steps 3 and 6 open a chunk, 9 tokens
        (L4_CASES[1], True),  # llama3-scaled, biased, chunk 4: steps 4 and 8
    ],
    ids=["chunked", "rotary_decode", "nope_temperature_decode", "chunk_boundary_decode", "llama3_boundary_decode"],
)
def test_hf_llama4_against_mlx_lm_agrees(cfg, decode):
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models import hf_llama4, mlx_llama4

    hf = _hf(hf_llama4.build, cfg)
    port = mlx_llama4.build(from_module(hf).cfg)
    x = np.random.default_rng(12).standard_normal((2, 9, cfg.d_model))
    # decode: Hugging Face's DynamicSlidingWindowLayer with create_chunked_causal_mask (rotary layers) or its
    # DynamicLayer with the temperature at the cache's length (NoPE layers), against mlx-lm's ChunkedKVCache with
    # LlamaModel's chunk mask, or its KVCache with the temperature at cache.offset
    result = compare(hf, port, x=x, decode=decode)
    assert result.differences == [] and result.agrees and result.first_decode_step is None
    assert len(result.decode_steps) == (9 if decode else 0)


def test_llama4_decode_through_the_chunked_cache_is_the_spec_across_boundaries():
    from mha_rosetta.models import mlx_llama4

    module = mlx_llama4.build(L4_CASES[0])  # chunk 3
    x = np.random.default_rng(13).standard_normal((2, 8, 16))
    _, read_cfg, params = run_module(module, x)
    steps = np.stack(decode_steps(module, x), axis=1)  # ChunkedKVCache(3), trimmed, LlamaModel's chunk mask
    _assert_float32(steps, reference_mha(read_cfg, params, x))
    # the plain KVCache without the mask (what decode_steps stepped before) attends across the boundary: step 3
    from mha_rosetta.models.decode_steps import _mlx_steps, _plain_mlx_cache

    plain = np.stack(_mlx_steps(module, x, *_plain_mlx_cache()), axis=1)
    assert np.allclose(plain[:, :3], steps[:, :3], atol=1e-6) and not np.allclose(plain[:, 3], steps[:, 3], atol=1e-3)


def test_a_port_with_another_chunk_is_named_with_the_first_decode_step_that_differs():
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models import hf_llama4, mlx_llama4

    hf = _hf(hf_llama4.build, L4_CASES[0])  # chunk 3
    port = mlx_llama4.build(_l4(attention_chunk_size=4, qk_norm_after_rope=True))  # the chunk off by one
    result = compare(hf, port, x=np.random.default_rng(14).standard_normal((2, 8, 16)), decode=True)
    assert [(d.name, d.a, d.b) for d in result.differences] == [("attention_chunk_size", 3, 4)]
    # steps 0-2 are the first chunk in both; step 3 opens Hugging Face's second chunk, mlx-lm's still holds 0-3
    assert not result.agrees and result.first_decode_step == 3


def test_hf_llama4_norm_eps_against_mlx_lm_is_named():
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models import hf_llama4, mlx_llama4

    cfg = _l4(attention_chunk_size=3, qk_norm_after_rope=True, norm_eps=1e-5)
    result = compare(_hf(hf_llama4.build, cfg), mlx_llama4.build(cfg))
    assert [(d.name, d.a, d.b) for d in result.differences] == [("norm_eps", 1e-5, 1e-6)]


# -- Qwen3-Next ------------------------------------------------------------------------------------------------------
def _q3n(**fields) -> MHAConfig:
    """d_model 16, 4 heads of 6 (2 kv heads), rotate-half on the first 2 features, QK-norm per head, the gate."""
    base = dict(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, causal=True, rope="half", rope_dims=2)
    return MHAConfig(**{**base, "qk_norm": "head", "attn_output_gate": True, **fields})


Q3N_CASES = [_q3n(), _q3n(bias=True, rope_dims=4, n_kv_heads=1)]


def _q3n_module(cfg):
    """mlx-lm's Qwen3NextAttention for ``cfg``, its norms given random weights (nn.RMSNorm starts at ones)."""
    import mlx.core as mx

    from mha_rosetta.models.mlx_lm import FAMILIES

    module = FAMILIES["mlx-qwen3-next"].build(cfg)
    rng = np.random.default_rng(8)
    for norm in (module.q_norm, module.k_norm):
        norm.weight = mx.array(1 + 0.3 * rng.standard_normal(cfg.d_k), dtype=mx.float64)
    return module


@pytest.mark.parametrize("cfg", Q3N_CASES, ids=["gqa", "bias_mqa"])
def test_qwen3_next_module_is_the_spec_of_what_from_module_read(cfg):
    module = _q3n_module(cfg)
    assert from_module(module).cfg == cfg
    x = np.random.default_rng(9).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(module, x)
    assert run.precision == "float32" and "float32-accurate" in run.note
    _assert_float32(run.output, reference_mha(read_cfg, params, x))
    back = from_module(to_module(read_cfg, params, _q3n_module(cfg))).params  # round trip, exactly
    for name, array in params.as_dict().items():
        if array is not None:
            assert np.array_equal(getattr(back, name), array), name


def test_qwen3_next_gate_rows_per_head_and_norm_stored_whole():
    cfg = Q3N_CASES[1]
    module = _q3n_module(cfg)
    params = from_module(module).params
    fused = np.array(module.q_proj.weight)  # (H*2*d, E) = (48, 16): head h's rows [q_h | gate_h]
    assert np.array_equal(fused[6:12], params.w_gate[0:6]) and np.array_equal(fused[12:18], params.w_q[6:12])
    assert np.array_equal(np.array(module.q_proj.bias)[18:24], params.b_gate[6:12])
    # mlx-lm's nn.RMSNorm multiplies by its weight (sanitize adds 1 to Hugging Face's w): stored = canonical
    assert np.array_equal(params.q_norm, np.array(module.q_norm.weight))


def test_hf_qwen3_next_against_mlx_lm_agrees_and_stores_the_norm_plus_one():
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models.hf_qwen3_next import _DECODER

    cfg = Q3N_CASES[0]
    hf = _hf(_DECODER.build, cfg)
    import torch

    with torch.no_grad():
        hf.q_norm.weight.normal_(0, 0.3)  # Hugging Face's stored w, for 1 + w
    port = _q3n_module(from_module(hf).cfg)
    # decode: Hugging Face's DynamicCache (the one layer is full attention: layer_types) against mlx-lm's KVCache,
    # each rotating at its own offset, the gate and the norms on every step
    result = compare(hf, port, decode=True)
    assert result.differences == [] and result.agrees
    assert len(result.decode_steps) == 7 and result.first_decode_step is None
    loaded = np.array(to_module(*from_module(hf), port).q_norm.weight)
    np.testing.assert_array_equal(loaded, hf.q_norm.weight.detach().numpy() + 1.0)


def test_qwen3_next_decodes_through_its_kv_cache():
    cfg = Q3N_CASES[0]
    module = _q3n_module(cfg)
    x = np.random.default_rng(10).standard_normal((2, 7, cfg.d_model))
    _, read_cfg, params = run_module(module, x)
    steps = np.stack(decode_steps(module, x), axis=1)  # mlx-lm's KVCache, its rope at cache.offset
    _assert_float32(steps, reference_mha(read_cfg, params, x))


# -- Llama 4, text only (llama4_text.Attention) ----------------------------------------------------------------------
# A rotary layer normed (eps rms_norm_eps, before rotary in mlx-lm: read as after, the same numbers), a plain rotary
# layer, a NoPE layer normed (read as qk_norm="head", unit weights) and a plain NoPE layer
L4T_CASES = [
    _l4(qk_norm_after_rope=True, norm_eps=1e-5),
    _l4(),
    _l4(rope=None, qk_norm="head", norm_eps=1e-5),
    _l4(rope=None),
]
L4T_IDS = ["rotary_norm", "rotary", "nope_norm", "nope"]


@pytest.mark.parametrize("cfg", L4T_CASES, ids=L4T_IDS)
def test_llama4_text_module_is_the_spec_of_what_from_module_read(cfg):
    from mha_rosetta.models import mlx_llama4_text

    module = mlx_llama4_text.build(cfg)
    spec = from_module(module)
    assert spec.cfg == cfg  # the kind (use_rope), the norm and its eps (rms_norm_eps), no chunk, no temperature
    if cfg.qk_norm == "head":  # the weightless norm: unit weights
        assert np.array_equal(spec.params.q_norm, np.ones(6)) and np.array_equal(spec.params.k_norm, np.ones(6))
    x = np.random.default_rng(7).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(module, x)
    assert run.precision == "float32" and "float32-accurate" in run.note
    _assert_float32(run.output, reference_mha(read_cfg, params, x))
    if cfg.qk_norm_after_rope or cfg.qk_norm:  # the norm read changes the output: without it, not the module's
        bare = replace(read_cfg, qk_norm_after_rope=False, qk_norm=None)
        assert not np.allclose(run.output, reference_mha(bare, replace(params, q_norm=None, k_norm=None), x), atol=1e-3)
    steps = np.stack(decode_steps(module, x), axis=1)  # mlx-lm's KVCache, no mask (create_attention_mask: None)
    _assert_float32(steps, reference_mha(read_cfg, params, x))


@pytest.mark.parametrize("cfg", L4T_CASES[::2], ids=L4T_IDS[::2])
def test_llama4_text_to_module_round_trips_exactly(cfg):
    from mha_rosetta.models import mlx_llama4_text

    _assert_round_trips(mlx_llama4_text.build, cfg)


def test_llama4_text_reads_no_rope_layers_and_refuses_a_weighted_norm():
    from mlx_lm.models.llama4_text import Attention

    from mha_rosetta.models import LayoutError, mlx_llama4_text

    module = mlx_llama4_text.build(L4T_CASES[2])
    # the layer kind is the model args' no_rope_layers[i] (not llama4.Attention's layer index)
    kinds = [from_module(Attention(module.args, flag)).cfg.rope for flag in (1, 0, 0, 1)]
    assert kinds == ["interleaved", None, None, "interleaved"]
    cfg, params = from_module(module)
    with pytest.raises(LayoutError, match=r"cannot hold q_norm: its QK-norm is weightless.*from 0\.5 to 0\.5"):
        to_module(cfg, replace(params, q_norm=np.full(6, 0.5)), mlx_llama4_text.build(cfg))
    layout = get_layout("mlx-llama4-text")
    # no chunk, no temperature (the model's mask is plain causal); the norm per head only where no rotary follows
    assert "switches on chunked: mlx_lm.models.llama4_text.Attention does not" in layout.unsupported_reason(
        _l4(attention_chunk_size=3)
    )
    assert "temperature" in layout.unsupported_reason(L4_CASES[2])
    assert "read as qk_norm_after_rope on rotary layers" in layout.unsupported_reason(_l4(qk_norm="head"))


@pytest.mark.parametrize("cfg", [L4T_CASES[0], L4T_CASES[3]], ids=["rotary_norm", "nope"])
def test_hf_llama4_text_without_chunk_or_temperature_agrees_with_mlx_lm(cfg):
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models import hf_llama4, mlx_llama4_text

    hf = _hf(hf_llama4.build, cfg)  # Llama4TextConfig(attention_chunk_size=None, attn_temperature_tuning=False)
    port = mlx_llama4_text.build(from_module(hf).cfg)
    # decode: Hugging Face's DynamicCache against mlx-lm's KVCache, 9 tokens
    result = compare(hf, port, x=np.random.default_rng(15).standard_normal((2, 9, 16)), decode=True)
    assert result.differences == [] and result.agrees and result.first_decode_step is None
    assert len(result.decode_steps) == 9


def test_hf_llama4_chunk_and_temperature_against_mlx_lm_text_are_named():
    from mha_rosetta.diagnose.compare import compare
    from mha_rosetta.models import hf_llama4, mlx_llama4_text

    x = np.random.default_rng(16).standard_normal((2, 7, 16))
    # a rotary layer: Hugging Face chunks it (chunk 3), mlx-lm's llama4_text model gives it the plain causal mask
    hf = _hf(hf_llama4.build, _l4(attention_chunk_size=3, qk_norm_after_rope=True, norm_eps=1e-5))
    result = compare(hf, mlx_llama4_text.build(L4T_CASES[0]), x=x, decode=True)
    assert [(d.name, d.a, d.b) for d in result.differences] == [("attention_chunk_size", 3, None)]
    assert not result.agrees and result.first_decode_step == 3  # step 3 opens Hugging Face's second chunk
    # a NoPE layer: Hugging Face tempers its queries, mlx-lm's llama4_text has no temperature
    hf = _hf(hf_llama4.build, L4_CASES[2])
    result = compare(hf, mlx_llama4_text.build(L4T_CASES[3]), x=x)
    assert "attn_temperature_tuning" in [d.name for d in result.differences] and not result.agrees
    # a NoPE layer with use_qk_norm: mlx-lm norms it, Hugging Face does not (rotary layers only); B holds a norm A lacks
    with pytest.raises(ValueError, match=r"B cannot hold A's parameters.*qk_norm"):
        compare(_hf(hf_llama4.build, L4T_CASES[3]), mlx_llama4_text.build(L4T_CASES[2]))
