"""`from_module` / `to_module` on real attention modules: what each instance computes, read into the spec.

Every module is built tiny from its library's config object or constructor (nothing is downloaded), in
float64, with sizes and switches that differ from the defaults (a rotary base of 500, partial rotary,
grouped kv heads, kdim/vdim), so that a reader that took a default instead of the instance's own value
fails. For each class:

* the module's own output equals ``reference_mha`` of what `from_module` returns, on causal (or padded)
  inputs. Hugging Face's rotary families run with the tables of their own rotary module, built from the
  module's config: those compute the angles in float32 even in a float64 model (and the shared eager
  attention runs its softmax in float32), so those runs are held to the float32 row of the tolerance
  table; the same module on SDPA fed float64 (cos, sin) is held to float64, which shows that nothing
  else differs (Falcon's own eager path, before transformers 5.25, kept float64 too). Keras on JAX runs the default call through
  ``jax.nn.dot_product_attention``, whose softmax is float32; its ``return_attention_scores=True`` einsum
  path keeps float64 and is the one held to float64 here;
* ``to_module`` of other parameters, read back, gives those parameters exactly, and ``to_module`` of the
  first ones restores the module's own tensors bit for bit;
* every setting the spec cannot express raises `LayoutError` naming the class, the setting and why.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras (no TensorFlow here)

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha
from mha_rosetta.models import MODULE_LAYOUTS, LayoutError, ModuleSpec, from_module, to_module
from mha_rosetta.models.real_modules import allowed_mask, libraries_missing, run_module

BATCH, TOKENS = 2, 7
PADDING = np.ones((BATCH, TOKENS), dtype=bool)
PADDING[1, 5:] = False  # right padding: every row keeps a key, causal or not


def _need(*modules):
    reason = libraries_missing(modules)
    if reason:
        pytest.skip(reason)


def _x(width: int, tokens: int = TOKENS, seed: int = 11) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((BATCH, tokens, width))


def _same(a, b) -> bool:
    return all(
        (u is None and v is None) or (u is not None and v is not None and np.array_equal(u, v))
        for u, v in zip(a.as_dict().values(), b.as_dict().values(), strict=True)
    )


# --- Hugging Face modules, built from their config objects ---------------------------------------


def _hf(name: str):
    _need("torch", "transformers")
    import transformers

    def build(config_class, module_path, class_name, config_kwargs, **module_kwargs):
        import importlib

        config = getattr(transformers, config_class)(**config_kwargs)
        config._attn_implementation = "eager"
        module_class = getattr(importlib.import_module(module_path), class_name)
        return module_class(config, **module_kwargs).double().eval()

    m = "transformers.models."
    builders = {
        "gpt2": lambda: build(
            "GPT2Config", m + "gpt2.modeling_gpt2", "GPT2Attention", {"n_embd": 15, "n_head": 3}, layer_idx=0
        ),
        "bert": lambda: build(
            "BertConfig",
            m + "bert.modeling_bert",
            "BertAttention",
            {"hidden_size": 15, "num_attention_heads": 3, "attention_probs_dropout_prob": 0.0},
        ),
        "llama": lambda: build(
            "LlamaConfig",
            m + "llama.modeling_llama",
            "LlamaAttention",
            {
                "hidden_size": 16,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 6,
                "attention_bias": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
            },
            layer_idx=0,
        ),
        "gpt-neox": lambda: build(
            "GPTNeoXConfig",
            m + "gpt_neox.modeling_gpt_neox",
            "GPTNeoXAttention",
            {
                "hidden_size": 24,
                "num_attention_heads": 3,
                "rope_parameters": {"rope_type": "default", "rope_theta": 2000.0, "partial_rotary_factor": 0.5},
            },
            layer_idx=0,
        ),
        "t5": lambda: build(
            "T5Config",
            m + "t5.modeling_t5",
            "T5Attention",
            {"d_model": 15, "d_kv": 4, "num_heads": 3, "dropout_rate": 0.0},
            has_relative_attention_bias=False,
        ),
        "t5-decoder": lambda: build(
            "T5Config",
            m + "t5.modeling_t5",
            "T5Attention",
            {"d_model": 15, "d_kv": 4, "num_heads": 3, "dropout_rate": 0.0, "is_decoder": True},
            has_relative_attention_bias=False,
            is_causal=True,
        ),
        "phi3": lambda: build(
            "Phi3Config",
            m + "phi3.modeling_phi3",
            "Phi3Attention",
            {
                "hidden_size": 16,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 2 / 3},
            },
            layer_idx=0,
        ),
        **{
            f"falcon-{label}": (
                lambda switches=switches: build(
                    "FalconConfig",
                    m + "falcon.modeling_falcon",
                    "FalconAttention",
                    {
                        "hidden_size": 24,
                        "num_attention_heads": 6,
                        "bias": True,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
                        **switches,
                    },
                    layer_idx=0,
                )
            )
            for label, switches in {
                "new-arch": {"new_decoder_architecture": True, "num_kv_heads": 2},
                "new-arch-mqa": {"new_decoder_architecture": True, "num_kv_heads": 1},
                "multi-query": {"multi_query": True},
                "per-head": {"multi_query": False},
            }.items()
        },
    }
    decoder = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6}
    base_500 = {"rope_type": "default", "rope_theta": 500.0}
    yarn = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 4,
            "beta_fast": 8.0, "beta_slow": 1.0}  # fmt: skip
    two_layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    builders |= {
        "qwen2": lambda: build(
            "Qwen2Config", m + "qwen2.modeling_qwen2", "Qwen2Attention",
            {**decoder, "rope_parameters": base_500}, layer_idx=0,
        ),
        "mistral": lambda: build(
            "MistralConfig", m + "mistral.modeling_mistral", "MistralAttention",
            {**decoder, "rope_parameters": base_500, "sliding_window": 3}, layer_idx=0,
        ),
        "qwen3": lambda: build(
            "Qwen3Config", m + "qwen3.modeling_qwen3", "Qwen3Attention",
            {**decoder, "rope_parameters": base_500, "rms_norm_eps": 1e-5, "attention_bias": True}, layer_idx=0,
        ),
        "olmo2": lambda: build(
            "Olmo2Config", m + "olmo2.modeling_olmo2", "Olmo2Attention",
            {**decoder, "rope_parameters": base_500, "rms_norm_eps": 1e-5}, layer_idx=0,
        ),
        **{
            f"gemma2-{kind}": (
                lambda layer=layer: build(
                    "Gemma2Config", m + "gemma2.modeling_gemma2", "Gemma2Attention",
                    {**decoder, **two_layers, "rope_parameters": base_500, "query_pre_attn_scalar": 16,
                     "attn_logit_softcapping": 2.0},
                    layer_idx=layer,
                )
            )
            for kind, layer in (("sliding", 0), ("global", 1))
        },
        **{
            f"gemma3-{kind}": (
                lambda layer=layer: build(
                    "Gemma3TextConfig", m + "gemma3.modeling_gemma3", "Gemma3Attention",
                    {**decoder, **two_layers, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-5,
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 5000.0}}},
                    layer_idx=layer,
                )
            )
            for kind, layer in (("sliding", 0), ("global", 1))
        },
        "gpt-oss": lambda: build(
            "GptOssConfig", m + "gpt_oss.modeling_gpt_oss", "GptOssAttention",
            {**decoder, **two_layers, "rope_parameters": yarn, "num_local_experts": 2, "num_experts_per_tok": 1},
            layer_idx=0,
        ),
        "llama3": lambda: build(
            "LlamaConfig", m + "llama.modeling_llama", "LlamaAttention",
            {**decoder, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 4}},
            layer_idx=0,
        ),
        "phi3-window": lambda: build(
            "Phi3Config", m + "phi3.modeling_phi3", "Phi3Attention",
            {**decoder, "rope_parameters": base_500, "sliding_window": 4}, layer_idx=0,
        ),
        # Phi-3's 128k rotary on 2 pairs (head_dim = hidden_size // heads, as Phi3Config checks the tables), no factor
        # given (transformers: max_position_embeddings / original): at 7 tokens original 4 is the long table, 16 short
        **{name: (lambda original=original: build(
            "Phi3Config", m + "phi3.modeling_phi3", "Phi3Attention",
            {**decoder, "head_dim": 4, "max_position_embeddings": 4 * original,
             "original_max_position_embeddings": original,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0, **PHI3_TABLES}}, layer_idx=0,
        )) for name, original in (("phi3-longrope", 4), ("phi3-longrope-short", 16))},
        "t5-relative": lambda: build(
            "T5Config", m + "t5.modeling_t5", "T5Attention",
            {"d_model": 15, "d_kv": 4, "num_heads": 3, "dropout_rate": 0.0, "relative_attention_num_buckets": 10,
             "relative_attention_max_distance": 20},
            has_relative_attention_bias=True,
        ),
        "t5-relative-decoder": lambda: build(
            "T5Config", m + "t5.modeling_t5", "T5Attention",
            {"d_model": 15, "d_kv": 4, "num_heads": 3, "dropout_rate": 0.0, "is_decoder": True,
             "relative_attention_num_buckets": 10, "relative_attention_max_distance": 20},
            has_relative_attention_bias=True, is_causal=True,
        ),
        "bloom": lambda: build("BloomConfig", m + "bloom.modeling_bloom", "BloomAttention",
                               {"hidden_size": 18, "n_head": 6}, layer_idx=0),
        "mpt": lambda: build("MptConfig", m + "mpt.modeling_mpt", "MptAttention",
                             {"d_model": 18, "n_heads": 6, "attn_config": {"softmax_scale": 0.5}}, layer_idx=0),
    }  # fmt: skip
    return builders[name]()


_DECODER = {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "d_k": 6, "causal": True, "rope": "half"}
PHI3_TABLES = {"short_factor": [1.0, 1.5], "long_factor": [2.0, 3.5]}


def _longrope(original: int) -> dict:
    """What from_module reads of the Phi-3 longrope modules above: factor 4 (max positions / original)."""
    return {"rope_type": "longrope", **PHI3_TABLES, "original_max_position_embeddings": original, "factor": 4.0}


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8.0, "beta_slow": 1.0}

# name -> what from_module must read (the instance's own sizes and switches)
HF_EXPECTED = {
    "gpt2": MHAConfig(d_model=15, n_heads=3, causal=True),
    "bert": MHAConfig(d_model=15, n_heads=3),
    "llama": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, causal=True, rope="half", rope_base=500.0),
    "gpt-neox": MHAConfig(d_model=24, n_heads=3, causal=True, rope="half", rope_base=2000.0, rope_dims=4),
    "t5": MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0),
    "t5-decoder": MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, causal=True),
    "phi3": MHAConfig(
        d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, causal=True, rope="half", rope_base=500.0, rope_dims=4
    ),
    "falcon-new-arch": MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, causal=True, rope="half", rope_base=500.0),
    "falcon-new-arch-mqa": MHAConfig(d_model=24, n_heads=6, n_kv_heads=1, causal=True, rope="half", rope_base=500.0),
    "falcon-multi-query": MHAConfig(d_model=24, n_heads=6, n_kv_heads=1, causal=True, rope="half", rope_base=500.0),
    "falcon-per-head": MHAConfig(d_model=24, n_heads=6, causal=True, rope="half", rope_base=500.0),
    "qwen2": MHAConfig(**_DECODER, bias="qkv", rope_base=500.0),
    "mistral": MHAConfig(**_DECODER, bias=False, rope_base=500.0, window=3),
    "qwen3": MHAConfig(**_DECODER, rope_base=500.0, qk_norm="head", norm_eps=1e-5),
    "olmo2": MHAConfig(**_DECODER, bias=False, rope_base=500.0, qk_norm="projection", norm_eps=1e-5),
    "gemma2-sliding": MHAConfig(**_DECODER, bias=False, rope_base=500.0, scale=0.25, softcap=2.0, window=3),
    "gemma2-global": MHAConfig(**_DECODER, bias=False, rope_base=500.0, scale=0.25, softcap=2.0),
    # the local layer's base (5.x: rope_parameters["sliding_attention"]; 4.x's rope_local_base_freq), the global's
    "gemma3-sliding": MHAConfig(**_DECODER, bias=False, rope_base=100.0, scale=0.25, qk_norm="head", norm_eps=1e-5,
                                window=3),
    "gemma3-global": MHAConfig(**_DECODER, bias=False, rope_base=5000.0, scale=0.25, qk_norm="head", norm_eps=1e-5),
    "gpt-oss": MHAConfig(**_DECODER, rope_base=500.0, rope_scaling=_YARN, sinks=True, window=3),
    "llama3": MHAConfig(
        **_DECODER, bias=False, rope_base=500.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 4},
    ),
    "phi3-window": MHAConfig(**_DECODER, bias=False, rope_base=500.0, window=4),
    **{
        name: MHAConfig(**{**_DECODER, "d_k": 4}, bias=False, rope_base=500.0, rope_scaling=_longrope(original))
        for name, original in (("phi3-longrope", 4), ("phi3-longrope-short", 16))
    },
    "t5-relative": MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, rel_buckets=10, rel_max_distance=20),
    "t5-relative-decoder": MHAConfig(
        d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, causal=True, rel_buckets=10, rel_max_distance=20,
        rel_bidirectional=False,
    ),
    "bloom": MHAConfig(d_model=18, n_heads=6, causal=True, alibi=True),
    "mpt": MHAConfig(d_model=18, n_heads=6, bias=False, causal=True, alibi=True, scale=0.5),
}  # fmt: skip
HF_LAYOUT = {
    "t5-decoder": "hf-t5",
    "t5-relative": "hf-t5",
    "t5-relative-decoder": "hf-t5",
    "gpt-neox": "hf-gpt-neox",
    "llama3": "hf-llama",
    "phi3-window": "hf-phi3",
    "phi3-longrope": "hf-phi3",
    "phi3-longrope-short": "hf-phi3",
    **{k: "hf-falcon" for k in HF_EXPECTED if "falcon" in k},
    **{k: k.split("-")[0].join(("hf-", "")) for k in HF_EXPECTED if k.startswith("gemma")},
}


def _randomised(module):
    """Every parameter drawn at random (HF initialises biases to zero, which would hide a dropped bias)."""
    import torch

    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.4)
    return module


@pytest.mark.parametrize("name", list(HF_EXPECTED))
def test_hugging_face_module_is_read_with_its_own_configuration(name):
    module = _hf(name)
    spec = from_module(module)
    assert isinstance(spec, ModuleSpec) and spec.cfg == HF_EXPECTED[name]
    cfg, params = spec  # unpacks as a pair
    layout = HF_LAYOUT.get(name, f"hf-{name}")
    assert MODULE_LAYOUTS[f"transformers.{type(module).__name__}"].name == layout
    assert params.w_q.shape == (cfg.q_width, cfg.d_model) and params.w_k.shape == (cfg.k_width, cfg.d_model)


@pytest.mark.parametrize("name", list(HF_EXPECTED))
def test_hugging_face_module_output_is_the_spec_of_what_it_reads(name):
    """The instance's own forward, with the rotary tables of its own rotary module (float32 angles)."""
    module = _randomised(_hf(name))
    cfg = from_module(module).cfg
    x = _x(cfg.d_model)
    padding = None if cfg.causal else PADDING
    run, cfg, params = run_module(module, x, padding)
    expected = reference_mha(cfg, params, x, mask=allowed_mask(cfg, BATCH, TOKENS, padding))
    assert_close(run.output, expected, run.precision, what=f"{name}: {run.module}")
    if cfg.rope is not None:
        assert run.precision == "float32" and "angles in float32" in run.note


FLOAT64_PATHS = [
    ("gpt2", "eager"),
    ("bert", "sdpa"),
    ("t5", "eager"),
    ("t5-decoder", "eager"),
    ("llama", "sdpa"),
    ("gpt-neox", "sdpa"),
    ("phi3", "sdpa"),
    # Falcon's own eager path kept the hidden states' dtype; from transformers 5.25 its eager path is the shared
    # one (softmax in float32, `falcon_eager_is_shared`), and these run on SDPA instead (in the test below).
    ("falcon-new-arch", "eager"),
    ("falcon-new-arch-mqa", "sdpa"),
    ("falcon-multi-query", "eager"),
    ("falcon-per-head", "eager"),
    ("qwen2", "sdpa"),
    ("mistral", "sdpa"),  # SDPA with the model's sliding-window mask
    ("llama3", "sdpa"),  # llama3-scaled frequencies, the spec's float64 tables
    ("phi3-window", "sdpa"),
    ("phi3-longrope", "sdpa"),  # the spec's float64 tables: the long table, its attention factor on cos and sin
    ("phi3-longrope-short", "sdpa"),
    ("gpt-oss", "eager"),  # gpt-oss's eager softmax keeps the scores' dtype: sinks, window and YaRN in float64
    ("t5-relative", "eager"),
    ("t5-relative-decoder", "sdpa"),
]
# qwen3, olmo2, gemma3 (their RMSNorm), gemma2 (eager's softmax; SDPA cannot softcap), bloom and mpt (their softmax)
# compute in float32 on every path: the output test above holds them to float32 and names where.


@pytest.mark.parametrize(("name", "implementation"), FLOAT64_PATHS)
def test_hugging_face_module_agrees_in_float64_on_a_float64_path(name, implementation):
    module = _randomised(_hf(name))
    if name.startswith("falcon") and implementation == "eager":
        from mha_rosetta.models.hf_falcon import falcon_eager_is_shared

        implementation = "sdpa" if falcon_eager_is_shared() else "eager"
    cfg = from_module(module).cfg
    x = _x(cfg.d_model, seed=5)
    padding = None if cfg.causal else PADDING
    run, cfg, params = run_module(
        module, x, padding, implementation=implementation, float64_rotary=cfg.rope is not None
    )
    assert run.precision == "float64", run.note
    expected = reference_mha(cfg, params, x, mask=allowed_mask(cfg, BATCH, TOKENS, padding))
    assert_close(run.output, expected, "float64", what=f"{name}: {run.module}")
    config = module.self.config if name == "bert" else module.config
    assert config._attn_implementation == "eager"  # the module's own setting is restored


def _torch_state(module) -> dict:
    return {name: value.clone() for name, value in module.state_dict().items()}


# Gemma 3 stores w and computes with 1 + w: a float64 w read as 1 + w and written back as (1 + w) - 1 keeps it to
# one unit in the last place of 1 (2**-52), not bit for bit; a float32 (or bfloat16) w, a real checkpoint's, is exact.
OFFSET_NORMS = {"gemma3-sliding", "gemma3-global"}


@pytest.mark.parametrize("name", list(HF_EXPECTED))
def test_hugging_face_to_module_round_trips_exactly(name):
    module = _randomised(_hf(name))  # skips, with the reason, without torch and transformers
    import torch

    if name in OFFSET_NORMS:
        module = module.float()  # the stored w of a real checkpoint (float32 or bfloat16)
    before = _torch_state(module)
    cfg, params = from_module(module)
    other = init_params(cfg, seed=7)
    assert to_module(cfg, other, module) is module  # in place
    if name in OFFSET_NORMS:  # float64 parameters into a float32 module: rounded to float32 (exact otherwise)
        read = from_module(module).params.as_dict()
        assert all(np.allclose(read[k], v, rtol=2e-7, atol=0) for k, v in other.as_dict().items() if v is not None)
    else:
        assert _same(from_module(module).params, other)
    to_module(cfg, params, module)
    after = module.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", sorted(OFFSET_NORMS))
def test_gemma3_float64_norm_weight_comes_back_to_one_ulp_of_one(name):
    module = _randomised(_hf(name))
    stored = module.q_norm.weight.detach().clone()
    cfg, params = from_module(module)
    assert np.array_equal(params.q_norm, 1.0 + stored.numpy())  # the canonical weight is 1 + stored
    to_module(cfg, params, module)
    difference = (module.q_norm.weight.detach() - stored).abs().max().item()
    assert 0 < difference <= 2**-52  # (1 + w) - 1 rounds w to the grid of 1 + w: here it moved, by one ulp of 1


def test_phi3_longrope_takes_the_long_table_one_token_past_the_original_length():
    """transformers' Phi3RotaryEmbedding (dynamic_rope_update) picks the long table when the call's
    max(position_ids) + 1 exceeds original_max_position_embeddings (4 here): at 4 tokens the short one, at 5 the long
    one, each the spec of what from_module read; the other table is far off, so the choice is really tested."""
    module = _randomised(_hf("phi3-longrope"))
    cfg, params = from_module(module)
    tables = cfg.rope_scaling["short_factor"], cfg.rope_scaling["long_factor"]
    for tokens in (4, 5):
        x = _x(cfg.d_model, tokens)
        run = run_module(module, x)[0]  # its own rotary module: float32 angles
        assert_close(run.output, reference_mha(cfg, params, x), run.precision, what=f"{tokens} tokens")
        other = {**cfg.rope_scaling, "short_factor": tables[1], "long_factor": tables[0]}  # the tables swapped
        swapped = reference_mha(dataclasses.replace(cfg, rope_scaling=other), params, x)
        assert np.abs(run.output - swapped).max() > 1e-2


def test_phi3_longrope_decode_keeps_the_keys_written_before_the_switch_on_the_short_table():
    """Hugging Face's DynamicCache decoding across original_max_position_embeddings (4): steps 0-3 are the short
    table's run, and from step 4 the cached keys keep the short table while new ones take the long one, which is
    neither run of the spec (core.longrope: a decode check's run starts past the original length for this reason)."""
    from mha_rosetta.models.decode_steps import decode_steps

    module = _randomised(_hf("phi3-longrope"))
    cfg, params = from_module(module)
    x = _x(cfg.d_model, 7)
    steps = np.stack(decode_steps(module, x), axis=1)  # (B, 7, E): its own rotary, float32 angles
    assert_close(steps[:, :4], reference_mha(cfg, params, x[:, :4]), "float32", what="steps 0-3: the short table")
    long_run = reference_mha(cfg, params, x)  # every key rotated by the long table
    assert np.abs(steps[:, 4:] - long_run[:, 4:]).max() > 1e-2


def test_bert_layer_norm_is_left_alone_by_to_module():
    _need("torch", "transformers")
    import torch

    module = _randomised(_hf("bert"))
    norm = module.output.LayerNorm.weight.clone()
    cfg, _ = from_module(module)
    to_module(cfg, init_params(cfg, seed=2), module)
    assert torch.equal(module.output.LayerNorm.weight, norm)


def test_gpt2_upcast_attention_is_read_and_held_to_float32():
    """reorder_and_upcast_attn changes where GPT-2 computes (float32 scores), not what: the spec is the same.

    In a float64 model HF's own upcast path raises (the float64 causal mask promotes its float32 scores,
    and it checks for float32): a known difference, shown here; the float32 model runs.
    """
    _need("torch", "transformers")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = GPT2Config(n_embd=15, n_head=3, reorder_and_upcast_attn=True)
    config._attn_implementation = "eager"
    module = _randomised(GPT2Attention(config, layer_idx=0).double().eval())
    x = _x(15)
    with pytest.raises(RuntimeError, match="Error with upcasting"):
        run_module(module, x)
    run, cfg, params = run_module(module.float(), x)
    assert cfg == HF_EXPECTED["gpt2"] and run.precision == "float32" and "reorder_and_upcast_attn" in run.note
    assert_close(run.output, reference_mha(cfg, params, x), "float32", what="GPT-2 upcast attention")


def test_a_float32_module_is_read_in_float32_and_loaded_back_in_float32():
    _need("torch", "transformers")
    import torch

    module = _randomised(_hf("llama")).float()
    cfg, params = from_module(module)
    assert params.w_q.dtype == np.float32
    to_module(cfg, init_params(cfg, seed=1), module)  # float64 parameters, rounded to the module's dtype
    assert module.q_proj.weight.dtype == torch.float32
    x = _x(cfg.d_model)
    run, cfg, params = run_module(module, x)
    assert run.precision == "float32"
    assert_close(run.output, reference_mha(cfg, params, x), "float32", what="float32 LlamaAttention")


# --- nn.MultiheadAttention ------------------------------------------------------------------------


def test_torch_multihead_attention_sequence_first_self_attention():
    _need("torch")
    import torch

    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(15, 3, dtype=torch.float64).eval()  # batch_first=False: (N, B, E)
    with torch.no_grad():
        module.in_proj_bias.normal_()
    x = _x(15)
    run, cfg, params = run_module(module, x, PADDING)
    assert cfg == MHAConfig(d_model=15, n_heads=3)
    assert_close(run.output, reference_mha(cfg, params, x, mask=allowed_mask(cfg, BATCH, TOKENS, PADDING)), "float64")


def test_torch_multihead_attention_cross_widths_and_round_trip():
    _need("torch")
    import torch

    torch.manual_seed(1)
    module = torch.nn.MultiheadAttention(15, 3, kdim=11, vdim=9, batch_first=True, dtype=torch.float64).eval()
    cfg, params = from_module(module)
    assert cfg == MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=9)
    q, k, v = _x(15), _x(11, tokens=5, seed=1), _x(9, tokens=5, seed=2)
    with torch.no_grad():
        out = module(*(torch.from_numpy(a) for a in (q, k, v)), need_weights=False)[0].numpy()
    assert_close(out, reference_mha(cfg, params, q, k, v), "float64", what="nn.MultiheadAttention cross")
    before = _torch_state(module)
    other = init_params(cfg, seed=4)
    to_module(cfg, other, module)
    assert _same(from_module(module).params, other)
    to_module(cfg, params, module)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


# --- Keras, Flax (linen and NNX), Equinox ---------------------------------------------------------


def _x64():
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 modules; without it JAX silently computes in float32


def _keras_layer(**kwargs):
    _need("keras", "jax")
    import keras

    if keras.backend.backend() == "jax":
        _x64()
    layer = keras.layers.MultiHeadAttention(dtype="float64", bias_initializer="random_normal", seed=0, **kwargs)
    layer.build((None, None, 15), (None, None, 9), (None, None, 11))  # query, value, key widths
    return layer


def test_keras_multihead_attention_from_and_to_module():
    layer = _keras_layer(num_heads=3, key_dim=4, value_dim=6)
    cfg, params = from_module(layer)
    assert cfg == MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=6, kdim=11, vdim=9)
    q, k, v = _x(15), _x(11, tokens=5, seed=1), _x(9, tokens=5, seed=2)
    # return_attention_scores=True: Keras's own einsum path, float64 throughout (the default call on JAX takes
    # jax.nn.dot_product_attention, whose softmax is float32, and fails for value_dim != key_dim).
    out = np.asarray(layer(q, v, key=k, return_attention_scores=True)[0])
    assert_close(out, reference_mha(cfg, params, q, k, v), "float64", what="keras MultiHeadAttention")
    before = [w.copy() for w in layer.get_weights()]
    other = init_params(cfg, seed=4)
    assert to_module(cfg, other, layer) is layer
    assert _same(from_module(layer).params, other)
    to_module(cfg, params, layer)
    assert all(np.array_equal(a, b) for a, b in zip(before, layer.get_weights(), strict=True))


def test_keras_sliding_window_is_the_specs_two_sided_window():
    """Keras's sliding_window keeps |i - j| < W: the spec's window without causal (and with a causal call, the causal one)."""
    layer = _keras_layer(num_heads=3, key_dim=4, sliding_window=3)
    cfg, params = from_module(layer)
    assert cfg == MHAConfig(d_model=15, n_heads=3, d_k=4, kdim=11, vdim=9, window=3)
    q, k, v = _x(15), _x(11, seed=1), _x(9, seed=2)  # as many keys as queries: the band is on indices
    out = np.asarray(layer(q, v, key=k, return_attention_scores=True)[0])  # Keras's einsum path (float64)
    assert_close(out, reference_mha(cfg, params, q, k, v), "float64", what="keras sliding_window")
    causal = np.asarray(layer(q, v, key=k, use_causal_mask=True, return_attention_scores=True)[0])
    causal_cfg = dataclasses.replace(cfg, causal=True)
    assert_close(causal, reference_mha(causal_cfg, params, q, k, v), "float64", what="keras causal sliding_window")
    plain = reference_mha(dataclasses.replace(cfg, window=None), params, q, k, v)
    assert np.max(np.abs(out - plain)) > 1e-3  # the window matters on 7 tokens


def _linen(**kwargs):
    _need("flax", "jax")
    _x64()
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    module = nn.MultiHeadDotProductAttention(
        num_heads=3, qkv_features=12, dtype=jnp.float64, param_dtype=jnp.float64, deterministic=True, **kwargs
    )
    q, k = jnp.zeros((1, 3, 15)), jnp.zeros((1, 4, 11))
    variables = module.init(jax.random.PRNGKey(0), q, k, k)
    variables = jax.tree_util.tree_map(
        lambda a: jax.random.normal(jax.random.PRNGKey(a.size), a.shape, a.dtype), variables
    )
    return module, variables


def test_flax_linen_bound_module_from_and_to_module():
    _need("jax", "flax")
    import jax

    module, variables = _linen()
    bound = module.bind(variables)
    cfg, params = from_module(bound)
    assert cfg == MHAConfig(d_model=15, n_heads=3, d_k=4, kdim=11, vdim=11)
    q, kv = _x(15), _x(11, tokens=5, seed=1)
    out = np.asarray(bound(q, kv, kv))
    assert_close(out, reference_mha(cfg, params, q, kv, kv), "float64", what="flax linen MultiHeadDotProductAttention")
    other = init_params(cfg, seed=4)
    rebound = to_module(cfg, other, bound)  # linen modules are immutable: a new bound module
    assert rebound is not bound and _same(from_module(rebound).params, other)
    assert _same(from_module(bound).params, params)  # the original is untouched
    restored = to_module(cfg, params, rebound)
    leaves = jax.tree_util.tree_leaves(restored.variables)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(variables), leaves, strict=True))


def test_flax_nnx_module_from_and_to_module():
    _need("flax", "jax")
    _x64()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    module = nnx.MultiHeadAttention(
        num_heads=3,
        in_features=15,
        qkv_features=12,
        in_kv_features=11,
        dtype=jnp.float64,
        param_dtype=jnp.float64,
        bias_init=nnx.initializers.normal(1.0),
        decode=False,
        rngs=nnx.Rngs(0),
    )
    cfg, params = from_module(module)
    assert cfg == MHAConfig(d_model=15, n_heads=3, d_k=4, kdim=11, vdim=11)
    q, kv = _x(15), _x(11, tokens=5, seed=1)
    out = np.asarray(module(q, kv, kv, deterministic=True))
    # Without dropout and with no module to sow weights into, NNX's dot_product_attention hands the work to
    # jax.nn.dot_product_attention, whose softmax runs in float32 even on float64 inputs: float32 tolerance.
    assert_close(out, reference_mha(cfg, params, q, kv, kv), "float32", what="flax nnx MultiHeadAttention")
    before = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves(nnx.state(module))]
    other = init_params(cfg, seed=4)
    assert to_module(cfg, other, module) is module  # NNX holds its parameters: in place
    assert _same(from_module(module).params, other)
    to_module(cfg, params, module)
    after = jax.tree_util.tree_leaves(nnx.state(module))
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def _equinox(**kwargs):
    _need("equinox", "jax")
    _x64()
    import equinox as eqx
    import jax

    return eqx.nn.MultiheadAttention(
        3, 15, key_size=11, value_size=9, qk_size=4, vo_size=6, key=jax.random.PRNGKey(0), **kwargs
    )


def test_equinox_module_from_and_to_module():
    _need("jax", "equinox")
    import equinox as eqx
    import jax

    biases = {"use_query_bias": True, "use_key_bias": True, "use_value_bias": True, "use_output_bias": True}
    module = _equinox(**biases)
    cfg, params = from_module(module)
    assert cfg == MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=6, kdim=11, vdim=9)
    q, k, v = _x(15), _x(11, tokens=5, seed=1), _x(9, tokens=5, seed=2)
    out = np.asarray(jax.vmap(module)(q, k, v))  # the module is unbatched: (N, E) per example
    assert_close(out, reference_mha(cfg, params, q, k, v), "float64", what="equinox MultiheadAttention")
    other = init_params(cfg, seed=4)
    new = to_module(cfg, other, module)  # Equinox modules are immutable pytrees: a new module
    assert new is not module and _same(from_module(new).params, other) and _same(from_module(module).params, params)
    leaves = jax.tree_util.tree_leaves(eqx.filter(to_module(cfg, params, new), eqx.is_array))
    original = jax.tree_util.tree_leaves(eqx.filter(module, eqx.is_array))
    assert all(np.array_equal(a, b) for a, b in zip(original, leaves, strict=True))


# --- what cannot be read, and why -----------------------------------------------------------------


def _hf_module(package: str, config_class: str, class_name: str, config_kwargs: dict, layer_idx: int = 0):
    """transformers' ``class_name`` of ``transformers.models.<package>`` built from ``config_class(**config_kwargs)``."""
    _need("torch", "transformers")
    import importlib

    import transformers

    config = getattr(transformers, config_class)(**config_kwargs)
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    return getattr(modeling, class_name)(config, layer_idx=layer_idx)


SMALL_HF = {"hidden_size": 16, "num_attention_heads": 4}
# Phi-3's 128k rotary (two factor tables), on a 16-position original window, with a divisor of 0 the spec refuses.
LONGROPE = {
    "original_max_position_embeddings": 16,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [0.0, 1.0],
        "long_factor": [2.0, 2.0],
        "original_max_position_embeddings": 16,
    },
}
# (label, _hf_module's arguments, the LayoutError's message)
UNEXPRESSIBLE = [
    (
        "falcon alibi",
        ("falcon", "FalconConfig", "FalconAttention", {**SMALL_HF, "alibi": True}),
        r"FalconAttention has config\.alibi=True \(ALiBi.*\), which the spec cannot express: Falcon divides the bias "
        r"by sqrt\(d\) .* rounds the slopes to bfloat16",
    ),
    (
        "falcon per head with fewer kv heads",
        ("falcon", "FalconConfig", "FalconAttention", {**SMALL_HF, "multi_query": False, "num_kv_heads": 2}),
        r"FalconAttention packs per head .* num_kv_heads=2 != num_attention_heads=4",
    ),
    (
        # transformers takes the table (a list of numbers of the right length) and divides by 0: inf frequencies
        "phi3 longrope with a zero divisor",
        ("phi3", "Phi3Config", "Phi3Attention", {**SMALL_HF, "max_position_embeddings": 32, **LONGROPE}),
        r"Phi3Attention has .*longrope.*: MHAConfig.rope_scaling\['short_factor'\]\[0\] must be a finite number > 0",
    ),
    (
        "llama sliding_window set by hand",
        ("llama", "LlamaConfig", "LlamaAttention", {**SMALL_HF, "sliding_window": 5}),
        r"LlamaAttention's config has sliding_window=5, which LlamaAttention and LlamaModel ignore",
    ),
    (
        "mpt clip_qkv",
        ("mpt", "MptConfig", "MptAttention", {"d_model": 16, "n_heads": 4, "attn_config": {"clip_qkv": 6.0}}),
        r"MptAttention has clip_qkv=6\.0, which the spec cannot express: the spec does not clamp q, k and v",
    ),
    (
        "gpt2 scale by layer",
        (
            "gpt2",
            "GPT2Config",
            "GPT2Attention",
            {"n_embd": 12, "n_head": 3, "scale_attn_by_inverse_layer_idx": True},
            2,
        ),
        r"GPT2Attention with scale_attn_weights=True, scale_attn_by_inverse_layer_idx=True: layout 'hf-gpt2' holds",
    ),
]


@pytest.mark.parametrize(("label", "spec", "message"), UNEXPRESSIBLE, ids=[case[0] for case in UNEXPRESSIBLE])
def test_a_setting_the_spec_cannot_express_is_named(label, spec, message):
    module = _hf_module(*spec)
    with pytest.raises(LayoutError, match=message):
        from_module(module)
    with pytest.raises(LayoutError, match=message):  # to_module reads the module's configuration first
        to_module(MHAConfig(d_model=12, n_heads=3), init_params(MHAConfig(d_model=12, n_heads=3)), module)


def test_torch_multihead_attention_extra_tokens_are_named():
    _need("torch")
    import torch

    with pytest.raises(LayoutError, match=r"MultiheadAttention has add_bias_kv=True \(bias_k, bias_v"):
        from_module(torch.nn.MultiheadAttention(12, 3, add_bias_kv=True))
    with pytest.raises(LayoutError, match=r"MultiheadAttention has add_zero_attn=True"):
        from_module(torch.nn.MultiheadAttention(12, 3, add_zero_attn=True))


def test_keras_settings_the_spec_cannot_express_are_named():
    with pytest.raises(LayoutError, match=r"MultiHeadAttention has use_gate=True, which the spec cannot express"):
        from_module(_keras_layer(num_heads=3, key_dim=4, use_gate=True))
    import keras

    with pytest.raises(LayoutError, match=r"MultiHeadAttention is not built: it holds no weights yet"):
        from_module(keras.layers.MultiHeadAttention(num_heads=3, key_dim=4))


def test_flax_settings_the_spec_cannot_express_are_named():
    module, variables = _linen()
    with pytest.raises(LayoutError, match=r"MultiHeadDotProductAttention is not bound: .*module\.bind\(variables\)"):
        from_module(module)
    module, variables = _linen(normalize_qk=True)
    with pytest.raises(LayoutError, match=r"MultiHeadDotProductAttention has normalize_qk=True \(LayerNorm"):
        from_module(module.bind(variables))


def test_flax_nnx_grouped_kv_heads_are_named_by_the_layout():
    _need("flax", "jax")
    from flax import nnx

    module = nnx.MultiHeadAttention(num_heads=4, in_features=16, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(LayoutError, match=r"layout 'flax' cannot express .*n_kv_heads=2 != n_heads=4"):
        from_module(module)


def test_equinox_bias_on_some_projections_only_is_named():
    with pytest.raises(LayoutError, match=r"use_query_bias=True, use_key_bias=False.*every projection or none"):
        from_module(_equinox(use_query_bias=True))


def test_an_unknown_class_lists_the_known_ones_and_a_subclass_is_not_its_parent():
    _need("torch", "transformers")
    import torch
    from transformers.models.llama.modeling_llama import LlamaAttention

    known = "transformers.GPT2Attention, transformers.BertAttention, transformers.LlamaAttention"
    with pytest.raises(
        LayoutError, match=rf"no layout reads torch\.nn\.modules\.linear\.Linear .*known classes: {known}"
    ):
        from_module(torch.nn.Linear(3, 4))

    class MyAttention(LlamaAttention):
        pass

    module = _hf_module("llama", "LlamaConfig", "LlamaAttention", SMALL_HF)
    module.__class__ = MyAttention
    with pytest.raises(LayoutError, match=r"no layout reads .*MyAttention .*a subclass is not read as its parent"):
        from_module(module)


def test_to_module_refuses_parameters_made_for_another_configuration():
    module = _hf("llama")
    assert from_module(module).cfg.n_kv_heads == 2
    other = MHAConfig(d_model=16, n_heads=4, n_kv_heads=4, d_k=6, causal=True, rope="half", rope_base=500.0)
    with pytest.raises(LayoutError, match=r"to_module: .*LlamaAttention was built for another configuration .*"
                       r"n_kv_heads: module 2, given 4"):  # fmt: skip
        to_module(other, init_params(other), module)


def test_every_reader_is_registered_once_by_class():
    classes = [key for layout in MODULE_LAYOUTS.values() for key in layout.reader.classes]
    assert sorted(MODULE_LAYOUTS) == sorted(set(classes))
    assert set(MODULE_LAYOUTS) == {
        "transformers.GPT2Attention",
        "transformers.BertAttention",
        "transformers.LlamaAttention",
        "transformers.GPTNeoXAttention",
        "transformers.Phi3Attention",
        "transformers.FalconAttention",
        "transformers.Qwen2Attention",
        "transformers.MistralAttention",
        "transformers.Qwen3Attention",
        "transformers.Olmo2Attention",
        "transformers.Gemma2Attention",
        "transformers.Gemma3Attention",
        "transformers.Gemma4TextAttention",
        "transformers.GptOssAttention",
        "transformers.Llama4TextAttention",
        "transformers.DeepseekV2Attention",
        "transformers.DeepseekV3Attention",
        "transformers.Mistral4Attention",
        "transformers.Qwen3NextAttention",
        "transformers.BloomAttention",
        "transformers.MptAttention",
        "transformers.T5Attention",
        "keras.MultiHeadAttention",
        "mlx_lm.models.llama.Attention",
        "mlx_lm.models.qwen2.Attention",
        "mlx_lm.models.qwen3.Attention",
        "mlx_lm.models.olmo2.Attention",
        "mlx_lm.models.gemma3_text.Attention",
        "mlx_lm.models.phi3.Attention",
        "mlx_lm.models.gemma2.Attention",
        "mlx_lm.models.gpt_oss.AttentionBlock",
        "mlx_lm.models.qwen3_next.Qwen3NextAttention",
        "mlx_lm.models.deepseek_v3.DeepseekV3Attention",
        "mlx_lm.models.llama4.Attention",
        "mlx_lm.models.llama4_text.Attention",
        *(f"keras_hub.{name}" for name in ("LlamaAttention", "CachedMistralAttention", "CachedGemmaAttention")),
        *(f"keras_hub.{name}" for name in ("CachedGemma3Attention", "QwenAttention", "Qwen3Attention")),
        *(f"keras_hub.{name}" for name in ("Phi3Attention", "GptOssAttention")),
        "torch.MultiheadAttention",
        "flax.MultiHeadDotProductAttention",
        "flax.MultiHeadAttention",
        "equinox.MultiheadAttention",
    }


FLOAT32_EVERYWHERE = [
    ("qwen3", "RMSNorm of q and k runs in float32"),
    ("olmo2", "RMSNorm of q and k runs in float32"),
    ("gemma3-sliding", "Gemma3RMSNorm computes in float32"),
    ("gemma2-global", "eager attention's softmax runs in float32"),
    ("bloom", "softmax runs in float32 on its only path"),
    ("mpt", "softmax runs in float32 on its only path"),
]


@pytest.mark.parametrize(("name", "cause"), FLOAT32_EVERYWHERE)
def test_a_module_with_no_float64_path_is_held_to_float32_and_says_where(name, cause):
    module = _randomised(_hf(name))
    cfg = from_module(module).cfg
    x = _x(cfg.d_model, seed=9)
    options = {"implementation": "eager", "float64_rotary": True} if cfg.rope is not None else {}
    run, cfg, params = run_module(module, x, **options)
    assert run.precision == "float32" and cause in run.note, run.note
    assert_close(run.output, reference_mha(cfg, params, x), "float32", what=f"{name}: {run.module}")


@pytest.mark.parametrize("name", ["gemma2-sliding", "gpt-oss"])
def test_softcap_and_sinks_modules_refuse_sdpa_instead_of_dropping_the_variant(name):
    module = _hf(name)
    with pytest.raises(ValueError, match=r"_supports_sdpa = False .*use implementation='eager'"):
        run_module(module, _x(16), implementation="sdpa")


def test_a_sliding_layer_and_a_global_layer_of_one_config_are_read_apart():
    """layer_types decides: the module's own sliding_window attribute, not config.sliding_window, is the window."""
    sliding, full = _hf("gemma2-sliding"), _hf("gemma2-global")
    assert sliding.config.sliding_window == full.config.sliding_window == 3
    assert from_module(sliding).cfg.window == 3 and from_module(full).cfg.window is None


def test_a_bidirectional_gemma_layer_is_refused_with_the_reason():
    module = _hf_module(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3Attention",
        {**SMALL_HF, "head_dim": 4, "use_bidirectional_attention": True},
    )
    with pytest.raises(LayoutError, match=r"Gemma3Attention has is_causal=False .*reads decoder layers only"):
        from_module(module)


def test_falcons_alibi_is_the_known_difference_its_layout_error_names():
    """Falcon's ALiBi: (q.k + m_h p_j) / sqrt(d) with bfloat16 slopes, shown on the real module; not the spec's ALiBi."""
    _need("torch", "transformers")
    import torch
    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention, build_alibi_tensor

    from mha_rosetta.core.variants import alibi_slopes

    config = FalconConfig(hidden_size=24, num_attention_heads=6, alibi=True, multi_query=False, bias=True)
    config._attn_implementation = "eager"
    module = _randomised(FalconAttention(config, layer_idx=0).double().eval())
    with pytest.raises(LayoutError, match=r"Falcon divides the bias by sqrt\(d\)"):
        from_module(module)
    x = _x(24, seed=4)
    batch, tokens = x.shape[:2]
    causal = np.triu(np.full((tokens, tokens), np.finfo(np.float64).min), 1)[None, None]  # additive, (1, 1, N, N)
    from mha_rosetta.models.hf_falcon import falcon_eager_is_shared, falcon_takes_alibi

    with torch.no_grad():
        alibi = build_alibi_tensor(torch.ones(batch, tokens, dtype=torch.long), 6, torch.float64)  # (B*H, 1, N)
        if falcon_takes_alibi():
            out = module(torch.from_numpy(x), alibi=alibi, attention_mask=torch.from_numpy(causal))[0].numpy()
        else:  # transformers 5.25 on: FalconModel folds alibi / sqrt(d) into the additive mask, as here
            mask = alibi.reshape(batch, 6, 1, tokens) / 2.0  # (B*H, 1, N) -> (B, H, 1, N): a view; / sqrt(d_k = 4)
            mask = torch.masked_fill(mask, torch.from_numpy(causal) < -1, np.finfo(np.float64).min)  # (B, H, N, N)
            out = module(torch.from_numpy(x), attention_mask=mask)[0].numpy()
    # The same layer in the spec with ALiBi (per-head packing: Falcon-RW), from its tensors:
    spec_cfg = MHAConfig(d_model=24, n_heads=6, causal=True, alibi=True)
    from mha_rosetta.models import get_layout

    names = ("query_key_value.weight", "query_key_value.bias", "dense.weight", "dense.bias")
    params = get_layout("hf-falcon").unpack(spec_cfg, {n: module.state_dict()[n].numpy() for n in names})
    spec = reference_mha(spec_cfg, params, x)
    assert np.max(np.abs(out - spec)) > 1e-2  # not the spec's ALiBi
    # Falcon's own formula, written out: bfloat16 slopes, the bias scaled with the scores
    slopes = torch.tensor(alibi_slopes(6)).bfloat16().double().numpy()  # (H,)
    q, k, v = (getattr(params, f"w_{r}") for r in "qkv")
    split = [
        (x @ w.T + b).reshape(batch, tokens, 6, 4).transpose(0, 2, 1, 3)  # (B, N, H*d) -> (B, H, N, d): views
        for w, b in ((q, params.b_q), (k, params.b_k), (v, params.b_v))
    ]
    # (B, H, N, N): m_h p_j added before the 1/sqrt(d) = 1/2, as Falcon's eager path does
    scores = (split[0] @ split[1].transpose(0, 1, 3, 2) + slopes[None, :, None, None] * np.arange(tokens)) / 2.0
    scores = scores + causal
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = (weights @ split[2]).transpose(0, 2, 1, 3).reshape(batch, tokens, 24)  # (B, H, N, d) -> (B, N, H*d): copy
    # The shared eager path (transformers 5.25 on) runs the softmax in float32: that tolerance then applies.
    precision = "float32" if falcon_eager_is_shared() else "float64"
    assert_close(out, context @ params.w_o.T + params.b_o, precision, what="Falcon's ALiBi written out")


@pytest.mark.parametrize("name", ["bloom", "gemma2-sliding"])
def test_softmax_float32_modules_agree_in_float64_once_their_softmax_keeps_float64(monkeypatch, name):
    """BLOOM's scores come from alibi.baddbmm in the module's dtype, Gemma 2's softcap in the scores' dtype: with the
    softmax kept in float64 too (patched: softmax(..., dtype=torch.float32) is the one float32 step, with float64
    (cos, sin) for Gemma 2), each real module agrees with the spec in float64."""
    module = _randomised(_hf(name))  # skips, with the reason, without torch and transformers
    import torch

    cfg = from_module(module).cfg
    x = _x(cfg.d_model, seed=6)
    options = {"implementation": "eager", "float64_rotary": True} if cfg.rope is not None else {}
    run, cfg, params = run_module(module, x, **options)
    assert run.precision == "float32"  # as it is
    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda t, dim, dtype=None: softmax(t, dim=dim))  # float64
    patched, _, _ = run_module(module, x, **options)
    assert_close(patched.output, reference_mha(cfg, params, x), "float64", what=f"{name} with a float64 softmax")


def _float64_rms_norm(offset: float):
    """An RMSNorm forward without the float32 cast of transformers' (Qwen3RMSNorm / Olmo2RMSNorm / Gemma3RMSNorm)."""
    import torch

    def forward(self, x):
        eps = getattr(self, "variance_epsilon", None) or self.eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + self.weight)

    return forward


@pytest.mark.parametrize(
    ("name", "package", "norm", "offset"),
    [
        ("qwen3", "qwen3", "Qwen3RMSNorm", 0.0),
        ("olmo2", "olmo2", "Olmo2RMSNorm", 0.0),
        ("gemma3-sliding", "gemma3", "Gemma3RMSNorm", 1.0),
    ],
)
def test_qk_norm_modules_agree_in_float64_once_their_norm_keeps_float64(monkeypatch, name, package, norm, offset):
    """The RMSNorm's cast to float32 is the one float32 step left on SDPA with float64 (cos, sin): patched to keep
    float64, the real module agrees with the spec in float64 (and Gemma 3's 1 + w is the spec's q_norm)."""
    import importlib

    module = _randomised(_hf(name))
    x = _x(16, seed=8)
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    monkeypatch.setattr(getattr(modeling, norm), "forward", _float64_rms_norm(offset))
    run, cfg, params = run_module(module, x, implementation="sdpa", float64_rotary=True)
    assert run.precision == "float32"  # the run still says so: the layout cannot know the norm was patched
    assert_close(run.output, reference_mha(cfg, params, x), "float64", what=f"{name} with a float64 RMSNorm")
