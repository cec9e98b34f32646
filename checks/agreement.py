"""The all-pairs agreement check: every installed implementation, against the oracle and each other.

For every spec case and dtype, each (backend, strategy, device) runs once through the
`Backend` interface (`prepare`, `forward`, `to_numpy`). Its output is compared

- with the float64 oracle (`core.reference_stages`) at the tolerance of its dtype, and
- with every other run of the same case and dtype (other backends, strategies and
  devices) at the tolerance of the lower precision of the two (`core.lower_precision`).
  Pairs stay within one dtype: a float16 run against a float32 run says nothing that
  the two comparisons with the oracle do not, and would multiply the pairs by 16.

Each comparison gets one status (`Status`). The known mistake (`direct_reshape`) must
disagree: it counts as "caught" when it does and as a failure ("MISSED") if it ever
agrees. Its output can be right by accident (one kv head and no mask: a wrong split
undone the same way cancels out); then its stage tensors still show the mistake, and
it counts as caught at that stage, with the reason saying so. A third-party oracle that differs from the spec only where a library
convention says it will (a query row with no allowed key: NaN or a uniform average
instead of the spec's zero weights) is a "known difference" with the reason spelled
out; our own implementations get no such leniency. When two sides disagree the
divergence report names the first stage where they part (`checks.divergence`).

A run that raises is recorded as an error and the check goes on with the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from mha_rosetta.backends import CHECK_CHUNK, CHUNKED, Backend, BackendNotInstalled, UnsupportedCase
from mha_rosetta.core import (
    Comparison,
    MHAConfig,
    MHAParams,
    error_line,
    lower_precision,
    reference_stages,
)
from mha_rosetta.core import compare as core_compare

from .cases import SpecCase
from .devices import frameworks_without_gpu
from .divergence import Divergence, first_divergence
from .engine import Job
from .results import CheckResult, Implementation, Pair, Run, Status, settle_known_mistake
from .selection import Selection, _split, case_dtypes_for


# -- the oracle and one run ---------------------------------------------------------------
@dataclass
class _Oracle:
    case: SpecCase
    cfg: MHAConfig
    params: MHAParams
    data: object  # CaseInputs
    stages: dict
    empty_rows: np.ndarray  # (B, Nq) rows with a head that may attend to no key
    allowed: np.ndarray  # (B, H, Nq, Nk)


def _oracle(case: SpecCase) -> _Oracle:
    params = case.params()
    data = case.inputs()
    args = (data.query, data.key, data.value, data.mask, data.positions, data.kv_positions)
    stages = reference_stages(case.cfg, params, *args)
    allowed = case.allowed()  # (B, H, Nq, Nk)
    return _Oracle(case, case.cfg, params, data, stages, case.empty_rows(), allowed)


def _uniform_fallback_output(oracle: _Oracle) -> np.ndarray:
    """The output if rows with no allowed key averaged every value uniformly (JAX/Flax-style masking)."""
    cfg, stages = oracle.cfg, oracle.stages
    weights = stages["weights"].copy()  # (B, H, Nq, Nk)
    empty = ~oracle.allowed.any(axis=-1)  # (B, H, Nq)
    weights[empty] = 1.0 / weights.shape[-1]
    kv_of_head = [cfg.kv_head_of(h) for h in range(cfg.n_heads)]
    v_per_query_head = stages["v_heads"][:, kv_of_head]  # (B, H, Nk, Dv)
    context = weights @ v_per_query_head  # (B, H, Nq, Dv)
    batch, heads, q_tokens, d_v = context.shape
    merged = context.transpose(0, 2, 1, 3).reshape(batch, q_tokens, heads * d_v)  # (B, Nq, H*Dv)
    output = merged @ oracle.params.w_o.T
    return output if oracle.params.b_o is None else output + oracle.params.b_o


def _empty_row_difference(
    actual: np.ndarray, expected: np.ndarray, oracle: _Oracle, dtype: str, uniform=None
) -> tuple[Comparison, str] | None:
    """If ``actual`` agrees with ``expected`` except on rows with no allowed key, say how it differs there."""
    empty = oracle.empty_rows
    if not empty.any():
        return None
    rest = compare(actual[~empty], expected[~empty], dtype)
    if not rest.ok:
        return None
    rows = np.asarray(actual[empty], dtype=np.float64)
    if np.isnan(rows).all():
        what = "NaN"
    elif uniform is not None and compare(rows, uniform[empty], dtype).ok:
        what = "a uniform average over all keys (the mask is a large negative number, not -inf)"
    else:
        spec_rows = compare(rows, expected[empty], dtype)
        what = f"other values (max abs {spec_rows.max_abs:.3g} from the spec's)"
    count = int(empty.sum())
    reason = (
        f"a query row with no allowed key gives {what}; the spec gives zero weights, output = b_o ({count} such row(s))"
    )
    return rest, reason


def compare(actual, expected, dtype: str, **tolerance) -> Comparison:
    """`core.compare` (``tolerance``: its atol, rtol), quiet about the NaN arithmetic of a NaN-returning library."""
    with np.errstate(invalid="ignore"):
        return core_compare(actual, expected, dtype, **tolerance)


def failure_status(error: BaseException) -> tuple[Status, str]:
    """A run that raised: unsupported (the backend's reason), skipped (not installed) or an error."""
    if isinstance(error, UnsupportedCase):
        return Status.UNSUPPORTED, str(error)
    if isinstance(error, BackendNotInstalled):
        return Status.SKIPPED, str(error)
    return Status.ERROR, error_line(error)


def _prepare(backend: Backend, strategy: str, device: str, dtype: str, oracle: _Oracle):
    data = oracle.data
    prepared, _ = backend.prepare(
        oracle.cfg,
        oracle.params,
        *data.arrays,
        dtype=dtype,
        device=device,
        strategy=strategy,
        **data.positions_kwargs,
        # Blocks that divide none of the cases' token counts, so the recurrence really runs.
        **({"chunk": CHECK_CHUNK} if strategy == CHUNKED else {}),
    )
    return prepared


def run_output(run: Run, prepare: Callable, expected_shape: tuple, axes: str):
    """``prepare()``, then its output into ``run`` (with its seconds and info); the prepared run, or None when
    it raised (the run's status and reason say how: `failure_status`) or its output has another shape than
    ``expected_shape`` (``axes`` names them). A failing cell is reported and the check goes on."""
    started = time.perf_counter()
    try:
        prepared = prepare()
        output = np.asarray(prepared.output())
    except Exception as error:
        run.status, run.reason = failure_status(error)
        return None
    run.seconds = time.perf_counter() - started
    run.info = dict(prepared.info)
    if output.shape != expected_shape:
        run.reason = f"output has shape {output.shape}, expected {expected_shape} ({axes})"
        return None
    run.output = output
    return prepared


def _run_one(backend: Backend, strategy: str, device: str, dtype: str, oracle: _Oracle, uniform: np.ndarray) -> Run:
    case = oracle.case
    run = Run(case.name, Implementation(backend.name, strategy, device), dtype, backend.kind, Status.ERROR)
    expected = oracle.stages["output"]
    prepare = partial(_prepare, backend, strategy, device, dtype, oracle)
    prepared = run_output(run, prepare, expected.shape, "batch, q_tokens, d_model")
    if prepared is None:
        return run
    output = run.output
    run.stage_source = lambda: backend.canonical_stages(prepared)

    result = compare(output, expected, dtype)
    run.tolerance = result.tolerance
    run.max_abs, run.max_rel = result.max_abs, result.max_rel
    if run.impl.known_mistake:
        run.status = Status.CAUGHT
        if result.ok:
            # The output can be right by accident (with one kv head and no mask, a wrong
            # split undone the same way cancels out); the stages still show the mistake.
            run.divergence = _divergence(oracle.stages, run, dtype)
            if run.divergence is None:
                run.status, run.reason = (
                    Status.MISSED,
                    "the known mistake agrees with the oracle at every stage it exposes",
                )
            else:
                run.reason = (
                    f"the output happens to agree on this case; the mistake shows at stage {run.divergence.stage}"
                )
            return run
    elif result.ok:
        run.status = Status.AGREE
        mapped = run.info.get("empty_rows_mapped", 0) if backend.kind == "oracle" else 0
        if mapped:
            # The adapter replaced the library's answer with the spec's: agreement here is
            # the adapter's doing, so the run says so instead of passing as plain "agree".
            run.status = Status.KNOWN_DIFFERENCE
            run.reason = (
                f"{mapped} query row(s) with no allowed key: the library's answer differs from the spec's "
                "(see its declared differences); the adapter mapped it to the spec's, output = b_o"
            )
    else:
        level = declared_level(run.info, dtype)  # the rows it shares with the spec, at its declared level
        known = _empty_row_difference(output, expected, oracle, level, uniform) if backend.kind == "oracle" else None
        if known and level != dtype:
            known = (known[0], f"{known[1]}; the other rows at {level}'s tolerance (declared: info['tolerance_dtype'])")
        known = known or _known_answer(backend, run, oracle, dtype)
        if not known and level != dtype and (declared := compare(output, expected, level)).ok:
            run.status, run.reason = Status.KNOWN_DIFFERENCE, declared_level_reason(dtype, level, result, declared)
        elif known:
            rest, run.reason = known
            run.status = Status.KNOWN_DIFFERENCE
            run.max_abs, run.max_rel = rest.max_abs, rest.max_rel  # on the rows the spec and the library share
        else:
            run.status = Status.DISAGREE
            run.reason = result.summary()
    if run.status in (Status.DISAGREE, Status.CAUGHT):
        run.divergence = _divergence(oracle.stages, run, dtype)
        if run.divergence is not None and run.info.get("stages_note"):  # a fused node: say what it can show
            shown = ", ".join(run.divergence.compared)
            run.reason += f"; {run.label} can show only the stages {shown} ({run.info['stages_note']})"
    return run


def declared_level(info: dict, dtype: str) -> str:
    """The dtype whose tolerance holds a run: its own, or the lower level its adapter declares in
    ``info["tolerance_dtype"]`` (hf-attention: float32 softmax and rotary inside a float64 module; MLX:
    float32-accurate ``exp``/``sin``/``cos`` in float64). Reported as a known difference, never passed as agree."""
    declared = info.get("tolerance_dtype")
    return lower_precision(dtype, declared) if declared else dtype


def backend_level(backend, dtype: str) -> str:
    """The dtype whose tolerance holds ``backend``'s ``dtype`` runs where no run's info is at hand (the backward,
    a test): its own, or the level the backend declares (``tolerance_levels``: MLX's float64 -> float32)."""
    return getattr(backend, "tolerance_levels", {}).get(dtype, dtype)


def declared_level_reason(dtype: str, level: str, result, declared) -> str:
    return (
        f"the library computes at {level}'s level inside a {dtype} run (declared: info['tolerance_dtype']): max abs "
        f"{result.max_abs:.3g} beyond {dtype}'s tolerance, within {level}'s (atol {declared.tolerance.atol:.2g})"
    )


def _known_answer(backend: Backend, run: Run, oracle: _Oracle, dtype: str) -> tuple[Comparison, str] | None:
    """An oracle's declared known difference (``backend.known_answers``: the output its library gives because
    of it, from the oracle's stages) that ``run``'s output lands on within its dtype's tolerance, or None.
    The run's ``info["known_difference"]`` then names it, so that its pairs can say why they differ."""
    answers = getattr(backend, "known_answers", None) if backend.kind == "oracle" else None
    if answers is None:
        return None
    data = oracle.data
    args = (data.query, data.key, data.value, data.mask, data.positions, data.kv_positions)
    for answer in answers(oracle.cfg, oracle.params, args, oracle.stages, run.info):
        landed = compare(run.output, answer.output, dtype)
        if landed.ok:
            run.info["known_difference"] = answer.known.name
            return landed, f"known difference {answer.known.name}: {answer.known.line()}"
    return None


def _divergence(reference: dict, run: Run, dtype: str) -> Divergence | None:
    try:
        stages = run.stages()
    except Exception as error:  # a broken stage dump must not hide the disagreement itself
        run.reason = (run.reason + "; " if run.reason else "") + f"stages unavailable ({error_line(error)})"
        return None
    return first_divergence(reference, stages, dtype)


def _compare_pair(a: Run, b: Run, oracle: _Oracle) -> Pair:
    dtype = lower_precision(a.dtype, b.dtype)
    result = compare(a.output, b.output, dtype)
    pair = Pair(oracle.case.name, a, b, dtype, Status.AGREE, result.max_abs, result.max_rel)
    if settle_known_mistake(pair, a, b, result.ok, "outputs", "the known mistake agrees with a correct implementation"):
        return pair
    known_sides = [run for run in (a, b) if run.status is Status.KNOWN_DIFFERENCE]
    level = lower_precision(declared_level(a.info, dtype), declared_level(b.info, dtype))
    if known_sides and level != dtype and (declared := compare(a.output, b.output, level)).ok:
        pair.status, pair.reason = Status.KNOWN_DIFFERENCE, declared_level_reason(dtype, level, result, declared)
        return pair
    if known_sides:
        known = _empty_row_difference(a.output, b.output, oracle, level)
        if known:
            rest = known[0]
            pair.status, pair.max_abs, pair.max_rel = Status.KNOWN_DIFFERENCE, rest.max_abs, rest.max_rel
            pair.reason = "; ".join(f"{run.label}: {run.reason}" for run in known_sides)
            return pair
        explained = all(run.status in (Status.AGREE, Status.KNOWN_DIFFERENCE) for run in (a, b))
        if explained and any("known_difference" in run.info for run in known_sides):  # each side on its answer
            pair.status = Status.KNOWN_DIFFERENCE
            pair.reason = "; ".join(f"{run.label}: {run.reason}" for run in known_sides)
            return pair
    pair.status, pair.reason = Status.DISAGREE, result.summary()
    try:
        pair.divergence = first_divergence(a.stages(), b.stages(), dtype)
    except Exception as error:
        pair.reason += f"; stages unavailable ({error_line(error)})"
    return pair


# -- the job and the check ----------------------------------------------------------------
class ForwardJob(Job):
    """The forward check as an engine job (`checks.engine`): oracle, plan, one run, stages, pairs."""

    def new_result(self, sel: Selection, devices) -> CheckResult:
        """The empty result of this selection: its settings, the backends' declared differences, GPU readiness."""
        declared = {
            b.name: tuple(getattr(b, "known_differences", ()))
            for b in sel.backends
            if getattr(b, "known_differences", ())
        }
        result = CheckResult(
            sel.settings, sel.cases, sel.skipped, [], [], broken_backends=sel.broken, declared_differences=declared
        )
        if "gpu" in sel.devices and _split(devices) != ["all"]:  # "all": whatever devices are here
            result.frameworks_without_gpu = frameworks_without_gpu(sel.backends)
        return result

    def oracle(self, case: SpecCase, dtypes) -> tuple[_Oracle, np.ndarray]:
        oracle = _oracle(case)
        return oracle, _uniform_fallback_output(oracle)

    def plan(self, case: SpecCase, sel: Selection) -> list[tuple[str, list[Implementation]]]:
        chosen = {}  # every selected implementation -> the dtypes it runs this case in
        for backend, strategy, device in sel.implementations():
            impl = Implementation(backend.name, strategy, device)
            chosen[impl] = case_dtypes_for(backend, impl, case, sel.dtypes, sel.every_dtype)
        groups = [(d, [impl for impl, dtypes in chosen.items() if d in dtypes]) for d in sel.dtypes]
        return [(dtype, impls) for dtype, impls in groups if impls]

    def run(self, backend: Backend, impl: Implementation, dtype: str, oracle) -> Run:
        return _run_one(backend, impl.strategy, impl.device, dtype, *oracle)

    def stages(self, backend: Backend, impl: Implementation, dtype: str, oracle) -> dict:
        prepared = _prepare(backend, impl.strategy, impl.device, dtype, oracle[0])
        return backend.canonical_stages(prepared)

    def compare_pair(self, a: Run, b: Run, oracle) -> Pair:
        return _compare_pair(a, b, oracle[0])

    def oracle_failed(self, case: SpecCase, sel: Selection, error: Exception) -> list[Run]:
        reason = f"oracle failed: {error_line(error)}"
        return [
            Run(case.name, Implementation(backend.name), dtype, backend.kind, Status.ERROR, reason)
            for backend in sel.backends
            for dtype in sel.dtypes
        ]


FORWARD = ForwardJob()
