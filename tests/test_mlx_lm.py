"""mlx-lm's Attention classes read by `from_module`: each real module's own forward is the spec of what was read.

The modules are mlx-lm's own (mlx_lm/models/<family>.py), built tiny from their ModelArgs, random weights, cast
to float64 and run on the CPU stream with mlx-lm's own mask convention (``mask="causal"``). mlx's exp/sin/cos are
float32-accurate in float64 (backends/frameworks/mlx.py), so the runs are held to float32's tolerance, and the
runs say so.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, reference_mha, tolerance_for
from mha_rosetta.models import LayoutError, from_module, get_layout, to_module

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'mha-rosetta[mlx]'")

from mha_rosetta.models.mlx_lm import FAMILIES
from mha_rosetta.models.real_modules import run_module


def _cfg(**fields) -> MHAConfig:
    """A tiny causal configuration: d_model 16, 4 heads, no biases, rotate-half, unless ``fields`` say otherwise."""
    return MHAConfig(**{"d_model": 16, "n_heads": 4, "bias": False, "causal": True, "rope": "half", **fields})


CASES = [
    ("mlx-llama", _cfg(n_kv_heads=2, d_k=8, bias=True, rope="interleaved")),
    ("mlx-llama", _cfg(n_kv_heads=2, d_k=6)),
    ("mlx-llama", _cfg(d_k=8, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # dynamic NTK: L = 4 < the 7 tokens, so the base grows
    (
        "mlx-llama",
        _cfg(
            d_k=8,
            rope="interleaved",
            rope_base=500.0,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4},
        ),
    ),
    ("mlx-qwen2", _cfg(n_kv_heads=2, bias="qkv")),
    ("mlx-qwen2", _cfg(bias="qkv", rope="interleaved", rope_base=1e6)),
    ("mlx-qwen3", _cfg(n_kv_heads=2, d_k=8, qk_norm="head")),
    ("mlx-olmo2", _cfg(n_kv_heads=2, d_k=8, qk_norm="projection")),
    # Gemma's scale: query_pre_attn_scalar**-0.5 with query_pre_attn_scalar = 32, not head_dim = 8
    ("mlx-gemma3", _cfg(n_kv_heads=1, d_k=8, qk_norm="head", scale=32**-0.5, norm_eps=1e-6)),
    # Phi-3: one qkv_proj [Q; K; V]; partial_rotary_factor 0.5 rotates the first 4 of 8 features
    ("mlx-phi3", _cfg(d_model=32, n_kv_heads=2, rope_dims=4)),
    ("mlx-phi3", _cfg(rope="interleaved")),
    # Gemma 2: softcap 5 (small, so the tiny scores reach its curve), query_pre_attn_scalar 16
    ("mlx-gemma2", _cfg(n_kv_heads=2, d_k=8, softcap=5.0, scale=16**-0.5)),
    ("mlx-gpt-oss", _cfg(n_kv_heads=2, d_k=8, bias=True, sinks=True)),
]


@pytest.mark.parametrize(("layout", "cfg"), CASES, ids=[f"{name}-{i}" for i, (name, _) in enumerate(CASES)])
def test_mlx_lm_module_is_the_spec_of_what_from_module_read(layout, cfg):
    module = FAMILIES[layout].build(cfg)
    spec = from_module(module)
    assert spec.cfg == cfg  # every field read back: heads, widths, bias, rotary convention, base, scaling, QK-norm
    x = np.random.default_rng(1).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(module, x)
    assert run.precision == "float32" and "float32-accurate" in run.note  # the declared level, with its cause
    expected = reference_mha(read_cfg, params, x)
    tol = tolerance_for("float32")
    np.testing.assert_allclose(run.output, expected, atol=tol.atol, rtol=tol.rtol)
    assert np.abs(run.output - expected).max() > 0  # float64 arithmetic, but not bit-identical: exp/sin/cos


@pytest.mark.parametrize(("layout", "cfg"), CASES[::2], ids=[name for name, _ in CASES[::2]])
def test_to_module_round_trips_exactly(layout, cfg):
    cfg, params = from_module(FAMILIES[layout].build(cfg))
    other = to_module(cfg, params, FAMILIES[layout].build(cfg))
    back = from_module(other).params
    for name, array in params.as_dict().items():
        if array is not None:
            assert np.array_equal(getattr(back, name), array), name


def test_the_traditional_flag_is_the_rotary_convention():
    cfg = CASES[0][1]
    interleaved = FAMILIES["mlx-llama"].build(cfg)
    half = FAMILIES["mlx-llama"].build(replace(cfg, rope="half"))
    assert interleaved.rope.traditional and from_module(interleaved).cfg.rope == "interleaved"
    assert not half.rope.traditional and from_module(half).cfg.rope == "half"


def test_classes_are_told_apart_by_their_file():
    layouts = {get_layout(name).reader.classes[0] for name in FAMILIES}
    families = ("llama", "qwen2", "qwen3", "olmo2", "gemma3_text", "phi3", "gemma2")
    blocks = {"mlx_lm.models.gpt_oss.AttentionBlock", "mlx_lm.models.qwen3_next.Qwen3NextAttention"}
    assert layouts == {f"mlx_lm.models.{family}.Attention" for family in families} | blocks


def test_phi3_fused_rows_are_q_then_k_then_v():
    cfg = next(cfg for name, cfg in CASES if name == "mlx-phi3")  # d_model 32, rope_dims 4
    module = FAMILIES["mlx-phi3"].build(cfg)
    fused = np.array(module.qkv_proj.weight)  # (H*d + 2*G*d, E) = (32 + 16 + 16, 32)
    params = from_module(module).params
    assert np.array_equal(fused[:32], params.w_q) and np.array_equal(fused[32:48], params.w_k)
    assert np.array_equal(fused[48:], params.w_v) and module.rope.dims == 4


def test_gemma3_norm_stores_w_for_one_plus_w():
    cfg = next(cfg for name, cfg in CASES if name == "mlx-gemma3")
    module = FAMILIES["mlx-gemma3"].build(cfg)
    spec = from_module(module)
    stored = np.array(module.q_norm.weight)
    assert np.array_equal(spec.params.q_norm, stored + 1.0)  # mx.fast.rms_norm(x, 1.0 + weight, eps)


def test_a_scaling_whose_module_keeps_only_frequencies_is_refused_naming_it():
    from mlx_lm.models.rope_utils import initialize_rope

    module = FAMILIES["mlx-llama"].build(CASES[1][1])
    # Gemma 4's proportional rope keeps the table of the pairs that turn, not partial_rotary_factor
    module.rope = initialize_rope(6, 10000.0, False, {"rope_type": "proportional", "partial_rotary_factor": 0.5}, 64)
    with pytest.raises(
        LayoutError,
        match=r"^mlx_lm\.models\.llama\.Attention has rope mlx_lm\.models\.rope_utils\.ProportionalRoPE.*_freqs",
    ):
        from_module(module)
    # Phi-3's longrope (SuScaledRoPE) is read from the model args (tests/test_mlx_lm_rope_scaling.py): these say none
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 32}
    longrope.update(short_factor=[1.0, 1.0, 1.0], long_factor=[1.0, 2.0, 4.0])
    module.rope = initialize_rope(6, 10000.0, False, longrope, 64)
    with pytest.raises(LayoutError, match=r"SuScaledRoPE, which the spec cannot express: .* not a longrope one"):
        from_module(module)


def test_a_rope_subclass_is_refused_it_may_compute_otherwise():
    import mlx.nn as nn

    class RoPE(nn.RoPE):  # a port's rope that ignores the cache's offset: the forward is right, decode is not
        def __call__(self, x, offset=0):
            return super().__call__(x)

    module = FAMILIES["mlx-qwen3"].build(next(cfg for name, cfg in CASES if name == "mlx-qwen3"))
    module.rope = RoPE(8)
    with pytest.raises(
        LayoutError, match=r"^mlx_lm\.models\.qwen3\.Attention has rope test_mlx_lm\..*RoPE, .*reads the classes"
    ):
        from_module(module)


def test_a_padding_mask_is_refused_with_the_reason():
    module = FAMILIES["mlx-qwen2"].build(CASES[4][1])
    with pytest.raises(ValueError, match="padding only through a batched cache"):
        run_module(module, np.zeros((1, 3, 16)), padding=np.ones((1, 3), dtype=bool))
