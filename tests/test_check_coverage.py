"""The default check gives every spec case to every implementation, in a dtype it supports.

Before, each case ran only in the dtypes it lists, so an adapter with float64 only never
saw the GQA (float16) or causal (float32) case, and a float32-only one never saw GQA, MQA,
padding or d_v != d_k. Now an implementation that supports none of a case's dtypes runs
it in the first requested dtype it does support (`checks.agreement.case_dtypes_for`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
from adapter_cases import required_core_cases
from misbehaving_adapters import oracle_stages

from conftest import installed_backend
from mha_rosetta.backends import REGISTRY, STANDARD, Backend, Prepared
from mha_rosetta.checks import SPEC_CASES, Status, run_check
from mha_rosetta.core import DTYPE_NAMES, VARIANTS


class OracleFake(Backend):
    """The float64 oracle rounded to the run's dtype: right on every case, with the dtypes a test gives it."""

    variants = frozenset(VARIANTS)  # it is the oracle, so it computes every variant
    causal_on_positions = True  # and its causality is on positions

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        stages, native = oracle_stages(cfg, params, inputs, dtype)
        to_numpy = lambda r: np.asarray(r, dtype=np.float64)  # noqa: E731
        return Prepared(forward=lambda: stages["output"], to_numpy=to_numpy, native_stages=lambda: native)


@pytest.mark.parametrize("dtypes", [("float64",), ("float32",), ("bfloat16",)])
def test_an_adapter_with_one_dtype_gets_every_case(dtypes):
    class OneDtype(OracleFake):
        pass

    OneDtype.dtypes = dtypes
    backend = OneDtype("one-dtype")
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

    class Float64Only(OracleFake):
        dtypes = ("float64",)
        variants = frozenset()  # the 2017-23 cases only: its tiling below knows nothing of QK-norm weights

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
    result = run_check(backends=[backend])
    statuses = {run.case: run.status for run in result.runs}
    assert statuses["gqa"] is Status.DISAGREE
    assert result.exit_status == 1


@functools.cache
def _default_check():
    """The default check of every installed backend (standard strategy: the others add no dtype logic)."""
    return run_check(strategies=[STANDARD])


@pytest.mark.slow  # one default check of every installed backend (about 30 s of CPU)
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_installed_implementation_ran_every_case_it_can_express(name):
    backend = installed_backend(name)
    runs = [run for run in _default_check().runs if run.impl.backend == name]
    ran = {run.case for run in runs if run.compared}
    # What the backend declares, asked independently of the check: the cases it can express
    # in at least one dtype of the default selection, in one of its strategies (MLA's only in its naive and
    # absorbed ones: backends._mla).
    expressible = {
        case.name
        for case in SPEC_CASES.values()
        if any(
            backend.unsupported_reason(case.cfg, dtype, "cpu", strategy) is None
            for dtype in DTYPE_NAMES
            for strategy in backend.strategies
        )
    }
    assert ran <= expressible  # nothing ran that the backend says it cannot express
    for case_name in expressible - ran:
        # Expressible by configuration yet not run: only refused at prepare for its inputs (e.g.
        # rotary positions a library fixes), each run in a dtype the case lists, with the reason.
        left_out = [run for run in runs if run.case == case_name]
        assert left_out and all(run.status is Status.UNSUPPORTED and run.reason for run in left_out), case_name
        assert all(run.dtype in SPEC_CASES[case_name].dtypes for run in left_out), case_name
    for case_name in set(SPEC_CASES) - expressible:
        assert all(run.status is Status.UNSUPPORTED for run in runs if run.case == case_name), case_name
    # A minimum every implementation of ours must run, whatever it declares (third-party
    # oracles are libraries with documented limits, e.g. no GQA: they have no minimum).
    if REGISTRY[name].kind == "implementation":
        required = required_core_cases(name, backend, STANDARD)
        assert required <= ran, f"{name} did not run {sorted(required - ran)}"
    assert {run.status for run in runs if run.compared} <= {Status.AGREE, Status.KNOWN_DIFFERENCE}
