"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, init_params

# Distinct sizes everywhere, so that no two axes can be swapped without a shape error:
# batch 2, q tokens 7, kv tokens 5, d_model 15, 3 heads of d_k 5 (d_v 4 where it may differ).
BATCH, Q_TOKENS, KV_TOKENS, D_MODEL, HEADS, D_K = 2, 7, 5, 15, 3, 5


def requires(module: str):
    """Skip (with the reason) when an optional framework is not installed."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def cfg():
    return MHAConfig(d_model=D_MODEL, n_heads=HEADS)


@pytest.fixture
def params(cfg):
    return init_params(cfg, seed=0)


# -- --require-gpu: on a GPU machine, a GPU test that skips is a failure ----------------------


def pytest_addoption(parser):
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail every test marked gpu that would skip (run on a GPU machine: `pytest -m gpu --require-gpu`), "
        "so that a GPU run where nothing saw the GPU cannot pass",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu") is not None and item.config.getoption("require_gpu"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"--require-gpu: this GPU test skipped instead of running: {reason}"
