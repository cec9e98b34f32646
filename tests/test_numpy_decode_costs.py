"""scripts/numpy-decode-costs prints every figure the docs cite (at a small size: no speed is asserted), and its
other orientations compute the step's own numbers."""

from __future__ import annotations

import numpy as np

from conftest import load_script


def test_the_script_prints_the_plain_reads_and_the_four_products(capsys):
    load_script("numpy-decode-costs").main(512, 1, repeats=2, flush_mib=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("numpy ") and "B=1, context 512" in lines[0] and "pages of 256" in lines[0]
    assert lines[0].endswith("each call cold (after reading 1 MiB)")
    names = ("np.max over K:", "np.max over V:", "scores (G, Dk) @ (Dk, L):", "context (G, L) @ (L, Dv):",
             "scores, keys as rows (L, Dk) @ (Dk, G):", "context, values as columns (Dv, L) @ (L, G):")  # fmt: skip
    assert len(lines) == 1 + len(names)
    for name, line in zip(names, lines[1:], strict=True):
        assert line.startswith(name) and line.endswith(" GB/s"), line


def test_the_other_orientations_compute_the_steps_numbers():
    """The timed products compare layouts of one computation: the keys as rows give the step's scores, the values
    as columns its context (float32 products of 128 and 512 terms: 1e-4 relative)."""
    step_scores, rows_scores, step_context, columns_context = load_script("numpy-decode-costs").page_products(512, 2)[
        "same"
    ]
    scores = step_scores().copy()  # (B, Hkv, G, P, L)
    rows = rows_scores()  # (B, Hkv, P, L, G)
    np.testing.assert_allclose(rows.transpose(0, 1, 4, 2, 3), scores, rtol=1e-4, atol=1e-4)
    context = step_context()  # (B, Hkv, G, Dv)
    np.testing.assert_allclose(columns_context().swapaxes(-1, -2), context, rtol=1e-4, atol=1e-3)
    assert scores.shape == (2, 4, 4, 2, 256) and context.shape == (2, 4, 4, 128)
