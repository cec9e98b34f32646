"""keras-hub's attention layers read by `from_module`: each real layer's own forward (and cached decode) is the spec
of what was read, on Keras 3's JAX backend here and on its torch backend in a subprocess (KERAS_BACKEND is fixed
per process).

The layers are keras-hub's own (keras_hub/src/models/<family>/<family>_attention.py), built tiny from their
constructor arguments in float64 with seeded random weights. keras-hub computes its rotary angles and its softmax
in float32 (and Gemma 3's and Qwen 3's q/k RMSNorm), so the runs are held to float32's tolerance, and say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, reference_mha, tolerance_for
from mha_rosetta.models import LayoutError, from_module, get_layout, to_module

os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras 3 defaults to TensorFlow; keras-hub runs on JAX here
pytest.importorskip("keras", reason="keras is not installed: pip install 'mha-rosetta[keras-hub]'")
pytest.importorskip("keras_hub", reason="keras-hub is not installed: pip install 'mha-rosetta[keras-hub]'")

from mha_rosetta.models.decode_steps import decode_steps
from mha_rosetta.models.keras_hub import FAMILIES
from mha_rosetta.models.real_modules import run_module

ROOT = Path(__file__).resolve().parents[1]
TOL = tolerance_for("float32")


def _cfg(**fields) -> MHAConfig:
    """A tiny causal configuration: d_model 16, 4 heads, no biases, rotate-half, unless ``fields`` say otherwise."""
    return MHAConfig(**{"d_model": 16, "n_heads": 4, "bias": False, "causal": True, "rope": "half", **fields})


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CASES = [
    ("keras-hub-llama", _cfg(n_kv_heads=2)),
    # Llama 3.1's scaling, original length 8 so that the 7 tokens' frequencies cross all three bands
    ("keras-hub-llama", _cfg(n_kv_heads=2, rope_scaling={**LLAMA3, "original_max_position_embeddings": 8})),
    # Mistral: its decoder's band mask of 3 keys (window 3 < 7 tokens)
    ("keras-hub-mistral", _cfg(n_kv_heads=2, d_k=8, window=3, rope_base=1e6)),
    ("keras-hub-mistral", _cfg(d_k=6, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # Gemma: kernels (H, E, d); scale (hidden // heads)**-0.5 = 1/2 where head_dim is 8; softcap 5; window 3
    ("keras-hub-gemma", _cfg(n_kv_heads=2, d_k=8, softcap=5.0, window=3, scale=4**-0.5)),
    ("keras-hub-gemma", _cfg(n_kv_heads=1, d_k=8)),
    ("keras-hub-gemma3", _cfg(n_kv_heads=2, d_k=8, qk_norm="head", norm_eps=1e-6, window=4, rope_base=1e6)),
    ("keras-hub-gemma3", _cfg(n_kv_heads=2, d_k=8, qk_norm="head", norm_eps=1e-6, scale=4**-0.5, softcap=5.0)),
    ("keras-hub-qwen2", _cfg(n_kv_heads=2, bias="qkv", rope_base=1e6)),
    ("keras-hub-qwen3", _cfg(n_kv_heads=2, d_k=8, qk_norm="head", norm_eps=1e-6)),
    ("keras-hub-phi3", _cfg(n_kv_heads=2)),
    ("keras-hub-gpt-oss", _cfg(n_kv_heads=2, d_k=8, bias=True, sinks=True)),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]


@pytest.mark.parametrize(("layout", "cfg"), CASES, ids=IDS)
def test_keras_hub_layer_is_the_spec_of_what_from_module_read(layout, cfg):
    layer = FAMILIES[layout].build(cfg)
    assert from_module(layer).cfg == cfg  # every field read back: heads, widths, bias, rotary, scale, window...
    x = np.random.default_rng(1).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(layer, x)
    assert run.precision == "float32" and "rotary angles in float32" in run.note  # the declared level, its cause
    assert ("RMSNorm" in run.note) == (cfg.qk_norm is not None)
    expected = reference_mha(read_cfg, params, x)
    np.testing.assert_allclose(run.output, expected, atol=TOL.atol, rtol=TOL.rtol)
    assert np.abs(run.output - expected).max() > 0  # a float64 layer, but float32 angles and softmax
    # its cache [B, 2, S, G, d] (Gemma 3: a tuple), one token a call at cache_update_index t: the causal spec's rows
    for t, step in enumerate(decode_steps(layer, x, read_cfg.window)):
        np.testing.assert_allclose(step, expected[:, t], atol=TOL.atol, rtol=TOL.rtol)


@pytest.mark.parametrize(("layout", "cfg"), CASES[::2], ids=IDS[::2])
def test_to_module_round_trips_exactly(layout, cfg):
    cfg, params = from_module(FAMILIES[layout].build(cfg))
    other = to_module(cfg, params, FAMILIES[layout].build(cfg, seed=7))
    back = from_module(other).params
    for name, array in params.as_dict().items():
        if array is not None:
            np.testing.assert_array_equal(getattr(back, name), array, err_msg=name)


def test_kernels_keep_the_head_axis_gemma_first():
    cfg = _cfg(n_kv_heads=2, d_k=8, scale=8**-0.5)
    layer = FAMILIES["keras-hub-gemma"].build(cfg)
    params = from_module(layer).params
    kernel = np.asarray(layer.query_dense.kernel)  # "btd,ndh->btnh": (H, E, d)
    assert kernel.shape == (4, 16, 8)
    # canonical w_q (H*d, E), row h*d + i, column e: head h's feature i of input e
    assert params.w_q[2 * 8 + 5, 11] == kernel[2, 11, 5]
    llama = FAMILIES["keras-hub-llama"].build(_cfg(n_kv_heads=2))
    state = get_layout("keras-hub-llama").to_state_dict(*from_module(llama))
    assert state["query/kernel"].shape == (16, 4, 4) and state["key/kernel"].shape == (16, 2, 4)  # "bqm,muh->bquh"
    assert state["attention_output/kernel"].shape == (4, 4, 16)


def test_gemma3_norm_stores_scale_minus_one():
    cfg = _cfg(n_kv_heads=2, d_k=8, qk_norm="head", norm_eps=1e-6)
    layer = FAMILIES["keras-hub-gemma3"].build(cfg)
    stored = np.asarray(layer.query_norm.scale)
    np.testing.assert_array_equal(from_module(layer).params.q_norm, stored + 1.0)  # RMSNorm multiplies by 1 + scale


def test_qwen2_window_is_not_applied_on_the_fused_path_and_is_read_so():
    from keras_hub.src.models.qwen.qwen_attention import QwenAttention

    layer = QwenAttention(4, 2, use_sliding_window_attention=True, sliding_window_size=3, dtype="float64")
    layer.build((None, None, 16))
    cfg, params = from_module(layer)
    assert cfg.window is None  # JAX takes ops.dot_product_attention with the causal mask alone
    x = np.random.default_rng(2).standard_normal((1, 7, 16))
    run = run_module(layer, x)[0]
    np.testing.assert_allclose(run.output, reference_mha(cfg, params, x), atol=TOL.atol, rtol=TOL.rtol)
    assert any("known difference" in note for note in get_layout("keras-hub-qwen2").notes)
    with pytest.raises(LayoutError, match="window"):
        get_layout("keras-hub-qwen2").require(_cfg(n_kv_heads=2, bias="qkv", window=3))


def test_unreadable_settings_are_refused_naming_them():
    from keras_hub.src.models.gpt_oss.gpt_oss_attention import GptOssAttention
    from keras_hub.src.models.llama.llama_attention import LlamaAttention
    from keras_hub.src.models.phi3.phi3_attention import Phi3Attention

    su = Phi3Attention(
        4,
        2,
        rope_scaling_type="su",
        rope_scaling_short_factor=[1.0, 2.0],
        rope_scaling_long_factor=[1.0, 3.0],
        dtype="float64",
    )
    su.build((None, None, 16))
    with pytest.raises(LayoutError, match="Phi3SuScaledRotaryEmbedding"):
        from_module(su)
    yarn = GptOssAttention(4, 2, head_dim=8, rope_scaling_factor=32.0, dtype="float64")
    yarn.build((None, None, 16))
    with pytest.raises(LayoutError, match=r"rope_type='yarn', scaling_factor=32.0"):
        from_module(yarn)
    dropout = LlamaAttention(4, 2, dropout=0.1, dtype="float64")
    dropout.build((None, None, 16))
    with pytest.raises(LayoutError, match="dropout"):
        from_module(dropout)
    with pytest.raises(LayoutError, match="not built"):
        from_module(LlamaAttention(4, 2))


def test_to_module_refuses_a_layer_built_for_another_configuration():
    cfg, params = from_module(FAMILIES["keras-hub-mistral"].build(_cfg(n_kv_heads=2, d_k=8, window=3)))
    other = FAMILIES["keras-hub-mistral"].build(_cfg(n_kv_heads=2, d_k=8, window=5))
    with pytest.raises(LayoutError, match="window: module 5, given 3"):
        to_module(cfg, params, other)


TORCH_SCRIPT = """
import json, os, numpy as np
from mha_rosetta.core import MHAConfig, reference_mha
from mha_rosetta.models import from_module, to_module
from mha_rosetta.models.decode_steps import decode_steps
from mha_rosetta.models.keras_hub import FAMILIES
from mha_rosetta.models.real_modules import run_module
import keras
out = {"backend": keras.backend.backend()}
x = np.random.default_rng(1).standard_normal((2, 7, 16))
base = dict(d_model=16, n_heads=4, n_kv_heads=2, d_k=8, bias=False, causal=True, rope="half")
for name, extra in [("keras-hub-gemma3", dict(qk_norm="head", norm_eps=1e-6, window=4)), ("keras-hub-mistral", dict(window=3)),
                    ("keras-hub-gpt-oss", dict(bias=True, sinks=True))]:
    cfg = MHAConfig(**{**base, **extra})
    layer = FAMILIES[name].build(cfg)
    run, read, params = run_module(layer, x)
    ref = reference_mha(read, params, x)
    steps = decode_steps(layer, x, read.window)
    back = from_module(to_module(read, params, FAMILIES[name].build(cfg, seed=3))).params
    out[name] = {"same": read == cfg, "error": float(np.abs(run.output - ref).max()),
                 "decode": max(float(np.abs(s - ref[:, t]).max()) for t, s in enumerate(steps)),
                 "exact": all(np.array_equal(a, getattr(back, k)) for k, a in params.as_dict().items() if a is not None)}
print(json.dumps(out))
"""


def test_on_keras_torch_backend_in_a_subprocess():
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", TORCH_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.pop("backend") == "torch"
    for name, case in result.items():
        assert case["same"] and case["exact"], name
        assert 0 < case["error"] < TOL.atol and case["decode"] < TOL.atol, (name, case)


def test_llama_position_scaling_factor_is_ignored_by_keras_hub_and_read_so():
    from keras_hub.src.models.llama.llama_attention import LlamaAttention

    layer = LlamaAttention(4, 2, rope_position_scaling_factor=4.0, dtype="float64")
    layer.build((None, None, 16))
    cfg, params = from_module(layer)
    assert cfg.rope_scaling is None  # LlamaRotaryEmbedding's _get_inverse_freq never divides by it
    x = np.random.default_rng(3).standard_normal((1, 7, 16))
    run = run_module(layer, x)[0]
    np.testing.assert_allclose(run.output, reference_mha(cfg, params, x), atol=TOL.atol, rtol=TOL.rtol)
    linear = reference_mha(replace(cfg, rope_scaling={"rope_type": "linear", "factor": 4.0}), params, x)
    assert np.abs(run.output - linear).max() > 1e-3  # what a reader of the argument would have predicted: not it
