"""mlx-lm's rope-scaling classes read by `from_module`: ``Llama3RoPE`` and ``YarnRoPE`` keep only their frequency
table (``_freqs``) and YaRN's ``mscale``, so the reader takes ``rope_theta`` and ``rope_scaling`` from the model
args the instance is given and proves the reading on that table (`models._mlx_io._table_rope`).

The modules are mlx-lm's own, built by ``initialize_rope`` from ModelArgs (``MlxFamily.build`` gives the instance
its args, as a port does with ``attention.args = model.args``), float64 parameters on the CPU stream: mlx's
exp/sin/cos are float32-accurate there, and mlx-lm computes the table in float32, so both are held to float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, reference_mha, tolerance_for
from mha_rosetta.core.rope_scaling import scaled_frequencies
from mha_rosetta.models import LayoutError, from_module, get_layout, to_module

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'mha-rosetta[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'mha-rosetta[mlx]'")

from mha_rosetta.models.mlx_lm import FAMILIES
from mha_rosetta.models.real_modules import run_module

# d_k 16 (8 pairs), base 10000: the wavelengths 2 pi base**(2i/16) are 6.3, 20, 63, 199, 628, 1987, 6283, 19869, so
# with L = 2048, low 1 and high 4 pairs 0-3 keep their frequency, 4-5 are blended and 6-7 divided by the factor
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 2048,
}
# L = 64: the correction range is pairs 0..3 (floor(d(32)) < 0, ceil(d(1)) = 3); attention factor 0.1 ln 4 + 1
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# DeepSeek's pair: m(4, 1) / m(4, 0.5) on cos and sin
YARN_MSCALE = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0}


def _cfg(**fields) -> MHAConfig:
    return MHAConfig(
        **{"d_model": 16, "n_heads": 2, "d_k": 16, "bias": False, "causal": True, "rope": "half", **fields}
    )


CASES = [
    ("mlx-llama", _cfg(rope_scaling=LLAMA3)),
    ("mlx-llama", _cfg(n_kv_heads=1, rope="interleaved", rope_base=500000.0, rope_scaling=LLAMA3)),
    ("mlx-llama", _cfg(rope_scaling=YARN)),
    ("mlx-llama", _cfg(rope="interleaved", rope_scaling=YARN_MSCALE)),
    ("mlx-gpt-oss", _cfg(n_kv_heads=1, bias=True, sinks=True, rope_base=150000.0, rope_scaling=YARN)),
    ("mlx-qwen3", _cfg(qk_norm="head", rope_scaling=YARN)),
]
IDS = [f"{name}-{cfg.rope_scaling['rope_type']}-{i}" for i, (name, cfg) in enumerate(CASES)]


@pytest.mark.parametrize(("layout", "cfg"), CASES, ids=IDS)
def test_the_scaled_module_is_the_spec_of_what_from_module_read(layout, cfg):
    module = FAMILIES[layout].build(cfg)
    kind = type(module.rope).__name__
    assert kind == {"llama3": "Llama3RoPE", "yarn": "YarnRoPE"}[cfg.rope_scaling["rope_type"]]
    spec = from_module(module)
    assert spec.cfg == cfg  # the base and the whole scaling dict, recovered from the args and proved on _freqs
    x = np.random.default_rng(3).standard_normal((2, 7, cfg.d_model))
    run, read_cfg, params = run_module(module, x)
    assert run.precision == "float32" and "float32-accurate" in run.note
    tol = tolerance_for("float32")
    np.testing.assert_allclose(run.output, reference_mha(read_cfg, params, x), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize(("layout", "cfg"), CASES[::2], ids=IDS[::2])
def test_to_module_round_trips_exactly(layout, cfg):
    cfg, params = from_module(FAMILIES[layout].build(cfg))
    back = from_module(to_module(cfg, params, FAMILIES[layout].build(cfg))).params
    for name, array in params.as_dict().items():
        if array is not None:
            assert np.array_equal(getattr(back, name), array), name


def test_the_table_is_the_spec_frequencies_and_yarn_mscale_its_attention_factor():
    cfg = CASES[2][1]
    rope = FAMILIES["mlx-llama"].build(cfg).rope
    expected, attention = scaled_frequencies(16, 10000.0, YARN, 1)
    table = 1.0 / np.array(rope._freqs, dtype=np.float64)  # mx.fast.rope turns pair i by position / freqs[i]
    np.testing.assert_allclose(table, expected, rtol=1e-6)
    assert rope.mscale == pytest.approx(attention, rel=1e-12) and attention == pytest.approx(0.1 * np.log(4) + 1)
    # llama3: the three bands, by hand: pairs 0-3 kept, 6-7 divided by 8, 4-5 in between
    llama3 = 1.0 / np.array(FAMILIES["mlx-llama"].build(CASES[0][1]).rope._freqs, dtype=np.float64)
    plain = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(llama3[:4], plain[:4], rtol=1e-6)
    np.testing.assert_allclose(llama3[6:], plain[6:] / 8, rtol=1e-6)
    assert np.all(llama3[4:6] < plain[4:6]) and np.all(llama3[4:6] > plain[4:6] / 8)


def test_mlx_lm_defaults_fill_the_keys_the_args_leave_out():
    from mlx_lm.models.rope_utils import initialize_rope

    module = FAMILIES["mlx-llama"].build(CASES[2][1])
    # a DeepSeek-style dict: its own type name, the legacy "type" key, no original_max_position_embeddings
    module.args.rope_scaling = {"type": "deepseek_yarn", "factor": 4.0}
    module.rope = initialize_rope(16, 10000.0, False, module.args.rope_scaling, 4096)
    scaling = from_module(module).cfg.rope_scaling
    assert scaling["rope_type"] == "yarn" and scaling["original_max_position_embeddings"] == 4096  # YarnRoPE's own


def test_without_model_args_the_table_is_refused_naming_the_class():
    module = FAMILIES["mlx-llama"].build(CASES[0][1])
    module.args = None
    with pytest.raises(
        LayoutError,
        match=r"^mlx_lm\.models\.llama\.Attention has rope mlx_lm\.models\.rope_utils\.Llama3RoPE.*_freqs.*"
        r"attention\.args = model\.args",
    ):
        from_module(module)


def test_args_that_do_not_build_the_table_are_refused_with_both_numbers():
    module = FAMILIES["mlx-llama"].build(CASES[0][1])
    module.args.rope_scaling = {**LLAMA3, "factor": 4.0}  # the rope was built with factor 8
    with pytest.raises(LayoutError, match=r"Llama3RoPE whose table is not llama3\(factor=4.*off the spec's"):
        from_module(module)
    module.args.rope_scaling = {**LLAMA3, "rope_type": "yarn"}
    with pytest.raises(LayoutError, match=r"rope_scaling is .*'yarn'.*not a llama3 one"):
        from_module(module)


def test_what_yarn_rope_does_not_read_is_refused_not_assumed():
    # YarnRoPE reads no attention_factor: its mscale stays m(4), where Hugging Face would use 1.5
    module = FAMILIES["mlx-llama"].build(CASES[2][1])
    module.args.rope_scaling = {**YARN, "attention_factor": 1.5}
    with pytest.raises(LayoutError, match=r"factor on the rotated features is 1\.13863, the spec's 1\.5"):
        from_module(module)
    # and always truncates the correction range: the layout refuses to build truncate=False
    cfg = _cfg(rope_scaling={**YARN, "truncate": False})
    rules = [rule(cfg) for rule in get_layout("mlx-llama").rules]
    assert any(reason and "always truncates" in reason for reason in rules)


def _hf_llama(cfg: MHAConfig):
    """Hugging Face's LlamaAttention for ``cfg`` (float64, eager, torch's own random weights)."""
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'mha-rosetta[models]'")
    from mha_rosetta.models._real import RunOptions
    from mha_rosetta.models.hf_llama import DECODER

    return DECODER.build(cfg, RunOptions())


@pytest.mark.parametrize("scaling", [LLAMA3, YARN_MSCALE], ids=["llama3", "yarn"])
def test_hf_llama_against_mlx_lm_scaled_rope_agrees_forward_and_decode(scaling):
    from mha_rosetta.diagnose.compare import compare

    hf = _hf_llama(_cfg(n_kv_heads=1, rope_scaling=scaling))
    port = FAMILIES["mlx-llama"].build(from_module(hf).cfg)
    result = compare(hf, port, decode=True)  # mlx-lm's KVCache, its rope at the cache's offset
    assert result.differences == [] and result.agrees and result.first_decode_step is None


def test_a_port_that_scales_llama3_linearly_is_named():
    from mlx_lm.models.rope_utils import initialize_rope

    from mha_rosetta.diagnose.compare import compare

    hf = _hf_llama(_cfg(rope_scaling=LLAMA3))
    port = FAMILIES["mlx-llama"].build(from_module(hf).cfg)
    port.rope = initialize_rope(16, 10000.0, False, {"rope_type": "linear", "factor": 8.0})  # nn.RoPE(scale=1/8)
    result = compare(hf, port)
    assert [d.name for d in result.differences] == ["rope_scaling"] and not result.agrees
    assert result.stage == "q_rotated"


# -- longrope (Phi-3's 128k models): mlx-lm's SuScaledRoPE against Hugging Face's Phi-3 ------------------------------
# 16 features a head (8 pairs), original length 4, max positions 16 (factor 4): the 7-token inputs are past 4
SHORT = [1.0, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0]
LONG = [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0]


def _phi3(**fields) -> MHAConfig:
    """d_model 32, 2 heads of 16 (head_dim = hidden_size // heads, as Phi-3 computes it), 1 kv head."""
    return _cfg(d_model=32, n_kv_heads=1, **fields)


def _longrope(short, long, **extra) -> dict:
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long, "original_max_position_embeddings": 4,
            "factor": 4.0, **extra}  # fmt: skip


def test_su_scaled_rope_is_read_as_longrope_with_its_long_table_at_every_length():
    cfg = _phi3(rope_scaling=_longrope(LONG, LONG))
    module = FAMILIES["mlx-phi3"].build(cfg)
    assert type(module.rope).__name__ == "SuScaledRoPE"
    assert from_module(module).cfg == cfg  # the long table twice, the factor from max_position_embeddings / 4
    # its factor on the rotated features is sqrt(1 + ln 4 / ln 4) = sqrt(2), the spec's attention factor
    assert module.rope._scale == pytest.approx(np.sqrt(2), rel=1e-15)
    tol = tolerance_for("float32")
    for tokens in (3, 7):  # below the original length too: SuScaledRoPE turns by the long table there as well
        x = np.random.default_rng(tokens).standard_normal((2, tokens, cfg.d_model))
        run, read_cfg, params = run_module(module, x)
        assert run.precision == "float32" and "float32-accurate" in run.note
        expected = reference_mha(read_cfg, params, x)
        np.testing.assert_allclose(run.output, expected, atol=tol.atol, rtol=tol.rtol)
        short_cfg = MHAConfig(**{**cfg.__dict__, "rope_scaling": _longrope(SHORT, LONG)})  # Hugging Face's tables
        assert not np.allclose(run.output, reference_mha(short_cfg, params, x), atol=1e-3) or tokens > 4
    back = from_module(to_module(*from_module(module), FAMILIES["mlx-phi3"].build(cfg))).params
    for name, array in params.as_dict().items():
        if array is not None:
            assert np.array_equal(getattr(back, name), array), name


def test_su_scaled_rope_with_a_long_mscale_is_refused_with_both_factors():
    from mlx_lm.models.rope_utils import SuScaledRoPE

    module = FAMILIES["mlx-phi3"].build(_phi3(rope_scaling=_longrope(LONG, LONG)))
    module.rope = SuScaledRoPE(16, 10000.0, 16, 4, LONG, LONG, long_mscale=1.25)  # not what phi3.Attention builds
    with pytest.raises(LayoutError, match=r"SuScaledRoPE whose factor on the rotated features is 1\.25.* 1\.41421"):
        from_module(module)
    module.args = None
    with pytest.raises(LayoutError, match=r"SuScaledRoPE.*attention\.args = model\.args"):
        from_module(module)


def test_what_su_scaled_rope_cannot_compute_is_refused_by_the_layout():
    rules = get_layout("mlx-phi3").rules
    reasons = [rule(_phi3(rope_scaling=_longrope(SHORT, LONG))) for rule in rules]
    assert any(r and "turns by long_factor at every length" in r for r in reasons)
    reasons = [rule(_phi3(rope_scaling=_longrope(LONG, LONG, attention_factor=1.2))) for rule in rules]
    assert any(r and "reads no attention_factor" in r for r in reasons)
    # the other families do not build longrope (initialize_rope could, but their ModelArgs are not Phi-3's)
    reasons = [rule(_cfg(rope_scaling=_longrope(LONG, LONG))) for rule in get_layout("mlx-llama").rules]
    assert any(r and "'longrope'" in r for r in reasons)


def _hf_phi3(cfg: MHAConfig):
    """Hugging Face's Phi3Attention for ``cfg`` (float64, eager), loaded with the spec's random parameters."""
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'mha-rosetta[models]'")
    from mha_rosetta.core import init_params
    from mha_rosetta.models._real import RunOptions
    from mha_rosetta.models.hf_phi3 import build

    return to_module(cfg, init_params(cfg, seed=4), build(cfg, RunOptions()))


def test_hf_phi3_against_mlx_lm_longrope_agrees_past_the_original_length_and_names_the_table_below():
    from mha_rosetta.diagnose.compare import compare

    hf = _hf_phi3(_phi3(rope_scaling=_longrope(SHORT, LONG)))
    port = FAMILIES["mlx-phi3"].build(_phi3(rope_scaling=_longrope(LONG, LONG)))
    x = np.random.default_rng(5).standard_normal((2, 7, 32))
    long = compare(hf, port, x=x)  # 7 tokens > 4: both turn by the long table
    assert [d.name for d in long.differences] == ["rope_scaling"] and long.agrees
    short = compare(hf, port, x=x[:, :3], decode=True)  # 3 tokens: Hugging Face's short table, mlx-lm's long one
    assert not short.agrees and short.stage == "q_rotated"
    assert short.causes and "long table at every length" in short.causes[0].detail  # diagnose's longrope cause
    # decode: position 0 turns by nothing (one key: the same output); position 1 is the first that differs
    assert short.first_decode_step == 1
