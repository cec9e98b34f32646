"""The gradient check: every implementation's backward pass against the float64 backward oracle and each other.

For every spec case and dtype, each (backend, strategy, device) runs `Backend.run_vjp` with the
case's fixed cotangent (`core.default_cotangent`, never all-ones). Every gradient tensor
(``d_query``, ``d_key``, ``d_value``, ``w_q`` ... ``b_o``) is compared

- with `core.reference_mha_vjp` under `core.grad_tolerance`: float64/float32 from the gradient
  table, float16/bfloat16 by the half rule (at most twice the error of the spec's own float32
  path rounded to that dtype, plus one unit in the last place), and
- with every other run of the same case and dtype: float64/float32 under the same table,
  half dtypes within the sum of the two sides' half-rule allowances (the triangle inequality).

Statuses are those of the forward check (`checks.results.Status`). The direct-reshape
mistake must disagree in some gradient; where its gradients happen to agree (one kv head:
a wrong split undone the same way cancels), its backward or forward stages must still show
it. A third-party oracle whose only difference is NaN gradients from query rows with nothing
to attend to is a named known difference. When a run disagrees, the report names the first
divergent backward stage (`core.GRAD_STAGES` order) where the implementation exposes its
backward stages, else the worst gradient tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import (
    GRAD_STAGES,
    MHAGrads,
    allowed_positions,
    error_line,
    grad_tolerance,
    prepare_inputs,
    reference_mha_vjp,
    reference_stages,
)

from .agreement import backend_level, compare, failure_status
from .cases import SpecCase
from .divergence import first_divergence
from .engine import Job
from .results import GradCheckResult, GradPair, GradRun, Implementation, Status, TensorError, settle_known_mistake
from .selection import Selection


@dataclass
class _GradOracle:
    case: SpecCase
    grads: MHAGrads
    baselines: dict[str, dict[str, float]]  # half dtype -> tensor -> max abs error of the rounded spec path
    empty_rows: int  # (batch item, head, query) rows with no allowed key


def _max_abs_error(actual, expected) -> float:
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.asarray(actual, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    finite = diff[np.isfinite(diff)]
    return float(finite.max()) if finite.size else 0.0


def _grad_oracle(case: SpecCase, dtypes) -> _GradOracle:
    args, where = case.arguments()  # where: the rotary positions
    grads = reference_mha_vjp(*args, **where)
    baselines = {}
    for dtype in dtypes:
        if dtype in ("float16", "bfloat16"):
            rounded = reference_mha_vjp(*args, **where, rounding=dtype).tensors()
            baselines[dtype] = {name: _max_abs_error(rounded[name], g) for name, g in grads.tensors().items()}
    inputs = prepare_inputs(args[0], *args[2:], **where)  # (cfg, query, key, value, mask)
    allowed = allowed_positions(case.cfg, inputs)
    empty = 0 if allowed is None else int((~allowed.any(axis=-1)).sum())
    return _GradOracle(case, grads, baselines, empty)


def _tensor_errors(grads: MHAGrads, oracle: _GradOracle, dtype: str) -> dict[str, TensorError]:
    expected = oracle.grads.tensors()
    actual = grads.tensors()
    out = {}
    for name, e in expected.items():
        if name not in actual:
            out[name] = TensorError(np.inf, 0.0, False, "missing")
            continue
        tol = grad_tolerance(dtype, e, oracle.baselines.get(dtype, {}).get(name))
        result = compare(actual[name], e, dtype, atol=tol.atol, rtol=tol.rtol)
        out[name] = TensorError(result.max_abs, tol.atol, result.ok, result.reason)
    return out


def _first_divergent_backward_stage(stages: dict, reference: dict, dtype: str) -> str | None:
    for name, _ in GRAD_STAGES:
        if name in stages and name in reference:
            tol = grad_tolerance(dtype, reference[name])
            if not compare(stages[name], reference[name], dtype, atol=tol.atol, rtol=tol.rtol).ok:
                return name
    return None


def _run_one(backend, strategy: str, device: str, dtype: str, oracle: _GradOracle) -> GradRun:
    case = oracle.case
    run = GradRun(case.name, Implementation(backend.name, strategy, device), dtype, backend.kind, Status.ERROR)
    args, where = case.arguments()  # where: the rotary positions
    started = time.perf_counter()
    try:
        grads = backend.run_vjp(*args, dtype=dtype, device=device, strategy=strategy, **where)
    except Exception as error:  # a failing cell is reported and the check goes on
        run.status, run.reason = failure_status(error)
        return run
    run.seconds = time.perf_counter() - started
    run.grads = grads
    run.tensors = _tensor_errors(grads, oracle, dtype)
    bad = [name for name, t in run.tensors.items() if not t.ok]
    if run.impl.known_mistake:
        run.status = Status.CAUGHT
        if bad:
            run.reason = f"gradients of {', '.join(bad)} disagree"
        else:
            stage = _first_divergent_backward_stage(grads.stages, oracle.grads.stages, dtype)
            shown_at = f"backward stage {stage}" if stage else None
            if shown_at is None:  # no backward stages exposed (autograd): the forward stages show it
                _, stages = backend.run(
                    *args, return_stages=True, dtype=dtype, device=device, strategy=strategy, **where
                )
                divergence = first_divergence(reference_stages(*args, **where), stages, dtype)
                shown_at = None if divergence is None else f"forward stage {divergence.stage}"
            if shown_at is None:
                run.status, run.reason = Status.MISSED, "the known mistake agrees with the oracle in every gradient"
            else:
                run.reason = f"the gradients happen to agree on this case; the mistake shows at {shown_at}"
        return run
    if not bad:
        run.status = Status.AGREE
        return run
    if backend.kind == "oracle" and getattr(backend, "half_precision_softmax", False) and dtype in oracle.baselines:
        table = {name: grad_tolerance(dtype, oracle.grads.tensors()[name]) for name in bad}
        if all(run.tensors[name].max_abs <= table[name].atol for name in bad):
            run.status = Status.KNOWN_DIFFERENCE
            run.reason = (
                f"the library computes its softmax in {dtype} (declared): {', '.join(bad)} beyond the half rule's "
                f"2x the spec path, within the {dtype} gradient table (atol {table[bad[0]].atol:.2g})"
            )
            return run
    level = backend_level(backend, dtype)  # a precision limit the adapter declares
    if level != dtype and all(t.ok for t in _tensor_errors(grads, oracle, level).values()):
        run.status = Status.KNOWN_DIFFERENCE
        run.reason = f"the library computes at {level}'s level inside a {dtype} run (declared): {', '.join(bad)} "
        run.reason += f"beyond {dtype}'s gradient table, within {level}'s"
        return run
    nan_only = all("NaN" in run.tensors[name].reason for name in bad)
    if backend.kind == "oracle" and nan_only and oracle.empty_rows:
        run.status = Status.KNOWN_DIFFERENCE
        run.reason = (
            f"NaN gradients ({', '.join(bad)}) from {oracle.empty_rows} query row(s) with no allowed key; "
            "the spec gives those rows zero weights and zero gradient"
        )
        return run
    run.status = Status.DISAGREE
    run.divergent_stage = _first_divergent_backward_stage(grads.stages, oracle.grads.stages, dtype)
    name, worst = run.worst()
    where = f"; first divergent backward stage {run.divergent_stage}" if run.divergent_stage else ""
    run.reason = (
        f"{', '.join(bad)} outside tolerance (worst {name}: max abs {worst.max_abs:.3g} > {worst.atol:.3g}){where}"
    )
    return run


def _compare_pair(a: GradRun, b: GradRun, oracle: _GradOracle) -> GradPair:
    dtype = a.dtype
    worst_name, worst_abs, bad = "", 0.0, []
    ta, tb = a.grads.tensors(), b.grads.tensors()
    for name, expected in oracle.grads.tensors().items():
        if name not in ta or name not in tb:
            continue
        baseline = oracle.baselines.get(dtype, {}).get(name)
        tol = grad_tolerance(dtype, expected, baseline)
        atol = 2 * tol.atol if baseline is not None else tol.atol  # half rule: each side within its allowance
        result = compare(ta[name], tb[name], dtype, atol=atol, rtol=tol.rtol)
        if result.max_abs >= worst_abs:
            worst_name, worst_abs = name, result.max_abs
        if not result.ok:
            bad.append(name)
    pair = GradPair(oracle.case.name, a, b, dtype, Status.AGREE, worst_name, worst_abs)
    if settle_known_mistake(pair, a, b, not bad, "gradients"):
        return pair
    known = [run for run in (a, b) if run.status is Status.KNOWN_DIFFERENCE]
    if known:
        pair.status, pair.reason = Status.KNOWN_DIFFERENCE, "; ".join(f"{r.label}: {r.reason}" for r in known)
        return pair
    pair.status, pair.reason = Status.DISAGREE, f"{', '.join(bad)} differ (worst {worst_name}: max abs {worst_abs:.3g})"
    return pair


class GradientJob(Job):
    """The gradient check as an engine job (`checks.engine`)."""

    record = GradRun
    label = "gradients"

    def new_result(self, sel: Selection, devices) -> GradCheckResult:
        settings = {**sel.settings, "cotangent": "core.default_cotangent (fixed standard normal, never all-ones)"}
        return GradCheckResult(settings, sel.cases, sel.skipped, sel.broken)

    def oracle(self, case: SpecCase, dtypes) -> _GradOracle:
        return _grad_oracle(case, dtypes)

    def plan(self, case: SpecCase, sel: Selection) -> list[tuple[str, list[Implementation]]]:
        impls = [Implementation(b.name, strategy, device) for b, strategy, device in sel.implementations()]
        return [(dtype, impls) for dtype in sel.case_dtypes(case)]

    def run(self, backend, impl: Implementation, dtype: str, oracle: _GradOracle) -> GradRun:
        return _run_one(backend, impl.strategy, impl.device, dtype, oracle)

    def portable(self, run: GradRun) -> GradRun:
        return run  # numbers and NumPy gradients only

    def comparable(self, run: GradRun) -> bool:
        return run.compared and run.grads is not None

    def compare_pair(self, a: GradRun, b: GradRun, oracle: _GradOracle) -> GradPair:
        return _compare_pair(a, b, oracle)

    def release(self, runs: list[GradRun]) -> None:
        for run in runs:
            run.grads = None  # keep the numbers, drop the arrays

    def oracle_failed(self, case: SpecCase, sel: Selection, error: Exception) -> list[GradRun]:
        reason = f"gradient oracle failed: {error_line(error)}"
        impls = [Implementation(b.name, strategy, device) for b, strategy, device in sel.implementations()]
        kinds = {b.name: b.kind for b in sel.backends}
        return [
            GradRun(case.name, impl, dtype, kinds[impl.backend], Status.ERROR, reason)
            for dtype in sel.case_dtypes(case)
            for impl in impls
        ]


GRADIENT = GradientJob()
