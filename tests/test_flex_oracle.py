"""FlexAttention (`torch-flex`) as an oracle of the variants: hand cases, the block mask, the sinks, its two modes.

The all-pairs check runs it on every spec case through the registry; these tests pin down what
is specific to it: the softcap in ``score_mod`` against numbers written out by hand, the
window's and Llama 4's chunks' ``mask_mod`` cell by cell on the positions, a value head wider
than the key's, the sinks rescaled from the log-sum-exp, which dtype runs compiled, and that it
refuses a backward on the CPU with the reason. The compiled cases take
seconds each (torch.compile), so only two of them are here.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no FlexAttention (torch >= 2.5)")

from mha_rosetta.backends import UnsupportedCase, available_backends, get_backend
from mha_rosetta.backends.oracles.flex import TorchFlexOracle, compiled_mode, flex_attend
from mha_rosetta.checks.cases import SPEC_CASES
from mha_rosetta.core import MHAConfig, MHAParams, assert_close, init_params, prepare_inputs, reference_mha

IDENTITY = np.eye(2)
X = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])  # 4 tokens of 2 features


def _identity_layer(**variants) -> tuple[MHAConfig, MHAParams]:
    """One head of 2 features, every weight the identity, no bias, scale 1: the scores are x_i . x_j."""
    cfg = MHAConfig(d_model=2, n_heads=1, bias=False, scale=1.0, **variants)
    return cfg, MHAParams(IDENTITY, IDENTITY, IDENTITY, IDENTITY)


def _softmax_rows(scores: np.ndarray) -> np.ndarray:
    exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def test_flex_is_a_registered_oracle_that_runs_eagerly_unless_asked_to_compile(monkeypatch):
    assert "torch-flex" in available_backends(kind="oracle")
    backend = get_backend("torch-flex")
    assert backend.kind == "oracle"
    monkeypatch.delenv("MHA_ROSETTA_FLEX_COMPILE", raising=False)
    assert TorchFlexOracle().compiled_dtypes == ()  # the default check compiles nothing
    monkeypatch.setenv("MHA_ROSETTA_FLEX_COMPILE", "1")
    compiling = TorchFlexOracle()
    assert compiling.compiled_dtypes == ("float16", "bfloat16")
    cfg = MHAConfig(d_model=12, n_heads=3)
    assert [compiled_mode(cfg, d, compiling.compiled_dtypes) for d in ("float64", "float32", "bfloat16")] == [
        False,
        False,
        True,
    ]
    with pytest.raises(ValueError, match=r"compiled_dtypes must name float32, float16 or bfloat16"):
        TorchFlexOracle(compiled_dtypes=("float64",))


def test_bfloat16_runs_eagerly_by_default_on_a_variant_case(monkeypatch):
    monkeypatch.delenv("MHA_ROSETTA_FLEX_COMPILE", raising=False)
    case = SPEC_CASES["gemma2"]
    backend = TorchFlexOracle()
    prepared, _ = backend.prepare(case.cfg, case.params(), case.inputs().query, dtype="bfloat16")
    assert prepared.info["mode"] == "eager (unfused)"
    assert_close(case.run(backend, "bfloat16"), case.reference(), "bfloat16")


def test_bfloat16_runs_the_compiled_kernel_on_a_variant_case():
    case = SPEC_CASES["gemma2"]  # softcap, window, GQA, a custom scale: score_mod and mask_mod, compiled
    compiling = TorchFlexOracle(compiled_dtypes=("float16", "bfloat16"))
    prepared, _ = compiling.prepare(case.cfg, case.params(), case.inputs().query, dtype="bfloat16")
    assert prepared.info["mode"].startswith("torch.compile(flex_attention)")
    assert_close(case.run(compiling, "bfloat16"), case.reference(), "bfloat16")


@pytest.mark.parametrize("dtype", ["float64", "float32"])  # eager, then compiled (when asked: not the default)
def test_softcap_in_score_mod_matches_the_hand_computed_rows(dtype):
    cfg, params = _identity_layer(softcap=1.5)
    scores = X @ X.T  # s_ij = x_i . x_j: 4, 0, 2, -2 in the first row
    capped = 1.5 * np.tanh(scores / 1.5)  # 1.5 tanh(4 / 1.5) = 1.4852... for the largest
    expected = _softmax_rows(capped) @ X  # w_v = w_o = I: the output is the weighted tokens
    backend = TorchFlexOracle(compiled_dtypes=("float32",))
    prepared, _ = backend.prepare(cfg, params, X, dtype=dtype)
    assert ("compile" in prepared.info["mode"]) == (dtype != "float64")
    assert prepared.info["score_mod"] == "1.5 * tanh(s / 1.5)"
    assert_close(prepared.output()[0], expected, dtype)
    # Without the cap the first row puts 0.865 on token 0 (e^4 of 63.1); with it 0.471 (e^1.486 of 9.38).
    assert abs(_softmax_rows(scores)[0, 0] - 0.865) < 1e-3 and abs(_softmax_rows(capped)[0, 0] - 0.471) < 1e-3


def test_window_mask_mod_is_the_window_cell_by_cell_and_the_output_follows():
    import torch

    cfg, params = _identity_layer(causal=True, window=2)  # each query: itself and the token before it
    inputs = prepare_inputs(cfg, X)
    _, block_mask = flex_attend(cfg, inputs, "float64", "cpu", compiled=False)
    q_idx, kv_idx = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    allowed = block_mask.mask_mod(zero, zero, q_idx, kv_idx).numpy()
    expected_allowed = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(allowed, expected_allowed)
    scores = np.where(expected_allowed, X @ X.T, -np.inf)
    output = get_backend("torch-flex").run(cfg, params, X)
    assert_close(output, _softmax_rows(scores) @ X, "float64")


def test_chunked_mask_mod_is_llama4s_chunks_on_the_positions_cell_by_cell():
    """Chunks of 2 on the positions 0, 1, 3, 4: chunk 0 holds the first two tokens, positions 3 and 4 are chunks 1
    and 2, so the last query sees only itself (on the indices 2 and 3 it would share a chunk with the third)."""
    import torch

    cfg, params = _identity_layer(causal=True, attention_chunk_size=2)
    positions = np.array([0, 1, 3, 4])
    _, block_mask = flex_attend(cfg, prepare_inputs(cfg, X, positions=positions), "float64", "cpu", compiled=False)
    q_idx, kv_idx = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    allowed = block_mask.mask_mod(zero, zero, q_idx, kv_idx).numpy()
    expected_allowed = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(allowed, expected_allowed)
    output = get_backend("torch-flex").run(cfg, params, X, positions=positions)
    assert_close(output, _softmax_rows(np.where(expected_allowed, X @ X.T, -np.inf)) @ X, "float64")
    assert_close(output, reference_mha(cfg, params, X, positions=positions), "float64")


def test_a_value_head_wider_than_the_key_head():
    """d_k 4 and d_v 6: FlexAttention's value head size is its own (the context is (B, H, Nq, Dv))."""
    cfg = MHAConfig(d_model=12, n_heads=3, d_k=4, d_v=6, causal=True, attention_chunk_size=3)
    params = init_params(cfg, seed=2)
    x = np.random.default_rng(5).standard_normal((2, 7, 12))
    output, stages = get_backend("torch-flex").run(cfg, params, x, return_stages=True, dtype="float64")
    assert stages["context"].shape == (2, 3, 7, 6) and stages["q_heads"].shape == (2, 3, 7, 4)
    assert_close(output, reference_mha(cfg, params, x), "float64")


def test_window_on_positions_not_indices():
    """The window reads the token positions: keys 10 apart in position are outside a window of 3."""
    cfg, params = _identity_layer(window=3)  # two-sided: |p_i - p_j| < 3
    positions = np.array([0, 1, 11, 12])
    output = get_backend("torch-flex").run(cfg, params, X, positions=positions)
    assert_close(output, reference_mha(cfg, params, X, positions=positions), "float64")
    near = np.abs(positions[:, None] - positions[None, :]) < 3
    assert_close(output, _softmax_rows(np.where(near, X @ X.T, -np.inf)) @ X, "float64")


def test_sinks_rescale_each_row_by_the_log_sum_exp_and_run_eagerly_in_every_dtype():
    cfg, params = _identity_layer(sinks=True)
    params = MHAParams(IDENTITY, IDENTITY, IDENTITY, IDENTITY, sinks=np.array([0.7]))
    scores = X @ X.T
    exp = np.exp(scores)
    expected = (exp / (np.exp(0.7) + exp.sum(axis=-1, keepdims=True))) @ X  # the sink takes its share
    backend = get_backend("torch-flex")
    assert_close(backend.run(cfg, params, X), expected, "float64")
    assert not compiled_mode(cfg, "float32", ("float32",))  # even where float32 compiles: no lse from that kernel
    prepared, _ = TorchFlexOracle(compiled_dtypes=("float32",)).prepare(cfg, params, X, dtype="float32")
    assert prepared.info["mode"] == "eager (unfused)" and prepared.info["sinks"] == "out * sigmoid(lse - sink_h)"
    assert_close(prepared.output()[0], expected, "float32")


@pytest.mark.parametrize("name", ["gpt_oss", "t5_decoder", "alibi", "qk_norm_projection"])
def test_flex_matches_the_oracle_on_the_variant_cases_in_float64(name):
    case = SPEC_CASES[name]
    assert_close(case.run(get_backend("torch-flex"), "float64"), case.reference(), "float64")


# score_mod (softcap, ALiBi, T5's buckets), mask_mod (causal on positions, window, padding), sinks, GQA, MQA.
DIRECT_CASES = ["gemma2", "alibi", "t5_decoder", "causal_cache", "window_two_sided", "causal_padding", "gpt_oss", "mqa"]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_calling_the_op_directly_is_bit_identical_to_flex_attentions_own_eager_capture(monkeypatch, dtype):
    # The oracle calls FlexAttention's op without the dynamo capture flex_attention adds in eager mode
    # (`flex._eager_flex`, 21x faster); the capture, switched back on here, must give the very same bits.
    from mha_rosetta.backends.oracles import flex

    backend = get_backend("torch-flex")
    direct = {name: SPEC_CASES[name].run(backend, dtype) for name in DIRECT_CASES}
    captured_calls, direct_call = [], flex._eager_flex

    def captured(*args, **kwargs):
        captured_calls.append(1)
        return direct_call(*args, direct=False, **kwargs)

    monkeypatch.setattr(flex, "_eager_flex", captured)
    for name in DIRECT_CASES:
        np.testing.assert_array_equal(SPEC_CASES[name].run(backend, dtype), direct[name], err_msg=name)
    assert len(captured_calls) == len(DIRECT_CASES)  # the capture really ran, once per case


def test_a_row_with_no_allowed_key_is_zero_like_the_spec():
    cfg = MHAConfig(d_model=12, n_heads=3, sinks=True, causal=True)
    params = init_params(cfg)
    x = np.random.default_rng(1).standard_normal((2, 5, 12))
    mask = np.ones((2, 1, 5, 5), dtype=bool)
    mask[1, :, 3] = False  # query 3 of item 1 may attend to nothing
    output = get_backend("torch-flex").run(cfg, params, x, mask=mask)
    assert_close(output, reference_mha(cfg, params, x, mask=mask), "float64")


def test_no_backward_on_the_cpu_with_the_reason():
    cfg = MHAConfig(d_model=12, n_heads=3)
    x = np.random.default_rng(2).standard_normal((2, 5, 12))
    with pytest.raises(UnsupportedCase, match="FlexAttention has no backward on the CPU"):
        get_backend("torch-flex").run_vjp(cfg, init_params(cfg), x, cotangent=np.ones((2, 5, 12)))
