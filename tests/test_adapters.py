"""Every registered implementation against the float64 oracle, on the check's spec cases.

One module parametrized over the registry: a backend registered later is tested here
without a line of test code. Each (backend, strategy) runs every case of
`checks.cases` (the check's own catalogue) in every dtype for the output, and in the
case's own dtypes stage by stage; every backend with the known-mistake strategy must
get caught at ``q_heads``. What is specific to one convention (layouts, notes, half
precision policies, devices) stays in that adapter's own module.
"""

from __future__ import annotations

import pytest
from adapter_cases import (
    CASES,
    CORE_CASES,
    DTYPES,
    assert_direct_reshape_is_caught_at_q_heads,
    assert_every_stage_matches_reference,
    assert_output_matches_reference,
    coverage_shortfall,
    required_core_cases,
)

from mha_rosetta.backends import (
    DIRECT_RESHAPE,
    KNOWN_WRONG_STRATEGIES,
    REGISTRY,
    STANDARD,
    Backend,
    get_backend,
    missing_backends,
    register,
)
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.core import prepare_inputs


def _backend_params(strategies: str) -> list:
    """pytest params (backend name, strategy) of every registered implementation; a missing one skips with the reason.

    ``strategies``: "correct" (every strategy of plain attention but the known mistakes) or "mistake" (the known
    mistake only).
    """
    missing = missing_backends()
    params = []
    for name, entry in REGISTRY.items():
        if entry.kind != "implementation":
            continue
        if name in missing:
            params.append(pytest.param(name, None, marks=pytest.mark.skip(reason=missing[name]), id=name))
            continue
        # class attributes: the framework is not imported; MLA's forms run MLA only (tests/test_mla_adapters.py)
        for strategy in (s for s in get_backend(name).strategies if s not in MLA_STRATEGIES):
            wanted = strategy not in KNOWN_WRONG_STRATEGIES if strategies == "correct" else strategy == DIRECT_RESHAPE
            if wanted:
                params.append(pytest.param(name, strategy, id=f"{name}:{strategy}"))
    return params


def _backend(name: str, case, dtype: str, strategy: str):
    backend = get_backend(name)
    data = case.inputs()
    inputs = prepare_inputs(case.cfg, *data.arrays, data.positions, data.kv_positions)
    reason = backend.unsupported_reason(case.cfg, dtype, "cpu", strategy) or backend.positions_reason(
        case.cfg, inputs, strategy
    )
    if reason:
        pytest.skip(reason)
    return backend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize(("name", "strategy"), _backend_params("correct"))
def test_output_matches_reference(name, strategy, case, dtype):
    assert_output_matches_reference(_backend(name, case, dtype, strategy), case, dtype, strategy)


@pytest.mark.parametrize(("case", "dtype"), [(case, dtype) for case in CASES for dtype in case.dtypes], ids=str)
@pytest.mark.parametrize(("name", "strategy"), _backend_params("correct"))
def test_every_stage_matches_reference(name, strategy, case, dtype):
    assert_every_stage_matches_reference(_backend(name, case, dtype, strategy), case, dtype, strategy)


@pytest.mark.parametrize(("case", "dtype"), [(case, dtype) for case in CASES for dtype in case.dtypes], ids=str)
@pytest.mark.parametrize(("name", "strategy"), _backend_params("mistake"))
def test_direct_reshape_mistake_is_caught_at_q_heads(name, strategy, case, dtype):
    assert_direct_reshape_is_caught_at_q_heads(_backend(name, case, dtype, strategy), case, dtype)


@pytest.mark.parametrize(("name", "strategy"), _backend_params("correct"))
def test_every_implementation_runs_the_core_cases(name, strategy):
    """The skips above may not add up to nothing: each core case runs in at least one dtype."""
    required_core_cases(name, get_backend(name), strategy)


class RefusesEverything(Backend):
    """An adapter that declares every case unsupported: the registry suite would skip it throughout."""

    def unsupported_reason(self, cfg, dtype, device, strategy):
        return "this adapter supports nothing"

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        raise AssertionError("never reached: every case is refused")


def test_the_coverage_rule_rejects_an_adapter_that_refuses_every_core_case():
    register("refuses-everything", RefusesEverything)
    try:
        # It shows up as a parameter of the suite like any registered implementation ...
        assert "refuses-everything:standard" in [p.id for p in _backend_params("correct")]
        # ... each of its output tests would skip, and the coverage rule names every core case, with the reason.
        shortfall = coverage_shortfall(get_backend("refuses-everything"), STANDARD)
        assert shortfall == dict.fromkeys(CORE_CASES, "this adapter supports nothing")
        with pytest.raises(AssertionError, match="refuses core cases in every dtype"):
            required_core_cases("refuses-everything", get_backend("refuses-everything"), STANDARD)
    finally:
        del REGISTRY["refuses-everything"]
    # A real adapter passes the same rule (the numpy backend runs every core case).
    assert coverage_shortfall(get_backend("numpy"), STANDARD) == {}
