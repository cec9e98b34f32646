"""``Llama4TextAttention`` (transformers 5.25) read by `from_module` and loaded by `to_module`: both layer kinds.

Tiny configs, float64 modules, random weights (`init_params`), built as `models.hf_llama4.build` builds them.
The rotary layer multiplies in complex64 and normalises in float32, the NoPE layer's temperature factors are
float32: those runs are held to float32 with the cause named; a NoPE layer without the temperature is float64
throughout, and is held to float64. The decode run steps the module through its own cache, one token a call,
so the temperature's positions come from the cache's length.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha
from mha_rosetta.models import LayoutError, from_module, get_layout, to_module

pytestmark = [requires("torch"), requires("transformers")]

LAYER = dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, bias=False)
KINDS = {
    "rotary-chunked-norm": dict(
        LAYER, rope="interleaved", attention_chunk_size=4, qk_norm_after_rope=True, norm_eps=1e-5
    ),
    "nope-temperature": dict(LAYER, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5),
    "nope": dict(LAYER),
    "rotary-bias": dict(LAYER, bias=True, rope="interleaved"),
}


def _module(cfg):
    from mha_rosetta.models._real import RunOptions
    from mha_rosetta.models.hf_llama4 import build

    return build(cfg, RunOptions())


def _x(tokens: int = 9) -> np.ndarray:
    return np.random.default_rng(11).standard_normal((2, tokens, 24))


@pytest.mark.parametrize("kind", list(KINDS))
def test_from_module_reads_each_layer_kind_and_to_module_round_trips_exactly(kind):
    cfg = MHAConfig(**KINDS[kind])
    params = init_params(cfg, seed=12)
    module = to_module(cfg, params, _module(cfg))
    read_cfg, read_params = from_module(module)
    assert read_cfg == cfg
    for name, value in params.as_dict().items():
        assert np.array_equal(getattr(read_params, name), value), name
    # The state dict the layout writes is the module's own, exactly.
    state = get_layout("hf-llama4").to_state_dict(cfg, params)
    own = {name: tensor.numpy() for name, tensor in module.state_dict().items()}
    assert set(state) == set(own) and all(np.array_equal(state[name], own[name]) for name in state)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_module_computes_the_spec(kind, implementation):
    from mha_rosetta.models.real_modules import run_module

    cfg = MHAConfig(**KINDS[kind])
    params = init_params(cfg, seed=13)
    module = to_module(cfg, params, _module(cfg))
    run, read_cfg, read_params = run_module(module, _x(), implementation=implementation)
    expected = reference_mha(read_cfg, read_params, _x())
    assert f"({implementation}, " in run.module
    if kind == "nope":  # the softmax keeps float64 on both paths here: nothing runs in float32
        assert run.precision == "float64" and run.note == ""
    else:
        assert run.precision == "float32"
        causes = {"complex64": cfg.rope is not None, "float32 (Llama4TextWeightless": cfg.qk_norm_after_rope}
        causes["temperature's factors are float32"] = cfg.attn_temperature_tuning
        assert {cause for cause, named in causes.items() if named} == {c for c in causes if c in run.note}
    assert_close(run.output, expected, run.precision)


def test_the_spec_without_its_llama4_steps_misses_the_module():
    """Each form changes the module's output beyond float32 rounding: the chunk, the norm, the temperature."""
    from mha_rosetta.models.real_modules import run_module

    x = _x()
    for kind, off in (
        ("rotary-chunked-norm", dict(attention_chunk_size=None)),
        ("rotary-chunked-norm", dict(qk_norm_after_rope=False)),
        ("nope-temperature", dict(attn_temperature_tuning=False)),
    ):
        cfg = MHAConfig(**KINDS[kind])
        params = init_params(cfg, seed=14)
        run, _, _ = run_module(to_module(cfg, params, _module(cfg)), x)
        assert np.abs(run.output - reference_mha(MHAConfig(**dict(KINDS[kind], **off)), params, x)).max() > 1e-3


@pytest.mark.parametrize("kind", ["nope-temperature", "rotary-bias"])
def test_decoding_through_the_modules_cache_matches_the_full_forward(kind):
    """One token a call through a DynamicCache: the temperature's positions are the cache's length (the offset)."""
    from mha_rosetta.models.decode_steps import decode_steps

    cfg = MHAConfig(**KINDS[kind])
    params = init_params(cfg, seed=15)
    x = _x(7)
    steps = np.stack(decode_steps(to_module(cfg, params, _module(cfg)), x), axis=1)  # (B, T, E)
    assert_close(steps, reference_mha(cfg, params, x), "float32")


def test_configurations_the_module_cannot_hold_are_refused_by_name():
    layout = get_layout("hf-llama4")
    with pytest.raises(LayoutError, match="NoPE layers attend fully"):
        layout.require(MHAConfig(**LAYER, attention_chunk_size=4))
    with pytest.raises(LayoutError, match="qk_norm_after_rope"):
        layout.require(MHAConfig(**LAYER, rope="interleaved", qk_norm="head"))
    with pytest.raises(LayoutError, match="rope='interleaved' or None"):
        layout.require(MHAConfig(**LAYER, rope="half"))
    with pytest.raises(LayoutError, match="tempers its NoPE layers only"):
        layout.require(MHAConfig(**LAYER, rope="interleaved", attn_temperature_tuning=True))
    with pytest.raises(LayoutError, match="floor_scale"):
        layout.require(MHAConfig(**LAYER, attn_temperature_tuning=True, floor_scale=2.5))


def test_a_padding_mask_on_a_chunked_layer_is_refused_with_the_reason():
    """create_chunked_causal_mask starts chunks after left padding; the spec's chunks are on the positions."""
    from mha_rosetta.models.real_modules import run_module

    cfg = MHAConfig(**KINDS["rotary-chunked-norm"])
    module = to_module(cfg, init_params(cfg, seed=16), _module(cfg))
    padding = np.ones((2, 9), dtype=bool)
    padding[1, :2] = False  # left padding of row 1
    with pytest.raises(ValueError, match="starts the chunks after any left padding"):
        run_module(module, _x(), padding)
