"""scripts/attention-core-costs prints every figure the best paths' peer limits cite (at a small size: no speed is
asserted), and every library's core computes ``softmax(q @ k.T / sqrt(d)) @ v``."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_script

NAMES = ("numpy-best's core", "numpy-best's core, queries first", "numpy-best's products only", "torch SDPA (fused)", "torch matmul, softmax, matmul",
         "torch's products only", "XLA einsum, softmax, einsum", "XLA jax.nn.dot_product_attention")  # fmt: skip


def _needs_torch_and_jax():
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")


def test_the_script_prints_every_core_and_the_softmax_alone(capsys):
    _needs_torch_and_jax()
    load_script("attention-core-costs").main(1, 16, repeats=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("numpy ") and "B=4 H=8 N=16 d=64 (0.00 GFLOP), 1 thread(s)" in lines[0]
    assert [line.split(": ")[0] for line in lines[1:-3]] == list(NAMES)
    assert all(line.endswith(" GFLOP/s") for line in lines[1:-3])
    labels = ("numpy-best's softmax alone, over the rows (keys first)", "numpy-best's softmax alone, along the rows "
              "(queries first)", "torch's softmax alone, along the rows")  # fmt: skip
    for line, label in zip(lines[-3:], labels, strict=True):
        assert line.startswith(f"{label}: ") and line.endswith(" ns a score"), line


def test_every_core_is_the_spec_attention_and_the_products_only_skip_the_softmax():
    _needs_torch_and_jax()
    script = load_script("attention-core-costs")
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((4, 8, 12, 64), dtype=np.float32) for _ in range(3))  # (B, H, N, d)
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) / 8.0  # float64, d ** 0.5 = 8
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True)) @ v.astype(np.float64)  # (B, H, N, d)
    found = script.cores(q, k, v, threads=1)
    assert list(found) == list(NAMES)
    for name, core in found.items():
        if not name.endswith("products only"):
            np.testing.assert_allclose(np.asarray(core()), expected, rtol=2e-5, atol=2e-5, err_msg=name)
    # The products alone: the scaled scores straight into the context product, no softmax.
    for name in ("numpy-best's products only", "torch's products only"):
        np.testing.assert_allclose(np.asarray(found[name]()), scores @ v, rtol=1e-4, atol=1e-3, err_msg=name)
