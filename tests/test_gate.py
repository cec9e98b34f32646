"""Gated attention (``attn_output_gate``, Qwen3-Next): the spec's entry, its float64 forward and backward, its
fused-projection converters, every adapter's forward, backward and decode of it, its refusal by the kernels' oracles
and the best paths, and the real ``Qwen3NextAttention``.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import installed_backend, normal
from mha_rosetta.core import (
    MHAConfig,
    MHAParams,
    compare,
    default_cotangent,
    init_params,
    reference_mha,
    reference_mha_vjp,
    reference_stages,
)
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.rotary import inverse_frequencies
from mha_rosetta.core.variants import BUILTIN_VARIANTS, VARIANT_REGISTRY, fuse_gated_q, split_gated_q
from mha_rosetta.core.variants.gate import QWEN3_NEXT_LIKE, sigmoid

CFG = MHAConfig(**dict(QWEN3_NEXT_LIKE, bias=True, attn_output_gate=True))


def test_the_gate_multiplies_each_merged_feature_by_its_sigmoid_before_w_o():
    params = init_params(CFG, seed=3)
    x = normal((2, 5, CFG.d_model))
    out, stages = reference_mha(CFG, params, x, return_stages=True)
    gate = sigmoid(x @ params.w_gate.T + params.b_gate)  # (B, N, H*Dv), by hand
    np.testing.assert_allclose(stages["gate"], gate, rtol=0, atol=1e-15)
    np.testing.assert_allclose(out, (stages["merged"] * gate) @ params.w_o.T + params.b_o, rtol=1e-13, atol=1e-13)
    # Off, the same parameters less the gate give the ungated layer: the gate is all it changes.
    plain = MHAConfig(**QWEN3_NEXT_LIKE | {"bias": True})
    ungated = MHAParams(**{n: a for n, a in params.as_dict().items() if n not in ("w_gate", "b_gate")})
    np.testing.assert_allclose(reference_mha(plain, ungated, x), stages["merged"] @ params.w_o.T + params.b_o)
    assert "gate" not in reference_mha(plain, ungated, x, return_stages=True)[1]


def test_sigmoid_is_exact_at_both_ends():
    assert sigmoid(np.array([0.0]))[0] == 0.5
    np.testing.assert_allclose(sigmoid(np.array([-800.0, 800.0, 2.0])), [0.0, 1.0, 1 / (1 + np.exp(-2.0))])


@pytest.mark.parametrize("bias", [True, False])
def test_the_float64_backward_matches_central_differences_in_every_gate_parameter_and_input(bias):
    cfg = MHAConfig(**dict(QWEN3_NEXT_LIKE, bias=bias, attn_output_gate=True))
    params = init_params(cfg, seed=5)
    x = normal((2, 4, cfg.d_model), seed=1)
    cot = default_cotangent((2, 4, cfg.d_model))
    grads = reference_mha_vjp(cfg, params, x, cotangent=cot)
    assert grads.d_params.w_gate is not None and (grads.d_params.b_gate is not None) == bias
    assert list(grads.stages)[:3] == ["d_output", "d_gate", "d_merged"]

    def loss(p, query):
        return float(np.sum(cot * reference_mha(cfg, p, query)))

    eps = 1e-6
    rng = np.random.default_rng(7)
    for name in ("w_gate", "b_gate", "w_o", "w_q") if bias else ("w_gate", "w_o", "w_q"):
        direction = rng.standard_normal(getattr(params, name).shape)
        moved = [MHAParams(**{**params.as_dict(), name: getattr(params, name) + t * direction}) for t in (eps, -eps)]
        fd = (loss(moved[0], x) - loss(moved[1], x)) / (2 * eps)
        analytic = float(np.sum(getattr(grads.d_params, name) * direction))
        assert abs(fd - analytic) <= 1e-8 * max(1.0, abs(analytic)), (name, fd, analytic)
    direction = rng.standard_normal(x.shape)  # x feeds q, k, v and the gate: all four paths add up
    fd = (loss(params, x + eps * direction) - loss(params, x - eps * direction)) / (2 * eps)
    analytic = float(np.sum(grads.d_query * direction))
    assert abs(fd - analytic) <= 1e-8 * max(1.0, abs(analytic)), (fd, analytic)


def test_split_and_fuse_are_exact_inverses_and_interleave_per_head():
    H, d, D = 3, 2, 5
    fused = np.arange(H * 2 * d * D, dtype=np.float64).reshape(H * 2 * d, D)
    w_q, w_gate = split_gated_q(fused, H, d)
    # head h's rows h*2d .. h*2d+d-1 are its query, the next d its gate: not the projection's two halves.
    assert [int(r) for r in w_gate[:, 0] // D] == [2, 3, 6, 7, 10, 11]
    assert [int(r) for r in w_q[:, 0] // D] == [0, 1, 4, 5, 8, 9]
    np.testing.assert_array_equal(fuse_gated_q(w_q, w_gate, H, d), fused)
    bias = np.arange(H * 2 * d, dtype=np.float64)
    np.testing.assert_array_equal(fuse_gated_q(*split_gated_q(bias, H, d), H, d), bias)


def test_a_gate_whose_value_head_does_not_fit_is_refused_by_name():
    with pytest.raises(ValueError, match=r"attn_output_gate=True needs d_v == d_k.*got d_k=8, d_v=4"):
        MHAConfig(d_model=32, n_heads=4, d_k=8, d_v=4, attn_output_gate=True)
    with pytest.raises(TypeError, match=r"MHAConfig\.attn_output_gate must be a bool, got 1"):
        MHAConfig(d_model=32, n_heads=4, attn_output_gate=1)
    with pytest.raises(ValueError, match=r"params.w_gate is None but cfg.attn_output_gate is True"):
        reference_mha(CFG, MHAParams(**{**init_params(CFG).as_dict(), "w_gate": None}), normal((1, 2, 32)))


def _backend(name: str):
    return installed_backend(name)


# Our adapters, each in its own convention: the gate is one ops-object method per library (`output_gate`).
ADAPTERS = ["numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax", "mlx", "onnx"]
GRAD_ADAPTERS = ["numpy", "torch", "jax", "einops-torch", "einops-jax", "mlx"]  # einops-numpy: no autodiff
DECODE_ADAPTERS = ["numpy", "torch", "jax", "einops-numpy", "mlx", "onnx"]


@pytest.mark.parametrize(
    "name", ["torch-sdpa", "torch-flex", "jax-dpa", "mlx-sdpa", "hf-attention", "torch-onnx", "torch-best", "jax-best"]
)
def test_the_kernels_oracles_and_the_best_paths_refuse_the_gate_by_name(name):
    """Every adapter applies the gate (implemented_by None), so the package's variants hold it; a kernel's oracle
    (what it compares is the kernel, and the gate is model code after it) and a best path leave it out, saying so."""
    assert VARIANT_REGISTRY["gate"].implemented_by is None and "gate" in BUILTIN_VARIANTS
    backend = _backend(name)
    assert "gate" not in backend.variants and "gate" not in backend.decode_variants
    reason = backend.variant_reason(CFG, "standard")
    assert reason is not None and ("gate" in reason or "output gate" in reason), reason


@pytest.mark.parametrize("name", [*ADAPTERS, "torch-tp", "jax-sharded"])
def test_every_adapter_declares_the_gate_forward_and_decode(name):
    backend = _backend(name)
    assert backend.variant_reason(CFG, "standard") is None
    assert "gate" in backend.variants and "gate" in backend.decode_variants


def _gated_inputs():
    return init_params(CFG, seed=21), normal((2, 7, CFG.d_model), seed=5)


@pytest.mark.parametrize("name", ADAPTERS)
def test_each_adapter_gates_the_merged_heads_as_the_spec_does(name):
    """The output in float64 (held to float32 where the library declares why: ONNX's Attention op takes sqrt(scale) in
    float32, MLX's float64 exp is float32-accurate), and the gate stage itself, between merged and output."""
    backend = _backend(name)
    params, x = _gated_inputs()
    want = reference_stages(CFG, params, x)
    got, stages = backend.run(CFG, params, x, return_stages=True)
    level = "float32" if name in ("onnx", "mlx") else "float64"
    assert compare(got, want["output"], level).ok
    assert compare(stages["gate"], want["gate"], level).ok
    assert list(stages)[list(stages).index("merged") + 1] == "gate"
    plain = MHAParams(**{n: a for n, a in params.as_dict().items() if n not in ("w_gate", "b_gate")})
    ungated = reference_mha(MHAConfig(**dict(QWEN3_NEXT_LIKE, bias=True)), plain, x)  # the gate does something
    assert np.max(np.abs(got - ungated)) > 1e-2 * np.max(np.abs(ungated))


@pytest.mark.parametrize("name", GRAD_ADAPTERS)
def test_each_adapter_s_backward_reaches_the_gate_s_weights_and_the_query_through_it(name):
    backend = _backend(name)
    params, x = _gated_inputs()
    cotangent = default_cotangent((2, 7, CFG.d_model))
    want = reference_mha_vjp(CFG, params, x, cotangent=cotangent).tensors()
    got = backend.run_vjp(CFG, params, x, cotangent=cotangent).tensors()
    assert {"w_gate", "b_gate"} <= set(got) and set(got) == set(want)
    level = "float32" if name == "mlx" else "float64"  # MLX's float64 exp is float32-accurate (its known difference)
    for tensor, value in want.items():
        assert compare(got[tensor], value, level).ok, tensor


@pytest.mark.parametrize("name", DECODE_ADAPTERS)
def test_each_decode_step_gates_its_own_tokens(name):
    """Nothing of the gate is cached: a step of 1 or 3 tokens after a prefill of 2 equals the full forward."""
    backend = _backend(name)
    params, x = _gated_inputs()
    level = "float64" if name in ("numpy", "torch", "jax", "einops-numpy") else "float32"
    for prefill, step in ((1, 1), (2, 3)):
        got = backend.run_decode(CFG, params, x, prefill=prefill, step=step)
        want = reference_decode(CFG, params, x, prefill=prefill, step=step)
        assert compare(got, want, level).ok, (prefill, step)


def _qwen3_next(cfg: MHAConfig, params: MHAParams, *, keep_float64: bool):
    """A real float64 ``Qwen3NextAttention`` holding ``params`` (its norms store ``w - 1``), and its rotary."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.d_k,
        partial_rotary_factor=cfg.rope_dims / cfg.d_k,
        rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.qkv_bias,
    )
    config._attn_implementation = "sdpa"  # float64 softmax on CPU; eager's runs in float32
    module = modeling.Qwen3NextAttention(config, layer_idx=3).double().eval()
    state = {
        "q_proj.weight": fuse_gated_q(params.w_q, params.w_gate, cfg.n_heads, cfg.d_k),
        "k_proj.weight": params.w_k,
        "v_proj.weight": params.w_v,
        "o_proj.weight": params.w_o,
        "q_norm.weight": params.q_norm - 1.0,  # Qwen3NextRMSNorm multiplies by (1 + weight)
        "k_norm.weight": params.k_norm - 1.0,
    }
    if cfg.qkv_bias:
        state["q_proj.bias"] = fuse_gated_q(params.b_q, params.b_gate, cfg.n_heads, cfg.d_k)
        state.update({"k_proj.bias": params.b_k, "v_proj.bias": params.b_v, "o_proj.bias": params.b_o})
    module.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    if keep_float64:  # the RMSNorm's x.float(): one of this path's two float32 steps (the rotary angles the other)

        def norm64(self, x):
            return self._norm(x) * (1.0 + self.weight)

        for norm in (module.q_norm, module.k_norm):
            norm.forward = norm64.__get__(norm)
    rotary = modeling.Qwen3NextRotaryEmbedding(config)
    return torch, module, rotary


@pytest.mark.parametrize("keep_float64", [True, False], ids=["norm-float64", "as-shipped"])
def test_the_spec_is_the_real_qwen3_next_attention(keep_float64):
    """Proved in float64 with the norm and the rotary angles kept float64; as shipped both run in float32."""
    params = init_params(CFG, seed=11)
    torch, module, rotary = _qwen3_next(CFG, params, keep_float64=keep_float64)
    B, N = 2, 6
    x = normal((B, N, CFG.d_model), seed=2)
    xt = torch.from_numpy(x)
    positions = torch.arange(N)[None].expand(B, N)
    # The module's rotary takes its angles in float32 (inv_freq.float() @ positions.float()): its frequencies are
    # the spec's base**(-2i/rope_dims) over the first rope_dims features; the float64 proof builds its tables.
    inv_freq = inverse_frequencies(CFG.rope_dims, CFG.rope_base)  # (r/2,)
    np.testing.assert_allclose(rotary.inv_freq.double().numpy(), inv_freq, rtol=1e-7)
    cos, sin = (t.double() for t in rotary(xt, positions))
    if keep_float64:
        angles = np.arange(N)[:, None] * np.concatenate([inv_freq, inv_freq])  # (N, r): rotate-half's layout
        cos, sin = (torch.from_numpy(f(angles))[None].expand(B, N, -1) for f in (np.cos, np.sin))
    mask = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(B, 1, N, N)
    with torch.no_grad():
        got = module(xt, (cos, sin), mask)[0].numpy()
    want = reference_mha(CFG, params, x)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    # Float64 throughout: rounding only. As shipped, the norm and the angles round to float32 (2**-24 relative).
    assert error <= (1e-12 if keep_float64 else 1e-6), error
    if not keep_float64:
        assert error > 1e-12, "the float32 norm should show; if it no longer does, prove it in float64"


def test_reading_the_gate_as_the_projections_second_half_changes_the_output():
    """vllm #36242: ``q, gate = q_proj(x).chunk(2, -1)`` mixes query rows into the gate (and gate rows into q)."""
    params = init_params(CFG, seed=13)
    fused = fuse_gated_q(params.w_q, params.w_gate, CFG.n_heads, CFG.d_k)
    fused_b = fuse_gated_q(params.b_q, params.b_gate, CFG.n_heads, CFG.d_k)
    half = CFG.n_heads * CFG.d_k
    wrong = MHAParams(
        **{
            **params.as_dict(),
            "w_q": fused[:half],
            "w_gate": fused[half:],
            "b_q": fused_b[:half],
            "b_gate": fused_b[half:],
        }
    )
    x = normal((1, 5, CFG.d_model), seed=4)
    right, misread = reference_mha(CFG, params, x), reference_mha(CFG, wrong, x)
    assert np.max(np.abs(right - misread)) > 1e-2 * np.max(np.abs(right))


def _diagnosed(candidate_params):
    """diagnose's causes for a NumPy candidate that computes the spec on the parameters ``candidate_params`` makes."""
    from mha_rosetta.diagnose import diagnose

    def candidate(params, query, key, value, mask):
        cfg, p = candidate_params(params)
        return reference_mha(cfg, p, query, key, value, mask)

    return diagnose(candidate, CFG)


def test_diagnose_agrees_with_the_gate_done_right_and_names_each_gate_mistake():
    assert _diagnosed(lambda p: (CFG, p)).agrees

    def forgotten(params):  # merged straight to w_o: the ungated layer on the same weights
        plain = MHAConfig(**QWEN3_NEXT_LIKE | {"bias": True})
        return plain, MHAParams(**{n: a for n, a in params.as_dict().items() if n not in ("w_gate", "b_gate")})

    def halves(params):  # q, gate = q_proj(x).chunk(2, -1) on Qwen3-Next's fused rows
        half = CFG.n_heads * CFG.d_k
        fused = fuse_gated_q(params.w_q, params.w_gate, CFG.n_heads, CFG.d_k)
        fused_b = fuse_gated_q(params.b_q, params.b_gate, CFG.n_heads, CFG.d_k)
        read = {"w_q": fused[:half], "w_gate": fused[half:], "b_q": fused_b[:half], "b_gate": fused_b[half:]}
        return CFG, MHAParams(**{**params.as_dict(), **read})

    for make, mistake in ((forgotten, "forgotten"), (halves, "second half of the whole q_proj")):
        result = _diagnosed(make)
        assert not result.agrees
        assert [cause.code for cause in result.causes] == ["gate"], result.summary()
        assert mistake in result.causes[0].detail, result.summary()
