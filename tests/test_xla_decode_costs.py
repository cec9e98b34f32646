"""scripts/xla-decode-costs runs and prints every figure docs/benchmarks.md cites (at a small size: no speed is asserted)."""

from __future__ import annotations

import pytest

from conftest import load_script


def test_the_script_prints_each_variant_and_the_cache_layouts(capsys):
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")
    script = load_script("xla-decode-costs")
    script.main(64)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("jax ") and "D=64" in lines[0]
    for rows, line in zip((" 1 row(s)", "16 row(s)"), lines[1:3], strict=True):
        assert line.startswith(rows)
        for name in ("x @ W.T:", "x @ W.T + b:", "barrier(x @ W.T) + b:", "x @ W_(in,out) + b:"):
            assert name in line, line
    assert "cache (T, Hkv, Dk)" in lines[3] and "cache (Hkv, T, Dk)" in lines[3] and "not donated" in lines[3]
    for sequences, line in zip((1, 4), lines[4:6], strict=True):
        assert line.startswith(f"scores of 1 token over the keys, B={sequences} (4x4 heads, d_k 128), GB/s: 64: XLA ")
        assert " | 256: XLA query rows first " in line and line.count("XLA slots first ") == line.count("NumPy ") == 2
    assert len(lines) == 6


def test_the_two_cache_layouts_compute_the_same_attention():
    """The timed functions compare layouts of one computation: the head-major einsum on the transposed cache
    gives the sequence-major one's numbers."""
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")
    import jax.numpy as jnp
    import numpy as np

    script = load_script("xla-decode-costs")
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 2, 3, 8)), jnp.float32)  # (s, Hkv, G, Dk)
    k = rng.standard_normal((10, 2, 8)).astype(np.float32)  # (T, Hkv, Dk)
    functions = script.attention_functions()
    by_token = functions["sequence_major"](q, jnp.asarray(k), jnp.asarray(k))
    by_head = functions["head_major"](q, jnp.asarray(k.transpose(1, 0, 2)), jnp.asarray(k.transpose(1, 0, 2)))
    np.testing.assert_allclose(np.asarray(by_token), np.asarray(by_head), rtol=1e-5, atol=1e-6)


def test_the_two_orientations_of_the_scores_are_one_product_transposed():
    """jax-best's slots-first scores, ``K @ q.T``, are the query-rows-first ``q @ K.T`` transposed."""
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")
    import numpy as np

    script = load_script("xla-decode-costs")
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((3, 4, 8)), rng.standard_normal((3, 10, 8))  # (n, G, Dk), (n, T, Dk)
    expected = np.einsum("ngd,ntd->ngt", q, k)  # float64, by NumPy
    functions = script.scores_functions()
    queries_first = np.asarray(functions["query rows first"](q.astype(np.float32), k.astype(np.float32)))
    slots_first = np.asarray(functions["slots first"](q.astype(np.float32), k.astype(np.float32)))
    assert queries_first.shape == (3, 4, 10) and slots_first.shape == (3, 10, 4)
    np.testing.assert_allclose(queries_first, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(slots_first.transpose(0, 2, 1), expected, rtol=1e-5, atol=1e-5)
