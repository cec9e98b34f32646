"""The spec cases of the check (`checks.cases`), and the assertions the adapter tests share.

The tests run the check's own catalogue: one list of configurations (self and cross
attention, GQA/MQA, masks, empty rows, unbatched, rotary), each with distinct sizes so
that swapping two axes cannot go unnoticed. `tests/test_adapters.py` runs every
registered implementation on it; the per-adapter modules keep what is specific to one
convention.
"""

from __future__ import annotations

import numpy as np

from conftest import BATCH, KV_TOKENS, Q_TOKENS
from mha_rosetta.backends import CHUNKED, DIRECT_RESHAPE
from mha_rosetta.backends._chunking import CHUNKED_HIDDEN_STAGES
from mha_rosetta.checks.agreement import backend_level
from mha_rosetta.checks.cases import SPEC_CASES, SpecCase
from mha_rosetta.core import STAGE_NAMES, MHAConfig, assert_close, compare, stage_names

CASES: list[SpecCase] = list(SPEC_CASES.values())
CASE_BY_NAME = SPEC_CASES
DTYPES = ("float64", "float32", "float16", "bfloat16")
# The spec's core cases: every implementation must run each of them in at least one dtype
# (plain self-attention, cross-attention, GQA, causal, padding).
CORE_CASES = ("self_attention", "cross_attention", "gqa", "causal", "padding")


def coverage_shortfall(backend, strategy: str, device: str = "cpu") -> dict[str, str]:
    """The core cases ``backend`` refuses in every dtype, each with its reasons; empty when it covers them all.

    The rule of the registry suite: an adapter that declares a core case unsupported in
    every dtype would otherwise pass it by skipping, so it fails here instead.
    """
    shortfall = {}
    for name in CORE_CASES:
        reasons = [backend.unsupported_reason(SPEC_CASES[name].cfg, dtype, device, strategy) for dtype in DTYPES]
        if all(reasons):
            shortfall[name] = "; ".join(dict.fromkeys(reasons))
    return shortfall


# The one exemption, by name and by reason: tensor parallelism over a fixed world of 2 ranks
# gives every rank whole heads, so it cannot run the 3-head core cases; it must run the others.
WHOLE_HEADS_PER_RANK = {"torch-tp": "does not divide n_heads"}


def required_core_cases(name: str, backend, strategy: str) -> set[str]:
    """The core cases an implementation must run; fails (AssertionError) when it refuses one it may not.

    Every core case, except for an exempted backend (`WHOLE_HEADS_PER_RANK`) the cases it refuses
    for exactly that reason; an exempted backend must still run at least one.
    """
    shortfall = coverage_shortfall(backend, strategy)
    exempt = WHOLE_HEADS_PER_RANK.get(name)
    allowed = {case for case, reason in shortfall.items() if exempt and exempt in reason}
    assert set(shortfall) == allowed, f"{name}:{strategy} refuses core cases in every dtype: {shortfall}"
    required = set(CORE_CASES) - allowed
    assert required, f"{name}:{strategy} runs no core case at all"
    return required


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


def empty_rows_case(cfg: MHAConfig, cross: bool = True) -> SpecCase:
    """Rows with no allowed key, one in a single head (the check's own cases block whole rows).

    Query 3 of batch item 0 may attend to nothing in head 1 only; query 5 of batch item 1
    to nothing in any head; every other query sees all keys (5 of them with ``cross``).
    """
    return SpecCase(
        "empty-rows",
        "rows with no allowed key, one of them in a single head",
        cfg,
        kv_tokens=KV_TOKENS if cross else None,
        blocked_rows=((1, 5),),
        head_blocked_rows=((0, 1, 3),),
    )


def assert_output_matches_reference(backend, case: SpecCase, dtype: str, strategy: str) -> None:
    output = case.run(backend, dtype, strategy)
    expected = case.reference()
    assert output.shape == expected.shape
    level = backend_level(backend, dtype)
    assert_close(output, expected, level, what=f"{backend.name}/{strategy}/{dtype} (held at {level}) on {case}")


def assert_every_stage_matches_reference(backend, case: SpecCase, dtype: str, strategy: str) -> None:
    _, stages = case.run(backend, dtype, strategy, return_stages=True)
    # The chunked strategy never holds the whole scores or weights: every other stage.
    names = [n for n in stage_names(case.cfg) if strategy != CHUNKED or n not in CHUNKED_HIDDEN_STAGES]
    assert_stages_close(stages, case.reference_stages(), backend_level(backend, dtype), names)


def assert_direct_reshape_is_caught_at_q_heads(backend, case: SpecCase, dtype: str) -> None:
    """The known mistake gives an output of the right shape, finite, but wrong from q_heads on.

    With one kv head, no mask and no rotary embedding every head attends with the same keys
    and values over all tokens, so the mistake undone the same way cancels out in the
    output (the check reports it as caught by its stages): there the output must be right.
    """
    output, stages = case.run(backend, dtype, DIRECT_RESHAPE, return_stages=True)
    expected = case.reference()
    assert output.shape == expected.shape  # shape-correct ...
    assert np.isfinite(output).all()
    cfg = case.cfg
    cancels = cfg.n_kv_heads == 1 and not case.has_mask and not cfg.causal and cfg.rope is None
    with np.errstate(invalid="ignore"):
        assert compare(output, expected, dtype).ok == cancels  # ... but wrong, unless it cancels
    assert first_differing_stage(stages, case.reference_stages(), dtype) == "q_heads"
