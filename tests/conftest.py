"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends._probe import import_failure, importable
from mha_rosetta.core import MHAConfig, init_params

# Distinct sizes everywhere, so that no two axes can be swapped without a shape error:
# batch 2, q tokens 7, kv tokens 5, d_model 15, 3 heads of d_k 5 (d_v 4 where it may differ).
BATCH, Q_TOKENS, KV_TOKENS, D_MODEL, HEADS, D_K = 2, 7, 5, 15, 3, 5


def requires(module: str):
    """Skip (with the reason) when an optional framework is not installed or fails to import."""
    return pytest.mark.skipif(not importable(module), reason=str(import_failure(module)))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def cfg():
    return MHAConfig(d_model=D_MODEL, n_heads=HEADS)


@pytest.fixture
def params(cfg):
    return init_params(cfg, seed=0)
