"""`diagnose.compare` with keras-hub's layers: Hugging Face -> keras-hub (the Gemma 3 worked example of docs/ports.md),
mlx-lm -> keras-hub, and keras-hub against itself through its own cache with a window.

Each case runs the libraries' own modules (tiny, float64, random weights); keras-hub's float32 angles and softmax and
Hugging Face's float32 angles put the comparison at float32's tolerance, and the notes say so.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras 3 defaults to TensorFlow; keras-hub runs on JAX here

from conftest import agreeing_comparison, hf_attention, load_example, run_cli, skip_unless_installed
from mha_rosetta.core import MHAConfig
from mha_rosetta.diagnose.compare import compare
from mha_rosetta.models import from_module
from mha_rosetta.models.keras_hub import FAMILIES

skip_unless_installed("keras", "keras_hub", "torch", "transformers")
ROOT = Path(__file__).resolve().parents[1]
ports_gemma3 = load_example("ports_gemma3")


def test_hf_gemma3_and_keras_hub_gemma3_agree_forward_and_decode():
    result = agreeing_comparison(ports_gemma3.hf_gemma3(), ports_gemma3.keras_hub_gemma3())
    assert any("keras-hub computes the rotary angles in float32" in note for note in result.notes)


def test_the_head_dim_scale_is_named_with_its_stage_and_cause():
    hf = ports_gemma3.hf_gemma3()
    result = compare(hf, ports_gemma3.keras_hub_gemma3_head_dim_scale(), decode=True)
    # query_pre_attn_scalar = hidden / heads = 8 where keras-hub's default normalizes by head_dim = 16
    assert [(d.name, d.a, d.b) for d in result.differences] == [("scale", 8**-0.5, 16**-0.5)]
    assert not result.agrees and result.stage == "scores" and result.causes[0].code == "scale"
    # one cached key: its softmax weight is 1 at any scale, so step 0 agrees and step 1 is the first to differ
    assert result.decode_steps[0] < 1e-6 and result.first_decode_step == 1


PLANTED = ("examples.ports_gemma3:hf_gemma3", "examples.ports_gemma3:keras_hub_gemma3_head_dim_scale")


def test_cli_compare_names_the_scale_and_exits_1():
    env = {"OPENBLAS_NUM_THREADS": "1", "KERAS_BACKEND": "jax"}
    done = run_cli("compare", *PLANTED, "--json", "-", cwd=ROOT, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    payload = json.loads(done.stdout)
    assert payload["stage"] == "scores" and payload["causes"][0]["code"] == "scale"
    assert payload["b"] == "keras_hub.src.models.gemma3.gemma3_attention.CachedGemma3Attention"


SMALL = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_hf_llama_with_llama3_scaling_against_keras_hub_agrees_forward_and_decode():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    hf = hf_attention("llama", "LlamaConfig", "LlamaAttention", **SMALL, rope_parameters=rope, attention_bias=False)
    cfg = from_module(hf).cfg
    assert cfg.rope_scaling["rope_type"] == "llama3"
    result = compare(hf, FAMILIES["keras-hub-llama"].build(cfg), decode=True)
    assert result.differences == [] and result.agrees and result.first_decode_step is None


def test_hf_mistral_window_against_keras_hub_band_agrees_and_another_window_is_named():
    hf = hf_attention("mistral", "MistralConfig", "MistralAttention", **SMALL, head_dim=8, sliding_window=3)
    cfg = from_module(hf).cfg
    assert cfg.window == 3
    assert compare(hf, FAMILIES["keras-hub-mistral"].build(cfg)).agrees  # 7 tokens: the window of 3 keys binds
    wide = FAMILIES["keras-hub-mistral"].build(replace(cfg, window=5))
    wrong = compare(hf, wide)
    assert [(d.name, d.a, d.b) for d in wrong.differences] == [("window", 3, 5)]
    assert not wrong.agrees and wrong.stage == "masked_scores"


def test_keras_hub_against_itself_decodes_through_its_cache_with_the_window():
    cfg = MHAConfig(16, 4, n_kv_heads=2, d_k=8, bias=False, causal=True, rope="half", qk_norm="head", window=3)
    a, b = FAMILIES["keras-hub-gemma3"].build(cfg), FAMILIES["keras-hub-gemma3"].build(cfg, seed=9)
    result = compare(a, b, decode=True)
    assert result.agrees and result.first_decode_step is None and max(result.decode_steps) < 1e-5
    b.sliding_window_size = 5  # the port's window, set after building: the layer masks with it
    wrong = compare(a, b, decode=True)
    assert [d.name for d in wrong.differences] == ["window"] and wrong.first_decode_step == 3  # token 3 sees key 0


def test_mlx_lm_qwen3_against_keras_hub_qwen3_agrees_forward_and_decode():
    skip_unless_installed("mlx", "mlx_lm")
    from mha_rosetta.models.mlx_lm import FAMILIES as MLX

    cfg = MHAConfig(16, 4, n_kv_heads=2, d_k=8, bias=False, causal=True, rope="half", qk_norm="head", norm_eps=1e-6)
    result = compare(MLX["mlx-qwen3"].build(cfg), FAMILIES["keras-hub-qwen3"].build(cfg), decode=True)
    assert result.differences == [] and result.agrees and result.first_decode_step is None
