"""``from_module``/``to_module`` on transformers' real ``Qwen3NextAttention`` (layout ``hf-qwen3-next``).

A tiny float64 module with random weights (GQA, biases, partial rotary, QK-norm stored as offsets): read into
the spec, run as its own model runs it (held to float32, the RMSNorm's cast named), proved in float64 once the
norm keeps float64, loaded back exactly, and a port that reads ``q_proj``'s gate as its second half caught by
``diagnose``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends._probe import import_failure, importable
from mha_rosetta.core import MHAConfig, MHAParams, assert_close, reference_mha
from mha_rosetta.core.variants import fuse_gated_q
from mha_rosetta.models import from_module, get_layout, to_module
from mha_rosetta.models.real_modules import run_module

for _module in ("torch", "transformers"):
    if not importable(_module):
        pytest.skip(f"the real Qwen3NextAttention needs {_module}: {import_failure(_module)}", allow_module_level=True)

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, TOKENS = 24, 4, 2, 8, 6
PARTIAL = 0.25  # transformers' default: int(8 * 0.25) = 2 rotated features per head


def _module(bias: bool = True, dtype=None):
    """A real ``Qwen3NextAttention`` (layer 3: Qwen3-Next's first full-attention layer), random weights; norm weights
    float32-representable, as a real checkpoint's (so 1 + w and (1 + w) - 1 are exact in float64)."""
    import torch
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

    sizes = dict(hidden_size=D_MODEL, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    config = Qwen3NextConfig(**sizes, partial_rotary_factor=PARTIAL, attention_bias=bias, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    module = Qwen3NextAttention(config, layer_idx=3).double().eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in module.parameters():  # HF zero-initialises the biases and the norms' offsets
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.3)
        for norm in (module.q_norm, module.k_norm):
            norm.weight.copy_(norm.weight.float().double())
    return module if dtype is None else module.to(dtype)


def _x(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, TOKENS, D_MODEL))


def test_the_real_module_is_read_with_its_gate_partial_rotary_and_offset_norms():
    module = _module()
    cfg, params = from_module(module)
    sizes = dict(d_model=D_MODEL, n_heads=HEADS, n_kv_heads=KV_HEADS, d_k=HEAD_DIM, bias=True, causal=True)
    rotary = dict(rope="half", rope_dims=int(HEAD_DIM * PARTIAL), rope_base=cfg.rope_base)
    assert cfg == MHAConfig(**sizes, **rotary, qk_norm="head", norm_eps=1e-6, attn_output_gate=True)
    fused = module.q_proj.weight.detach().numpy()  # (H*2*d, E): head h's rows are [q_h | gate_h]
    per_head = fused.reshape(HEADS, 2, HEAD_DIM, D_MODEL)
    np.testing.assert_array_equal(params.w_q, per_head[:, 0].reshape(-1, D_MODEL))
    np.testing.assert_array_equal(params.w_gate, per_head[:, 1].reshape(-1, D_MODEL))
    np.testing.assert_array_equal(
        params.b_gate, module.q_proj.bias.detach().numpy().reshape(HEADS, 2, -1)[:, 1].ravel()
    )
    np.testing.assert_array_equal(params.q_norm, 1.0 + module.q_norm.weight.detach().numpy())  # stored w, used 1 + w


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_module_s_own_forward_is_the_spec_held_to_float32_with_the_cause_named(implementation):
    module = _module()
    x = _x()
    run, cfg, params = run_module(module, x, implementation=implementation)
    assert run.precision == "float32" and "Qwen3NextRMSNorm computes in float32" in run.note
    assert_close(run.output, reference_mha(cfg, params, x), "float32", what=f"Qwen3NextAttention ({implementation})")


def test_the_module_agrees_in_float64_once_its_norm_keeps_float64(monkeypatch):
    """The RMSNorm's x.float() is the one float32 step left on SDPA with the spec's float64 (cos, sin)."""
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    def norm64(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    module = _module()
    x = _x(seed=4)
    run, cfg, params = run_module(module, x, implementation="sdpa", float64_rotary=True)
    error_float32_norm = float(np.max(np.abs(run.output - reference_mha(cfg, params, x))))
    monkeypatch.setattr(modeling.Qwen3NextRMSNorm, "forward", norm64)
    run, cfg, params = run_module(module, x, implementation="sdpa", float64_rotary=True)
    assert_close(run.output, reference_mha(cfg, params, x), "float64", what="Qwen3NextAttention, float64 norm")
    assert error_float32_norm > 1e-10  # the float32 norm shows: if it no longer does, the note above is stale


def test_to_module_round_trips_exactly():
    import torch

    module = _module()
    before = {name: value.clone() for name, value in module.state_dict().items()}
    cfg, params = from_module(module)
    other = from_module(_module(bias=True).requires_grad_(False)).params  # the same shapes
    shifted = MHAParams(**{k: v + 0.25 for k, v in other.as_dict().items()})  # norms stay in [0.5, 2]: exact
    assert to_module(cfg, shifted, module) is module
    read = from_module(module).params.as_dict()
    assert all(np.array_equal(read[k], v) for k, v in shifted.as_dict().items())
    to_module(cfg, params, module)
    after = module.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_float32_module_reads_and_loads_back_in_float32():
    import torch

    module = _module(dtype=torch.float32)
    cfg, params = from_module(module)
    assert params.w_gate.dtype == np.float32 and params.q_norm.dtype == np.float64  # 1 + w: exact in float64
    before = {name: value.clone() for name, value in module.state_dict().items()}
    to_module(cfg, params, module)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_layout_that_cannot_hold_the_config_says_why():
    layout = get_layout("hf-qwen3-next")
    ungated = MHAConfig(
        d_model=D_MODEL, n_heads=HEADS, d_k=HEAD_DIM, bias=False, causal=True, rope="half", rope_dims=2, qk_norm="head"
    )
    assert "always gates its output" in layout.unsupported_reason(ungated)
    interleaved = MHAConfig(**{**layout.example, "d_model": 32, "n_heads": 4, "rope": "interleaved"})
    assert "rope='interleaved'" in layout.unsupported_reason(interleaved)


def test_diagnose_names_a_port_that_reads_the_gate_as_q_proj_s_second_half():
    """The bug on record (vllm #36242): a port that loads the real module's q_proj as ``chunk(2)`` of the whole
    projection. The port runs the spec on what it read; diagnose, given the module's true spec, names the gate."""
    from mha_rosetta.diagnose import diagnose

    module = _module()
    cfg, truth = from_module(module)
    state = {name: value.detach().numpy() for name, value in module.state_dict().items()}

    def ported(params, query, key, value, mask):  # the port's loader, given the checkpoint diagnose hands it
        fused = fuse_gated_q(params.w_q, params.w_gate, cfg.n_heads, cfg.d_k)  # what Qwen3NextAttention stores
        fused_b = fuse_gated_q(params.b_q, params.b_gate, cfg.n_heads, cfg.d_k)
        half = cfg.n_heads * cfg.d_k
        read = {"w_q": fused[:half], "w_gate": fused[half:], "b_q": fused_b[:half], "b_gate": fused_b[half:]}
        return reference_mha(cfg, MHAParams(**{**params.as_dict(), **read}), query, key, value, mask)

    def right(params, query, key, value, mask):
        return reference_mha(cfg, params, query, key, value, mask)

    assert np.array_equal(fuse_gated_q(truth.w_q, truth.w_gate, HEADS, HEAD_DIM), state["q_proj.weight"])
    assert diagnose(right, cfg).agrees
    result = diagnose(ported, cfg)
    assert not result.agrees
    assert [cause.code for cause in result.causes] == ["gate"], result.summary()
    assert "second half of the whole q_proj" in result.causes[0].detail, result.summary()
