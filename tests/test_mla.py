"""DeepSeek's multi-head latent attention (MLA): the spec's entry, its validation, parameters and stages, the float64
forward written out by hand, the backward proved by central differences, and the adapters' refusal.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from conftest import refusal_reason
from mha_rosetta.core import MHAConfig, MHAParams, default_cotangent, init_params, reference_mha, reference_mha_vjp
from mha_rosetta.core.stages import stage_shapes
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE, YARN, fuse_kv_b, split_kv_b
from mha_rosetta.core.variants.models import MISTRAL4_LIKE

V3 = MHAConfig(**DEEPSEEK_V3_LIKE)
V2 = MHAConfig(**DEEPSEEK_V2_LITE_LIKE)
MISTRAL4 = MHAConfig(**MISTRAL4_LIKE)  # and the query temperature on both parts (tests/test_mla_temperature.py)


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_adjacent(x, positions, base=10000.0):
    """Adjacent pairs (2i, 2i+1) turned by position * base^(-2i/d) (DeepSeek V2's complex freqs_cis), by hand."""
    d = x.shape[-1]
    angle = positions[:, None] * base ** (-np.arange(0, d, 2) / d)  # (N, d/2)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def test_the_sizes_resolve_as_deepseek_names_them():
    assert (V3.d_k, V3.d_v, V3.n_kv_heads, V3.rope, V3.rope_dims) == (10, 5, 3, "interleaved", 6)
    assert V3.variants == ("rope_scaling", "mla", "mla_q_lora") and V2.variants == ("mla",)
    # YaRN's softmax factor: m(4, mscale_all_dim=0.9)^2 on d_k^-1/2 (mscale=0.8 acts on cos and sin only).
    assert V3.scale == pytest.approx(1 / math.sqrt(10) * (0.1 * 0.9 * math.log(4.0) + 1) ** 2, rel=1e-15)
    assert V2.scale == 1 / math.sqrt(7) and replace(V3, causal=False).scale == V3.scale  # replace keeps it
    assert MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_interleave=False)).rope == "half"


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(qk_rope_head_dim=None), "kv_lora_rank=10 needs qk_rope_head_dim"),
        (dict(qk_nope_head_dim=None), "needs qk_nope_head_dim"),
        (dict(v_head_dim=None), "needs v_head_dim, the value head size"),
        (dict(qk_rope_head_dim=5), "qk_rope_head_dim rotates pairs"),
        (dict(d_k=8), "d_k=8 contradicts MLA: it must be 10"),
        (dict(d_v=10), "d_v=10 contradicts MLA: it must be 5"),
        (dict(n_kv_heads=1), "n_kv_heads=1 contradicts MLA"),
        (dict(rope="half"), "rope='half' contradicts MLA"),
        (dict(bias="qkv"), "bias='qkv' contradicts MLA"),
        (dict(qk_norm="head"), "qk_norm='head' with MLA"),
        (dict(kdim=12), "kdim=12 contradicts MLA"),
        (
            dict(kv_lora_rank=None, rope_scaling=None),
            "q_lora_rank=7 is a size of multi-head latent attention, which needs kv_lora_rank",
        ),
        (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int"),
    ],
)
def test_bad_mla_fields_get_a_clear_error(change, words):
    with pytest.raises((ValueError, TypeError), match=words.replace("(", r"\(").replace(")", r"\)")):
        MHAConfig(**dict(DEEPSEEK_V3_LIKE, **change))


def test_rope_interleave_must_be_a_bool():
    with pytest.raises(TypeError, match="rope_interleave must be a bool"):
        MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_interleave=1))


def test_parameters_have_deepseeks_shapes_and_no_qkv_biases():
    p = init_params(V3, seed=0)
    shapes = {name: a.shape for name, a in p.as_dict().items() if a is not None}
    assert shapes == {
        "w_q": (30, 7), "w_k": (12, 10), "w_v": (15, 10), "w_o": (24, 15),  # q_b_proj, W_UK, W_UV, o_proj
        "w_kv_a": (16, 24), "kv_a_norm": (10,), "w_q_a": (7, 24), "q_a_norm": (7,),
    }  # fmt: skip
    p2 = init_params(V2, seed=0)  # attention_bias: q_proj none, kv_a_proj_with_mqa and o_proj biased
    assert (p2.b_q, p2.b_k, p2.b_v, p2.w_q_a) == (None, None, None, None)
    assert p2.w_q.shape == (28, 20) and p2.b_kv_a.shape == (10,) and p2.b_o.shape == (20,)
    with pytest.raises(ValueError, match=r"params.b_q must be None because variant 'mla' is on"):
        reference_mha(V2, replace(p2, b_q=np.zeros(28)), _x((1, 3, 20)))


def test_kv_b_proj_splits_per_head_and_back():
    kv_b = np.arange(4 * 8 * 6, dtype=float).reshape(32, 6)  # H=4, [k_nope (3) | v (5)] per head, R=6
    w_k, w_v = split_kv_b(kv_b, 4, 3, 5)
    assert np.array_equal(w_k[3:6], kv_b[8:11]) and np.array_equal(w_v[5:10], kv_b[11:16])  # head 1's rows
    assert np.array_equal(fuse_kv_b(w_k, w_v, 4), kv_b)


def test_the_forward_matches_deepseek_v2_written_out_by_hand():
    """V2-Lite: q_proj, the latent, adjacent-pair rotary of the last d_rope features, W_UK/W_UV per head, o_proj."""
    p = init_params(V2, seed=2)
    x = _x((2, 6, 20), seed=3)
    out, stages = reference_mha(V2, p, x, return_stages=True)
    H, dn, dr, dv, R = 4, 3, 4, 5, 6
    pos = np.arange(6.0)
    kv_a = x @ p.w_kv_a.T + p.b_kv_a
    c, k_pe = _rms(kv_a[..., :R], p.kv_a_norm), _rotate_adjacent(kv_a[..., R:], pos)
    q = (x @ p.w_q.T).reshape(2, 6, H, dn + dr)
    q = np.concatenate([q[..., :dn], _rotate_adjacent(np.moveaxis(q[..., dn:], 2, 1), pos).transpose(0, 2, 1, 3)], -1)
    kv = (c @ fuse_kv_b(p.w_k, p.w_v, H).T).reshape(2, 6, H, dn + dv)  # HF's kv_b_proj, then the split
    k = np.concatenate([kv[..., :dn], np.broadcast_to(k_pe[:, :, None], (2, 6, H, dr))], -1)
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(dn + dr)
    s = np.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    ctx = np.einsum("bhij,bjhd->bihd", a, kv[..., dn:]).reshape(2, 6, H * dv)
    np.testing.assert_allclose(stages["kv_latent"], c, rtol=0, atol=1e-14)
    np.testing.assert_allclose(stages["k_rope"], k_pe, rtol=0, atol=1e-14)
    np.testing.assert_allclose(out, ctx @ p.w_o.T + p.b_o, rtol=1e-12, atol=1e-13)
    assert {k: v.shape for k, v in stages.items()} == stage_shapes(V2, 2, 6, 6)


def test_yarn_scales_the_rotary_and_the_softmax_apart():
    """mscale_all_dim moves the softmax scale; mscale alone (with mscale_all_dim fixed) only cos and sin."""
    x = _x((1, 5, 24), seed=4)
    p = init_params(V3, seed=1)
    other = MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_scaling=dict(YARN, mscale=1.3)))
    assert other.scale == V3.scale
    k_a, k_b = (reference_mha(c, p, x, return_stages=True)[1]["k_rope"] for c in (V3, other))
    ratio = (0.1 * 1.3 * math.log(4) + 1) / (0.1 * 0.8 * math.log(4) + 1)  # m(f, 1.3) / m(f, 0.8)
    np.testing.assert_allclose(k_b, k_a * ratio, rtol=1e-13)


@pytest.mark.parametrize("cfg", [V3, V2, MISTRAL4], ids=["v3", "v2_lite", "mistral4"])
def test_the_float64_backward_matches_central_differences_in_every_parameter_and_input(cfg):
    params = init_params(cfg, seed=5)
    x = _x((2, 5, cfg.d_model), seed=1)
    cot = default_cotangent((2, 5, cfg.d_model))
    grads = reference_mha_vjp(cfg, params, x, cotangent=cot)
    names = [name for name, a in params.as_dict().items() if a is not None]
    assert [name for name in names if getattr(grads.d_params, name) is None] == []
    assert grads.d_key is None and grads.d_value is None  # both defaulted: folded into d_query
    stages = list(grads.stages)
    assert stages[-3:] == (["d_q_latent", "d_k_rope", "d_kv_latent"] if cfg.q_lora_rank else stages[-3:])
    assert "d_kv_latent" in stages and "d_k_rope" in stages

    def loss(p, query):
        return float(np.sum(cot * reference_mha(cfg, p, query)))

    eps, rng = 1e-6, np.random.default_rng(7)
    for name in names:
        direction = rng.standard_normal(getattr(params, name).shape)
        moved = [MHAParams(**{**params.as_dict(), name: getattr(params, name) + t * direction}) for t in (eps, -eps)]
        fd = (loss(moved[0], x) - loss(moved[1], x)) / (2 * eps)
        assert np.sum(getattr(grads.d_params, name) * direction) == pytest.approx(fd, rel=1e-7, abs=1e-8), name
    direction = rng.standard_normal(x.shape)
    fd = (loss(params, x + eps * direction) - loss(params, x - eps * direction)) / (2 * eps)
    assert np.sum(grads.d_query * direction) == pytest.approx(fd, rel=1e-7)


def test_a_value_input_other_than_the_keys_is_refused():
    p = init_params(V2, seed=0)
    x = _x((1, 4, 20))
    with pytest.raises(ValueError, match="one latent of the same tokens"):
        reference_mha(V2, p, x, x, x + 1.0)
    np.testing.assert_array_equal(reference_mha(V2, p, x, x, x), reference_mha(V2, p, x))


@pytest.mark.parametrize("name", ["numpy", "torch", "jax", "einops-torch", "mlx", "torch-sdpa"])
def test_every_implementation_refuses_mla_by_name_outside_the_mla_strategies(name):
    """The standard strategy has no latent: every adapter refuses MLA there (those that apply it, in their naive and
    absorbed strategies: tests/test_mla_adapters.py), and every other adapter and oracle everywhere."""
    reason = refusal_reason(name, V3)
    assert reason is not None and "mla" in reason, reason


def test_diagnose_probes_mla_through_its_latent_and_its_decode_loop_through_its_latent_cache():
    """diagnose's simulator expands MLA's latent, and diagnose_decode's loop keeps its latent cache (their mistakes:
    tests/test_diagnose_forms.py): the spec's forward and core.mla_forms' decode loop agree."""
    from mha_rosetta.core.mla_forms import mla_decode
    from mha_rosetta.diagnose import diagnose, diagnose_decode

    result = diagnose(lambda params, q, k, v, mask: reference_mha(V3, params, q, mask=mask), V3)
    assert result.agrees, result.summary()

    def loop(params, x, prefill, step, mask, positions):
        return mla_decode(V3, params, x, prefill=prefill, step=step, mask=mask, positions=positions, form="absorbed")

    decoded = diagnose_decode(loop, V3)
    assert decoded.agrees and decoded.max_error < 1e-12, decoded.summary()
