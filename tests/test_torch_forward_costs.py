"""scripts/torch-forward-costs prints every figure docs/benchmarks.md cites (at a small size: no speed is asserted),
and each program it times computes what its name says: the four forwards are one attention, the two projections one
product but for the bias, the three SDPA calls one core."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_script

FORWARDS = ("torch-best's forward", "heads copied before SDPA", "projections per head", "packed QKV, contiguous heads")


def _programs(tokens: int = 12):
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    return load_script("torch-forward-costs").forwards(2, tokens, 4, 8)


def test_the_script_prints_every_program(capsys):
    names = list(_programs())
    load_script("torch-forward-costs").main(1, 16, repeats=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("torch ") and "B=4 N=16 D=512 H=8 d=64, 1 thread(s); median of 2 calls" in lines[0]
    assert [line.split(": ")[0] for line in lines[1:]] == names
    assert all(line.endswith(" ms") for line in lines[1:])


def test_the_forwards_agree_with_a_float64_attention_and_the_rewrites_change_only_the_layout():
    found = _programs()  # skips, with its reason, without torch
    import torch

    g = torch.Generator().manual_seed(0)  # the script's draws, in its order, in float64
    B, N, H, d = 2, 12, 4, 8
    D = H * d
    x = torch.randn(B, N, D, generator=g).double()
    w = [(torch.randn(D, D, generator=g) / D**0.5).double() for _ in range(4)]
    b = [torch.randn(D, generator=g).double() for _ in range(4)]
    q, k, v = ((x @ w[i].T + b[i]).view(B, N, H, d).transpose(1, 2) for i in range(3))  # (B, H, N, d)
    weights = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)  # (B, H, N, N)
    expected = ((weights @ v).transpose(1, 2).reshape(B, N, D) @ w[3].T + b[3]).numpy()  # (B, N, D)
    with torch.inference_mode():
        for name in FORWARDS:
            np.testing.assert_allclose(found[name]().numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=name)
        projection, bias_free = found["one projection, F.linear"](), found["one projection, no bias"]()
        np.testing.assert_allclose((projection - b[0].float()).numpy(), bias_free.numpy(), rtol=1e-5, atol=1e-5)
        cores = [found[name]().numpy() for name in ("SDPA on the split's views", "SDPA on contiguous heads",
                                                     "SDPA on views copied first")]  # fmt: skip
        np.testing.assert_array_equal(cores[0], cores[2])  # the same kernel on the same values
        np.testing.assert_allclose(cores[0], cores[1], rtol=1e-6, atol=1e-6)
