"""`diagnose.compare`: two real modules side by side, across frameworks (Hugging Face torch, mlx-lm, torch, Keras).

Each case runs the libraries' own modules (tiny, float64, random weights). A planted real-world mistake must be
named by the field that differs, the first stage where the specs part and diagnose's cause; an honest port must
agree within the tolerance of the declared levels (MLX float64 and Hugging Face's float32 angles: float32).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import agreeing_comparison, hf_attention, load_example, run_cli, skip_unless_installed
from mha_rosetta.core import MHAConfig
from mha_rosetta.diagnose.compare import compare
from mha_rosetta.models import from_module
from mha_rosetta.models.mlx_lm import FAMILIES

skip_unless_installed("torch", "transformers", "mlx", "mlx_lm")
ROOT = Path(__file__).resolve().parents[1]
ports_qwen3 = load_example("ports_qwen3")


def test_hf_qwen3_and_mlx_lm_qwen3_agree_forward_and_decode():
    result = agreeing_comparison(ports_qwen3.hf_qwen3(), ports_qwen3.mlx_qwen3())
    assert result.stage is None and result.causes == []
    assert any("float32-accurate" in note for note in result.notes)  # MLX's float64 limit, named


def test_the_traditional_flag_is_named_with_its_stage_and_cause():
    result = compare(ports_qwen3.hf_qwen3(), ports_qwen3.mlx_qwen3_traditional(), decode=True)
    assert [(d.name, d.a, d.b) for d in result.differences] == [("rope", "half", "interleaved")]
    assert not result.agrees and result.max_error > 1e-2
    assert result.stage == "q_rotated"
    assert result.causes[0].code == "rope_convention"
    # position 0 is not rotated in either convention: the first decode step agrees, the second does not
    assert result.decode_steps[0] < 1e-6 and result.first_decode_step == 1


def test_a_port_with_another_scale_is_named_scale_at_the_scores():
    port = ports_qwen3.mlx_qwen3()
    port.scale = 1.0  # the port forgot 1/sqrt(d)
    result = compare(ports_qwen3.hf_qwen3(), port)
    assert [d.name for d in result.differences] == ["scale"]
    assert result.stage == "scores" and not result.agrees
    assert "scale" in [cause.code for cause in result.causes]


def test_sizes_that_cannot_hold_the_parameters_are_refused_naming_the_fields():
    small = FAMILIES["mlx-llama"].build(MHAConfig(d_model=16, n_heads=4, d_k=4, bias=False, causal=True, rope="half"))
    other = FAMILIES["mlx-llama"].build(MHAConfig(d_model=16, n_heads=4, d_k=8, bias=False, causal=True, rope="half"))
    with pytest.raises(ValueError, match=r"B cannot hold A's parameters.*d_k: A 4, B 8"):
        compare(small, other)


def test_same_shapes_other_heads_runs_and_names_the_head_count():
    four = FAMILIES["mlx-llama"].build(MHAConfig(d_model=16, n_heads=4, d_k=4, bias=False, causal=True, rope="half"))
    two = FAMILIES["mlx-llama"].build(MHAConfig(d_model=16, n_heads=2, d_k=8, bias=False, causal=True, rope="half"))
    result = compare(four, two)  # (16, 16) weights either way: the numbers load, the heads split differently
    assert [d.name for d in result.differences] == ["n_heads", "d_k", "d_v", "n_kv_heads", "scale", "rope_dims"]
    assert not result.agrees and result.stage == "q_heads"


def test_torch_multihead_attention_against_keras_runs_keras_rebuilt_and_says_so():
    os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras 3 defaults to TensorFlow, which is not installed here
    skip_unless_installed("keras")
    import keras
    import torch

    torch.manual_seed(0)
    a = torch.nn.MultiheadAttention(16, 4, batch_first=True).double()
    b = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4)
    b(np.zeros((1, 3, 16)), np.zeros((1, 3, 16)))  # builds its variables
    result = compare(a, b)
    assert result.differences == [] and result.agrees
    assert any("rebuilt from what from_module read" in note for note in result.notes)
    assert from_module(b).cfg == from_module(a).cfg


def test_cli_compare_exit_status_and_named_cause():
    def cli(*args):
        return run_cli("compare", *args, cwd=ROOT, env={"OPENBLAS_NUM_THREADS": "1"})

    bad = cli("examples.ports_qwen3:hf_qwen3", "examples.ports_qwen3:mlx_qwen3_traditional")
    assert bad.returncode == 1, bad.stderr
    assert "differs: rope: A 'half', B 'interleaved'" in bad.stdout and "likeliest cause: rope_convention" in bad.stdout
    good = cli("examples.ports_qwen3:hf_qwen3", "examples.ports_qwen3:mlx_qwen3")
    assert good.returncode == 0 and "AGREE" in good.stdout
    as_json = cli("examples.ports_qwen3:hf_qwen3", "examples.ports_qwen3:mlx_qwen3_traditional", "--json", "-")
    payload = json.loads(as_json.stdout)
    assert payload["stage"] == "q_rotated" and payload["causes"][0]["code"] == "rope_convention"
    missing = cli("examples.ports_qwen3:nothing", "examples.ports_qwen3:mlx_qwen3")
    assert missing.returncode == 2 and "has no attribute 'nothing'" in missing.stderr


def _hf(package: str, config_class: str, attention_class: str, **config):
    """`hf_attention` of one full-attention layer (these families' configs list the layers' types)."""
    return hf_attention(package, config_class, attention_class, layer_types=["full_attention"], **config)


SMALL = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def test_gemma3_hf_against_mlx_lm_agrees_and_the_head_dim_scale_is_named():
    # query_pre_attn_scalar 32, not head_dim: the scale a port gets wrong
    hf = _hf("gemma3", "Gemma3TextConfig", "Gemma3Attention", **SMALL, query_pre_attn_scalar=32, rms_norm_eps=1e-6)
    cfg = from_module(hf).cfg
    assert cfg.scale == 32**-0.5
    port = FAMILIES["mlx-gemma3"].build(cfg)
    result = compare(hf, port, decode=True)
    assert result.agrees and result.differences == [] and result.first_decode_step is None
    port.scale = 8**-0.5  # head_dim**-0.5, where Gemma 3 scales by query_pre_attn_scalar**-0.5
    wrong = compare(hf, port)
    assert [(d.name, d.a, d.b) for d in wrong.differences] == [("scale", 32**-0.5, pytest.approx(8**-0.5, 1e-15))]
    assert not wrong.agrees and wrong.stage == "scores" and wrong.causes[0].code == "scale"


def test_phi3_hf_against_mlx_lm_fused_and_partial_rotary_agree_forward_and_decode():
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    sizes = {**SMALL, "hidden_size": 32}
    sizes.pop("head_dim")  # Phi-3: hidden_size // heads = 8
    hf = _hf("phi3", "Phi3Config", "Phi3Attention", **sizes, rope_parameters=rope, sliding_window=None)
    cfg = from_module(hf).cfg
    assert cfg.rope_dims == 4  # int(8 * 0.5)
    result = compare(hf, FAMILIES["mlx-phi3"].build(cfg), decode=True)
    assert result.differences == [] and result.agrees and result.first_decode_step is None


def test_gemma2_hf_against_mlx_lm_softcap_agrees_and_another_cap_is_named():
    # softcap 5: small, so the tiny scores reach the tanh's curve
    hf = _hf("gemma2", "Gemma2Config", "Gemma2Attention", **SMALL, query_pre_attn_scalar=16, attn_logit_softcapping=5.0)
    port = FAMILIES["mlx-gemma2"].build(from_module(hf).cfg)
    assert compare(hf, port, decode=True).agrees
    port.attn_logit_softcapping = 1.0
    wrong = compare(hf, port)
    assert [(d.name, d.a, d.b) for d in wrong.differences] == [("softcap", 5.0, 1.0)]
    assert not wrong.agrees and wrong.stage == "capped_scores"


def test_gpt_oss_hf_against_mlx_lm_sinks_agree_forward_and_decode():
    import torch

    rope = {"rope_type": "default", "rope_theta": 10000.0}  # the checkpoints' YaRN is refused by the mlx reader
    hf = _hf("gpt_oss", "GptOssConfig", "GptOssAttention", **SMALL, rope_parameters=rope)
    with torch.no_grad():
        hf.sinks.normal_()  # one logit per head, away from 0
    port = FAMILIES["mlx-gpt-oss"].build(from_module(hf).cfg)
    result = compare(hf, port, decode=True)
    assert result.differences == [] and result.agrees and result.first_decode_step is None
    np.testing.assert_array_equal(from_module(port).params.sinks, hf.sinks.detach().numpy())  # A's sinks in B
