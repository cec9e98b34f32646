"""scripts/projection-costs prints every figure the docs cite (at a small size: no speed is asserted), and each
library's product computes ``x @ W.T``."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_script


def test_the_script_prints_the_read_and_every_product(capsys):
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")
    load_script("projection-costs").main(64, repeats=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("numpy ") and "a 64 x 64 weight" in lines[0]
    assert lines[1].startswith("np.max over W: ") and lines[1].endswith(" GB/s")
    names = ("numpy W_(out,in) @ x.T", "numpy x @ W_(in,out)", "torch F.linear, W stored (out,in)",
             "torch F.linear, W stored (in,out)", "XLA x @ W_(in,out)")  # fmt: skip
    for rows, line in zip((" 1", " 4", "16"), lines[2:], strict=True):
        assert line.startswith(f"{rows} row(s): ") and line.count(" GB/s") == len(names), line
        assert all(f"{name} " in line for name in names), line
    assert len(lines) == 5


def test_every_product_is_x_times_w_transposed():
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("jax", reason="jax is not installed: pip install 'mha-rosetta[jax]'")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((24, 16), dtype=np.float32)  # (out, in)
    x = rng.standard_normal((4, 16), dtype=np.float32)  # (R, in)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)  # (R, out), float64
    found = load_script("projection-costs").products(w, x)
    assert len(found) == 5
    for name, product in found.items():
        value = np.asarray(product())  # a NumPy array, a CPU torch tensor or a jax array
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5, err_msg=name)  # float32 sums of 16 terms
