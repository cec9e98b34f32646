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
    assert lines[6].startswith(
        "attention core of 1 token, B=4, 256 cached (4x4 heads, d_k 128), GB/s of K and V, each call cold: "
        "np.max over K and V "
    )
    for name in (" | slots first (jax-best) ", " | query rows first ", " | its scores alone ", " | its context alone "):
        assert name in lines[6], lines[6]
    figures = [float(cell.rsplit(" ", 1)[1]) for cell in lines[6].split(": ", 1)[1].split(" | ")]
    assert len(figures) == 5 and all(figure > 0.0 for figure in figures), lines[6]  # GB/s, not 0.0 from a unit slip
    assert len(lines) == 7


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


def test_the_two_cores_compute_one_attention():
    """jax-best's core (the scores slots first) and the query rows first give the float64 softmax attention's
    numbers (float32: 1e-5 relative)."""
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")
    import numpy as np

    script = load_script("xla-decode-costs")
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 4, 8)), rng.standard_normal((3, 10, 8)), rng.standard_normal((3, 10, 6))
    scores = np.einsum("ngd,ntd->ngt", q, k)  # (n, G, T)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("ngt,ntd->ngd", weights / weights.sum(axis=-1, keepdims=True), v)  # (n, G, Dv)
    for name, core in script.core_functions().items():
        got = np.asarray(core(*(a.astype(np.float32) for a in (q, k, v))))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)
