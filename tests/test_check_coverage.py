"""The default check gives every spec case to every implementation, in a dtype it supports.

Before, each case ran only in the dtypes it lists, so an adapter with float64 only never
saw the GQA (float16) or causal (float32) case, and a float32-only one never saw GQA, MQA,
padding or d_v != d_k. Now an implementation that supports none of a case's dtypes runs
it in the first requested dtype it does support (`checks.agreement.case_dtypes_for`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from test_check import FakeBackend

from mha_rosetta.backends import REGISTRY, STANDARD, get_backend, missing_backends
from mha_rosetta.checks import SPEC_CASES, Status, run_check
from mha_rosetta.core import DTYPE_NAMES


@pytest.mark.parametrize("dtypes", [("float64",), ("float32",), ("bfloat16",)])
def test_an_adapter_with_one_dtype_gets_every_case(dtypes):
    class OneDtype(FakeBackend):
        pass

    OneDtype.dtypes = dtypes
    backend = OneDtype("one-dtype")
    backend.strategies = (STANDARD,)
    result = run_check(backends=[backend])
    agreed = {run.case for run in result.runs if run.status is Status.AGREE}
    assert agreed == set(SPEC_CASES)
    assert {run.dtype for run in result.runs if run.status is Status.AGREE} == set(dtypes)
    # Cases that list a dtype it has run in that dtype only; no fallback is added on top.
    for case in SPEC_CASES.values():
        ran = [run.dtype for run in result.runs if run.case == case.name]
        assert ran == (list(case.dtypes) if set(dtypes) & set(case.dtypes) else list(dtypes)), case.name


def test_a_tiled_gqa_bug_in_a_float64_adapter_is_caught_by_the_default_check():
    """The issue's example: GQA (listed in float16 only) used to reach no float64-only adapter."""

    class Float64Only(FakeBackend):
        dtypes = ("float64",)

        def _prepare(self, cfg, params, inputs, dtype, device, strategy):
            if cfg.n_kv_heads not in (1, cfg.n_heads):  # tile the kv heads instead of repeating them
                order = [
                    (h % cfg.n_kv_heads) * (cfg.n_heads // cfg.n_kv_heads) + h // cfg.n_kv_heads
                    for h in range(cfg.n_heads)
                ]
                w_q = params.w_q.reshape(cfg.n_heads, cfg.d_k, -1)[order].reshape(params.w_q.shape)
                b_q = params.b_q.reshape(cfg.n_heads, cfg.d_k)[order].reshape(-1)
                w_o = params.w_o.reshape(params.w_o.shape[0], cfg.n_heads, cfg.d_v)[:, order].reshape(params.w_o.shape)
                params = replace(params, w_q=w_q, b_q=b_q, w_o=w_o)
            return super()._prepare(cfg, params, inputs, dtype, device, strategy)

    backend = Float64Only("tiled-gqa")
    backend.strategies = (STANDARD,)
    result = run_check(backends=[backend])
    statuses = {run.case: run.status for run in result.runs}
    assert statuses["gqa"] is Status.DISAGREE
    assert result.exit_status == 1


@functools.cache
def _default_check():
    """The default check of every installed backend (standard strategy: the others add no dtype logic)."""
    return run_check(strategies=[STANDARD])


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_installed_implementation_ran_every_case_it_can_express(name):
    if name in missing_backends():
        pytest.skip(missing_backends()[name])
    backend = get_backend(name)
    runs = [run for run in _default_check().runs if run.impl.backend == name]
    ran = {run.case for run in runs if run.compared}
    unsupported = set(SPEC_CASES) - ran
    for case_name in unsupported:
        case = SPEC_CASES[case_name]
        # Only a case the backend can express in no dtype at all may be left out, with the reason.
        reasons = [backend.unsupported_reason(case.cfg, dtype, "cpu", STANDARD) for dtype in DTYPE_NAMES]
        assert all(reasons), (case_name, reasons)
        assert all(run.status is Status.UNSUPPORTED and run.reason for run in runs if run.case == case_name)
    assert ran == set(SPEC_CASES) - unsupported
    assert {run.status for run in runs if run.compared} <= {Status.AGREE, Status.KNOWN_DIFFERENCE}
