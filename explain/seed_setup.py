"""The column/row-sample article's running example, and the inputs every explainer section shares.

The column/row-sample article works with 6 tokens of d_model 12 split into 3 heads of d_k 4; the explainer
uses that configuration unless told otherwise. Batch 2 keeps the batch axis visible
and distinct from every other size (2 is none of 3, 4, 6, 12).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, init_params
from mha_rosetta.core.inputs import BatchedTokens

SEED_TOKENS, SEED_D_MODEL, SEED_HEADS, SEED_D_K = 6, 12, 3, 4
DEFAULT_BATCH = 2


@dataclass(frozen=True)
class Setup(BatchedTokens):
    """One configuration with its parameters and an input batch (row samples, float64)."""

    cfg: MHAConfig
    params: MHAParams
    x: np.ndarray  # (batch, tokens, d_model)


def seed_config() -> MHAConfig:
    return MHAConfig(d_model=SEED_D_MODEL, n_heads=SEED_HEADS, d_k=SEED_D_K)


def make_setup(
    cfg: MHAConfig | None = None,
    tokens: int = SEED_TOKENS,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
) -> Setup:
    """Parameters from `init_params(cfg, seed)` and a standard-normal input of the given size."""
    cfg = seed_config() if cfg is None else cfg
    for name, value in (("tokens", tokens), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    x = np.random.default_rng(seed + 1).standard_normal((batch, tokens, cfg.d_model))
    return Setup(cfg, init_params(cfg, seed=seed), x)
