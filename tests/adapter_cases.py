"""Spec cases and checks shared by the adapter test modules (NumPy, torch, einops, JAX, oracles).

Every case uses distinct sizes, so that swapping two axes cannot go unnoticed:
batch 2, 7 query tokens, 5 key/value tokens where they differ, widths 15/11/9, and
head counts and head widths that differ from everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conftest import BATCH, KV_TOKENS, Q_TOKENS
from mha_rosetta.backends import DIRECT_RESHAPE
from mha_rosetta.core import (
    STAGE_NAMES,
    MHAConfig,
    assert_close,
    compare,
    init_params,
    reference_mha,
    reference_stages,
)


@dataclass(frozen=True)
class Case:
    name: str
    cfg: MHAConfig
    cross: bool = False  # key/value tokens of their own (Nk = 5) instead of the query
    mask: str | None = None  # None, "padding" (B, 1, 1, Nk) or "empty_rows" (B, H, Nq, Nk)
    batched: bool = True

    def inputs(self, seed: int = 7):
        """(query, key, value, mask) in the exchange layout; key/value None for self-attention."""
        rng = np.random.default_rng(seed)
        cfg = self.cfg
        batch = (BATCH,) if self.batched else ()
        query = rng.standard_normal((*batch, Q_TOKENS, cfg.d_model))
        key = value = None
        kv_tokens = Q_TOKENS
        if self.cross:
            kv_tokens = KV_TOKENS
            key = rng.standard_normal((*batch, KV_TOKENS, cfg.kdim))
            value = rng.standard_normal((*batch, KV_TOKENS, cfg.vdim))
        mask = None
        if self.mask == "padding":
            # Batch item 1 has its last two keys padded; every query still sees a key.
            mask = np.ones((BATCH, 1, 1, kv_tokens), dtype=bool)
            mask[1, :, :, -2:] = False
        elif self.mask == "empty_rows":
            mask = rng.random((BATCH, cfg.n_heads, Q_TOKENS, kv_tokens)) > 0.4
            mask[..., 1] = True  # every row has a key ...
            mask[0, 1, 3] = False  # ... except query 3 of head 1 in batch item 0
            mask[1, :, 5] = False  # and query 5 of every head in batch item 1
        if mask is not None and not self.batched:
            mask = mask[0]
        return query, key, value, mask

    def params(self, bias_seed: int = 0):
        return init_params(self.cfg, seed=bias_seed)

    def run(self, backend, dtype: str, strategy: str, **kwargs):
        """``backend.run`` on this case's parameters and inputs (kwargs: device, return_stages, ...)."""
        return backend.run(self.cfg, self.params(), *self.inputs(), dtype=dtype, strategy=strategy, **kwargs)

    def reference(self):
        """The float64 oracle's output for this case."""
        return reference_mha(self.cfg, self.params(), *self.inputs())

    def reference_stages(self):
        return reference_stages(self.cfg, self.params(), *self.inputs())

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("self", MHAConfig(d_model=15, n_heads=3)),
    Case("cross-kdim11-vdim9-dv4", MHAConfig(d_model=15, n_heads=3, d_v=4, kdim=11, vdim=9), cross=True),
    Case("gqa-6q-2kv", MHAConfig(d_model=18, n_heads=6, n_kv_heads=2, d_k=4, d_v=5)),
    Case(
        "gqa-6q-3kv-causal-cross-scale",
        MHAConfig(d_model=18, n_heads=6, n_kv_heads=3, d_k=4, kdim=11, vdim=9, causal=True, scale=0.37),
        cross=True,
    ),
    Case("causal", MHAConfig(d_model=15, n_heads=3, causal=True)),
    Case("padding-mask", MHAConfig(d_model=15, n_heads=3), cross=True, mask="padding"),
    Case("empty-rows-no-bias", MHAConfig(d_model=15, n_heads=3, bias=False), cross=True, mask="empty_rows"),
    Case("unbatched-causal-padding", MHAConfig(d_model=15, n_heads=3, causal=True), mask="padding", batched=False),
]
CASE_BY_NAME = {case.name: case for case in CASES}
DTYPES = ("float64", "float32", "float16", "bfloat16")


def first_differing_stage(stages: dict, reference: dict, dtype: str) -> str | None:
    """The first stage (pipeline order) where ``stages`` leaves the dtype tolerance."""
    # -inf minus -inf in masked scores is NaN inside compare(); that is expected there.
    with np.errstate(invalid="ignore"):
        for name in STAGE_NAMES:
            if name in stages and not compare(stages[name], reference[name], dtype).ok:
                return name
    return None


def assert_stages_close(stages: dict, reference: dict, dtype: str, expected_names) -> None:
    """Every expected stage is present and within the dtype tolerance of the reference."""
    missing = set(expected_names) - set(stages)
    assert not missing, f"stages missing: {sorted(missing)}"
    with np.errstate(invalid="ignore"):
        for name in expected_names:
            assert_close(stages[name], reference[name], dtype, what=f"stage {name}")


def random_inputs(cfg: MHAConfig, *, cross: bool, padding: bool, padded_item: int, seed: int = 0):
    """(query, key, value, mask) with distinct sizes; key/value None for self-attention.

    With ``padding`` the batch item ``padded_item`` has its last two keys padded: mask
    (B, 1, Nq, Nk), True = may attend.
    """
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((BATCH, Q_TOKENS, cfg.d_model))
    key = value = None
    n_k = Q_TOKENS
    if cross:
        n_k = KV_TOKENS
        key = rng.standard_normal((BATCH, n_k, cfg.kdim))
        value = rng.standard_normal((BATCH, n_k, cfg.vdim))
    mask = None
    if padding:
        mask = np.ones((BATCH, 1, Q_TOKENS, n_k), dtype=bool)  # (B, 1, Nq, Nk)
        mask[padded_item, :, :, n_k - 2 :] = False  # the last two keys are padding
    return query, key, value, mask


# -- checks every adapter with strategies runs (the NumPy and torch test modules) ------------


def assert_output_matches_reference(backend, case: Case, dtype: str, strategy: str) -> None:
    output = case.run(backend, dtype, strategy)
    expected = case.reference()
    assert output.shape == expected.shape
    assert_close(output, expected, dtype, what=f"{backend.name}/{strategy}/{dtype} on {case}")


def assert_every_stage_matches_reference(backend, case: Case, dtype: str, strategy: str) -> None:
    _, stages = case.run(backend, dtype, strategy, return_stages=True)
    assert_stages_close(stages, case.reference_stages(), dtype, STAGE_NAMES)


def assert_direct_reshape_is_caught_at_q_heads(backend, case: Case, dtype: str) -> None:
    """The known mistake gives an output of the right shape, finite, but wrong from q_heads on."""
    output, stages = case.run(backend, dtype, DIRECT_RESHAPE, return_stages=True)
    expected = case.reference()
    assert output.shape == expected.shape  # shape-correct ...
    assert np.isfinite(output).all()
    with np.errstate(invalid="ignore"):
        assert not compare(output, expected, dtype).ok  # ... but wrong
    assert first_differing_stage(stages, case.reference_stages(), dtype) == "q_heads"
