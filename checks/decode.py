"""The decode check: every implementation's KV-cache decoding against the full causal forward, and each other.

For every decode case (`checks.decode_cases`), each (backend, strategy, device, cache kind) runs
`Backend.prepare_decode_run` (the prefill, then the rest ``step`` tokens at a time through its
own cache) in each of the case's dtypes. Every token's output, (B, N, D), is compared

- with the oracle `core.decode.reference_decode` (the full causal float64 forward: caching
  changes how the work is split, never the numbers) under the dtype's tolerance, exactly as
  the forward check compares an output (`checks.agreement.compare`: `core.TOLERANCES`), and
- with every other run of the same case and dtype under the lower precision's tolerance
  (`core.lower_precision`), as the forward check's pairs are.

A disagreement is located in time, then in the pipeline: the first chunk (the prefill, or
step k) and its first divergent token's position, then the first divergent token-wise stage
(`core.decode.decode_stage_names`), comparing the run's step stages (`Backend.decode_stages`)
chunk by chunk with the oracle's (`core.decode.reference_decode_stages`) or with the other
run's: ``"step 3 (position 7) diverges at q_rotated"``, ``"prefill (positions 0..4) diverges at
context"``. Where an implementation exposes no stages, the first chunk whose output disagrees
is named, ``"... diverges at output"``. Statuses are the forward check's (`checks.results.Status`);
an implementation without decoding, or without the case's cache kind, strategy or variants,
is UNSUPPORTED with its `Backend.decode_reason`, never left out.

Design rules: the job knows no framework (backends are reached through `Backend` only), and it
plugs into `checks.engine` as the forward and gradient checks do (workers, time limits,
streamed JSON, timings).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, error_line, lower_precision
from mha_rosetta.core.decode import (
    DecodeInputs,
    decode_stage_names,
    reference_decode,
    reference_decode_stages,
    token_axis,
)

from .agreement import compare, declared_level, declared_level_reason, run_output
from .decode_cases import DecodeCase, get_decode_cases
from .engine import Job
from .results import DecodeCheckResult, DecodePair, DecodeRun, Implementation, Status, settle_known_mistake
from .selection import Selection, _split


# -- the oracle ---------------------------------------------------------------------------
@dataclass
class _DecodeOracle:
    case: DecodeCase
    cfg: MHAConfig
    params: MHAParams
    inputs: DecodeInputs
    output: np.ndarray  # (B, N, D) float64: the full causal forward
    stages: list[dict[str, np.ndarray]]  # per chunk, the token-wise stages sliced to its tokens


def _decode_oracle(case: DecodeCase) -> _DecodeOracle:
    params = case.params()
    inputs = case.decode_inputs()
    output = reference_decode(case.cfg, params, **case.run_args())  # batched: the case's x is (B, N, D)
    return _DecodeOracle(case, case.cfg, params, inputs, output, reference_decode_stages(case.cfg, params, inputs))


# -- where two decode runs part -----------------------------------------------------------
def chunk_label(inputs: DecodeInputs, index: int, item: int, token: int) -> str:
    """``"prefill (positions 0..4)"`` or ``"step 3 (position 7)"``: chunk ``index``, batch ``item``, absolute ``token``."""
    start, stop = inputs.chunks()[index]
    positions = inputs.positions[item]
    if index == 0:
        return f"prefill (positions {positions[start]}..{positions[stop - 1]})"
    return f"step {index} (position {positions[token]})"


def _first_token(actual: np.ndarray, expected: np.ndarray, axis: int, dtype: str) -> tuple[int, int] | None:
    """The first (batch item, chunk token) whose slice of a chunk's stage disagrees, or None."""
    for item in range(expected.shape[0]):
        a, e = np.asarray(actual)[item], np.asarray(expected)[item]
        for t in range(expected.shape[axis]):
            if not compare(np.take(a, t, axis=axis - 1), np.take(e, t, axis=axis - 1), dtype).ok:
                return item, t
    return None


def locate(
    inputs: DecodeInputs,
    cfg: MHAConfig,
    dtype: str,
    output: np.ndarray,
    expected_output: np.ndarray,
    stages: list[dict] | None,
    expected_stages: list[dict] | None,
) -> str:
    """Where ``output`` first parts from ``expected_output``: the chunk, its position and the first divergent stage.

    Chunks are walked in order; in each, the token-wise stages both sides expose (pipeline
    order, ``output`` last) are compared under ``dtype``'s tolerance. Without stages on either
    side, the chunk's output alone is compared. Returns "" when every chunk agrees.
    """
    names = [n for n in decode_stage_names(cfg) if n != "output"] + ["output"]
    both = stages is not None and expected_stages is not None and len(stages) == len(expected_stages)
    for index, (start, stop) in enumerate(inputs.chunks()):
        sides = {"output": (output[:, start:stop], expected_output[:, start:stop])}
        if both:
            for name in names[:-1]:
                if name in stages[index] and name in expected_stages[index]:
                    sides[name] = (stages[index][name], expected_stages[index][name])
        for name in names:
            if name not in sides:
                continue
            actual, expected = sides[name]
            if np.shape(actual) != np.shape(expected):
                return (
                    f"{chunk_label(inputs, index, 0, start)} diverges at {name} "
                    f"(shape {np.shape(actual)} != {np.shape(expected)})"
                )
            found = _first_token(actual, expected, token_axis(name), dtype)
            if found is not None:
                item, token = found
                return f"{chunk_label(inputs, index, item, start + token)} diverges at {name}"
    return ""


# -- one run ------------------------------------------------------------------------------
def _prepare(backend, impl: Implementation, dtype: str, oracle: _DecodeOracle):
    case = oracle.case
    prepared, _ = backend.prepare_decode_run(
        oracle.cfg,
        oracle.params,
        **case.run_args(),
        dtype=dtype,
        device=impl.device,
        strategy=impl.strategy,
        cache=impl.cache or None,
        **case.paging(impl.cache),
    )
    return prepared


def _stages_of(backend, prepared, cfg: MHAConfig) -> list[dict]:
    """The run's step stages, canonical; [] when the implementation exposes none."""
    return backend.decode_stages(prepared, cfg) or []


def _unsupported(case: DecodeCase, impl: Implementation, dtype: str, kind: str, reason: str) -> DecodeRun:
    return DecodeRun(case.name, impl, dtype, kind, Status.UNSUPPORTED, reason)


def _run_one(backend, impl: Implementation, dtype: str, oracle: _DecodeOracle) -> DecodeRun:
    case = oracle.case
    run = DecodeRun(case.name, impl, dtype, backend.kind, Status.ERROR)
    expected = oracle.output
    prepared = run_output(
        run, partial(_prepare, backend, impl, dtype, oracle), expected.shape, "batch, tokens, d_model"
    )
    if prepared is None:
        return run
    output = run.output
    run.stage_source = lambda: _stages_of(backend, prepared, oracle.cfg)
    result = compare(output, expected, dtype)
    run.tolerance = result.tolerance
    run.max_abs, run.max_rel = result.max_abs, result.max_rel
    if result.ok and not impl.known_mistake:
        run.status = Status.AGREE
        return run
    level = _level(run)
    if level != dtype and not impl.known_mistake and (declared := compare(output, expected, level)).ok:
        run.status = Status.KNOWN_DIFFERENCE
        run.reason = declared_level_reason(dtype, level, result, declared)
        if run.info.get("known_difference"):  # the oracle names the difference and its source (ONNX's sqrt_scale)
            run.reason += f"; known difference {run.info['known_difference']}: {run.info.get('note', '')}"
        return run
    run.where, note = _where(run, oracle, dtype)
    if impl.known_mistake:
        run.status = Status.CAUGHT if run.where else Status.MISSED
        run.reason = run.where or "the known mistake agrees with the oracle in every chunk and stage it exposes"
    else:
        run.status = Status.DISAGREE
        run.reason = f"{run.where}: {result.summary()}" if run.where else result.summary()
    run.reason += note
    return run


def _level(run: DecodeRun) -> str:
    """The dtype whose tolerance holds ``run``: its own, or the lower level its adapter declares in
    ``info["tolerance_dtype"]`` (`agreement.declared_level`)."""
    return declared_level(run.info, run.dtype)


def _where(run: DecodeRun, oracle: _DecodeOracle, dtype: str) -> tuple[str, str]:
    """The run's `locate` against the oracle, and a note when its stages could not be had."""
    try:
        stages, note = run.stages(), ""
    except Exception as error:  # a broken stage dump must not hide the disagreement itself
        stages, note = [], f"; stages unavailable ({error_line(error)})"
    return locate(oracle.inputs, oracle.cfg, dtype, run.output, oracle.output, stages or None, oracle.stages), note


def _compare_pair(a: DecodeRun, b: DecodeRun, oracle: _DecodeOracle) -> DecodePair:
    dtype = lower_precision(a.dtype, b.dtype)
    result = compare(a.output, b.output, dtype)
    pair = DecodePair(oracle.case.name, a, b, dtype, Status.AGREE, result.max_abs, result.max_rel)
    mistake = a.impl.known_mistake or b.impl.known_mistake
    level = lower_precision(_level(a), _level(b))
    if not result.ok and not mistake and level != dtype and (declared := compare(a.output, b.output, level)).ok:
        pair.status, pair.reason = Status.KNOWN_DIFFERENCE, declared_level_reason(dtype, level, result, declared)
        return pair
    if settle_known_mistake(pair, a, b, result.ok, "outputs"):
        return pair
    pair.status = Status.DISAGREE
    try:
        stages_a, stages_b = a.stages() or None, b.stages() or None
    except Exception as error:
        stages_a = stages_b = None
        pair.reason = f"stages unavailable ({error_line(error)}); "
    pair.where = locate(oracle.inputs, oracle.cfg, dtype, a.output, b.output, stages_a, stages_b)
    pair.reason += f"{pair.where}: {result.summary()}" if pair.where else result.summary()
    return pair


# -- the job and the check ----------------------------------------------------------------
def decode_implementations(case: DecodeCase, sel: Selection):
    """``(backend, Implementation)`` for every selected implementation and cache kind of ``case``.

    A backend without decoding gives one implementation per device, with its first selected
    strategy and no cache kind (its runs are unsupported, with the reason, which is the same
    for every strategy); otherwise each strategy it decodes with (``decode_strategies``; with
    ``--strategies`` given, every selected one, so that one it does not decode with is
    unsupported with the reason) times each kind in the case's ``caches`` (None: every kind
    the backend declares). The forward's other strategies (the known mistake, the chunked
    tiles) are not decode paths: `decode_summary_lines` names them once instead of per run.
    """
    seen = set()
    for backend, strategy, device in sel.implementations():
        if not backend.decode_caches:
            if (backend.name, device) not in seen:
                seen.add((backend.name, device))
                yield backend, Implementation(backend.name, strategy, device)
            continue
        if sel.strategy_filter is None and strategy not in backend.decode_strategies:
            continue
        kinds = backend.decode_caches if case.caches is None else case.caches
        for kind in kinds:
            yield backend, Implementation(backend.name, strategy, device, kind)


class DecodeJob(Job):
    """The decode check as an engine job (`checks.engine`): oracle, plan, one run, stages, pairs."""

    record = DecodeRun
    label = "decode"

    def select_cases(self, cases) -> list[DecodeCase]:
        """None (every decode case), names of `checks.decode_cases.DECODE_CASES`, or `DecodeCase` objects.

        Bad names raise ValueError naming the option.
        """
        names = None if cases is None else [cases] if isinstance(cases, (str, DecodeCase)) else list(cases)
        if names is None or all(isinstance(name, str) for name in names):
            return get_decode_cases(None if names is None else _split(names))
        return names

    def new_result(self, sel: Selection, devices) -> DecodeCheckResult:
        settings = {**sel.settings, "oracle": "core.decode.reference_decode (the full causal float64 forward)"}
        if sel.strategy_filter is None:  # the forward's strategies that are not decode paths, named once (not per run)
            settings["not_decode_paths"] = {
                b.name: [s for s in b.strategies if s not in b.decode_strategies]
                for b in sel.backends
                if b.decode_caches and set(b.strategies) - set(b.decode_strategies)
            }
        return DecodeCheckResult(settings, sel.cases, sel.skipped, [], [], broken_backends=sel.broken)

    def oracle(self, case: DecodeCase, dtypes) -> _DecodeOracle:
        return _decode_oracle(case)

    def plan(self, case: DecodeCase, sel: Selection) -> list[tuple[str, list[Implementation]]]:
        impls = [impl for _, impl in decode_implementations(case, sel)]
        return [(dtype, impls) for dtype in sel.case_dtypes(case)]

    def run(self, backend, impl: Implementation, dtype: str, oracle: _DecodeOracle) -> DecodeRun:
        reason = backend.decode_reason(oracle.cfg, dtype, impl.device, impl.strategy, impl.cache or None)
        if reason:  # said before anything is converted (the backend would raise UnsupportedCase with it)
            return _unsupported(oracle.case, impl, dtype, backend.kind, reason)
        return _run_one(backend, impl, dtype, oracle)

    def stages(self, backend, impl: Implementation, dtype: str, oracle: _DecodeOracle) -> list[dict]:
        return _stages_of(backend, _prepare(backend, impl, dtype, oracle), oracle.cfg)

    def compare_pair(self, a: DecodeRun, b: DecodeRun, oracle: _DecodeOracle) -> DecodePair:
        return _compare_pair(a, b, oracle)

    def oracle_failed(self, case: DecodeCase, sel: Selection, error: Exception) -> list[DecodeRun]:
        reason = f"decode oracle failed: {error_line(error)}"
        return [
            DecodeRun(case.name, impl, dtype, backend.kind, Status.ERROR, reason)
            for dtype in sel.case_dtypes(case)
            for backend, impl in decode_implementations(case, sel)
        ]


DECODE = DecodeJob()
