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
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import combinations

import numpy as np

from mha_rosetta.backends import (
    CHUNKED,
    DIRECT_RESHAPE,
    KNOWN_WRONG_STRATEGIES,
    PER_HEAD,
    SLICING,
    STANDARD,
    Backend,
    BackendNotInstalled,
    UnsupportedCase,
    available_backends,
    check_device_name,
    get_backend,
    missing_backends,
)
from mha_rosetta.backends import REGISTRY as BACKEND_REGISTRY
from mha_rosetta.backends._chunking import CHECK_CHUNK
from mha_rosetta.core import (
    DTYPE_NAMES,
    Comparison,
    MHAConfig,
    MHAParams,
    Tolerance,
    check_dtype_name,
    error_line,
    lower_precision,
    reference_stages,
)
from mha_rosetta.core import compare as core_compare
from mha_rosetta.core.errors import exit_code

from .cases import SpecCase, get_cases
from .devices import frameworks_without_gpu
from .divergence import Divergence, first_divergence


class Status(str, Enum):
    """The outcome of one comparison (or of a run that could not be compared)."""

    AGREE = "agree"
    DISAGREE = "DISAGREE"
    CAUGHT = "caught"
    MISSED = "MISSED"
    KNOWN_DIFFERENCE = "known difference"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


STATUS_MEANING = {
    Status.AGREE: "within the dtype's tolerance",
    Status.DISAGREE: "outside tolerance: a real disagreement (fails the check)",
    Status.CAUGHT: "the known mistake (direct reshape) disagrees, as it must",
    Status.MISSED: "the known mistake agreed: the check could not see it (fails the check)",
    Status.KNOWN_DIFFERENCE: "a third-party library's documented convention differs from the spec; named, not hidden",
    Status.UNSUPPORTED: "the backend cannot express this case (reason given)",
    Status.SKIPPED: "the backend's library is not installed (install hint given)",
    Status.ERROR: "the run raised an exception (message given; the check goes on)",
}

FAILING = frozenset({Status.DISAGREE, Status.MISSED})
# Worst first: an aggregated cell shows the most severe status among its cases.
SEVERITY = (
    Status.ERROR,
    Status.MISSED,
    Status.DISAGREE,
    Status.KNOWN_DIFFERENCE,
    Status.CAUGHT,
    Status.AGREE,
    Status.UNSUPPORTED,
    Status.SKIPPED,
)
KNOWN_STRATEGIES = (STANDARD, PER_HEAD, SLICING, DIRECT_RESHAPE, CHUNKED)
DEFAULT_DEVICES = ("cpu",)


def worst_status(statuses: Iterable[Status]) -> Status | None:
    statuses = set(statuses)
    return next((s for s in SEVERITY if s in statuses), None)


@dataclass(frozen=True)
class Implementation:
    """One (backend, strategy, device): a row and a column of the agreement matrix."""

    backend: str
    strategy: str = STANDARD
    device: str = "cpu"

    @property
    def label(self) -> str:
        """``torch``, ``numpy:per_head``, ``torch:direct_reshape@gpu``."""
        label = self.backend if self.strategy == STANDARD else f"{self.backend}:{self.strategy}"
        return label if self.device == "cpu" else f"{label}@{self.device}"

    @property
    def known_mistake(self) -> bool:
        return self.strategy in KNOWN_WRONG_STRATEGIES


@dataclass
class RunRecord:
    """Which implementation ran on which case and dtype, and its status: shared by `Run` and `checks.grad.GradRun`."""

    case: str
    impl: Implementation
    dtype: str
    kind: str  # "implementation" (ours) or "oracle" (a third-party library)
    status: Status
    reason: str = ""

    @property
    def label(self) -> str:
        return self.impl.label


@dataclass
class Run(RunRecord):
    """One implementation on one case and dtype, and how it compares with the oracle."""

    max_abs: float | None = None
    max_rel: float | None = None
    tolerance: Tolerance | None = None
    divergence: Divergence | None = None
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    output: np.ndarray | None = field(default=None, repr=False)  # batched (B, Nq, D)
    stage_source: Callable[[], dict] | None = field(default=None, repr=False)
    _stages: dict | None = field(default=None, repr=False)

    @property
    def compared(self) -> bool:
        """True when the run produced an output that was compared."""
        return self.output is not None and self.status not in (Status.ERROR, Status.UNSUPPORTED, Status.SKIPPED)

    def stages(self) -> dict:
        """Canonical stage tensors, computed on first use (only disagreements need them)."""
        if self._stages is None:
            self._stages = self.stage_source() if self.stage_source else {}
        return self._stages

    def release_stages(self) -> None:
        """Drop the stage tensors and their source (and the prepared pass it holds) to free memory."""
        self.stage_source, self._stages = None, None


@dataclass
class Pair:
    """Two runs of the same case and dtype compared with each other."""

    case: str
    a: Run
    b: Run
    dtype: str  # the tolerance used: the lower precision of the two
    status: Status
    max_abs: float
    max_rel: float
    reason: str = ""
    divergence: Divergence | None = None


class Outcome:
    """The exit-status rule of the forward check (`CheckResult`) and the gradient check (`checks.grad`).

    For a result with ``runs``, ``pairs``, ``broken_backends`` and ``interrupted``.
    """

    def failures(self) -> list:
        """Runs and pairs that fail the check (DISAGREE, MISSED)."""
        return [item for item in (*self.runs, *self.pairs) if item.status in FAILING]

    def errors(self) -> list:
        """Runs that raised (a backend that failed to load counts too, see `broken_backends`)."""
        return [run for run in self.runs if run.status is Status.ERROR]

    @property
    def error_count(self) -> int:
        return len(self.errors()) + len(self.broken_backends)

    @property
    def nothing_checked(self) -> bool:
        return not any(run.compared for run in self.runs)

    @property
    def exit_status(self) -> int:
        """0 all good; 1 a disagreement or a missed mistake; 2 an error or nothing checked."""
        if self.error_count or self.nothing_checked:
            return 2
        if self.failures():
            return 1
        return 0

    @property
    def exit_code(self) -> int:
        """The process's exit status: `core.errors.INTERRUPTED` when interrupted, else `exit_status`."""
        return exit_code(self.exit_status, self.interrupted)


@dataclass
class CheckResult(Outcome):
    """Everything one check produced; the CLI prints it and the tests inspect it."""

    settings: dict
    cases: list[SpecCase]
    skipped_backends: dict[str, str]
    runs: list[Run]
    pairs: list[Pair]
    seconds: float = 0.0
    interrupted: bool = False
    broken_backends: dict[str, str] = field(default_factory=dict)  # installed, but the adapter failed to load
    # --devices gpu: installed frameworks that see no GPU (`checks.devices`), each an error.
    frameworks_without_gpu: dict[str, str] = field(default_factory=dict)
    # What each backend declares about its library's conventions (Backend.known_differences).
    declared_differences: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def run_counts(self) -> Counter:
        return Counter(run.status for run in self.runs)

    def pair_counts(self) -> Counter:
        return Counter(pair.status for pair in self.pairs)

    @property
    def error_count(self) -> int:
        return super().error_count + len(self.frameworks_without_gpu)  # a GPU asked for and not seen is an error

    def verdict(self) -> str:
        if self.interrupted:
            return "interrupted: the results so far are shown"
        errors, failures = self.error_count, len(self.failures())
        if self.frameworks_without_gpu:
            return f"ERROR: the GPU was asked for, but {', '.join(self.frameworks_without_gpu)} see(s) no GPU" + (
                f"; {failures} failing comparison(s)" if failures else ""
            )
        if errors:
            return f"ERROR: {errors} run(s) or backend(s) raised an exception" + (
                f"; {failures} failing comparison(s)" if failures else ""
            )
        if self.nothing_checked:
            return "nothing was checked: no implementation ran on the selected cases, dtypes and devices"
        if failures:
            return f"FAIL: {failures} failing comparison(s)"
        return "OK: every implementation agrees or has a named known difference, and every known mistake is caught"


# -- resolving what to run ----------------------------------------------------------------
def _split(values) -> list[str] | None:
    """Accept None, "a,b", or an iterable of such strings."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        out += [part.strip() for part in str(value).split(",") if part.strip()]
    return out


def resolve_backends(backends) -> tuple[list[Backend], dict[str, str], dict[str, str]]:
    """Backends to run; requested ones not installed (with the hint); ones that failed to load.

    ``backends`` is None (every installed backend), names, or `Backend` instances
    (the tests pass fakes this way). An installed backend whose adapter fails to
    import is an error of the check, reported with the message, not a crash.
    """
    chosen: list[Backend] = []
    skipped: dict[str, str] = {}
    broken: dict[str, str] = {}
    if backends is None:
        names: list = available_backends()
        skipped.update(missing_backends())
    else:
        names = []
        for item in [backends] if isinstance(backends, str) else backends:
            names += [item] if isinstance(item, Backend) else _split(item)
    for name in names:
        if isinstance(name, Backend):
            chosen.append(name)
            continue
        if name not in BACKEND_REGISTRY:
            raise ValueError(f"backends: unknown backend {name!r}; registered backends: {', '.join(BACKEND_REGISTRY)}")
        if any(backend.name == name for backend in chosen):
            continue  # named twice: run once
        try:
            chosen.append(get_backend(name))
        except BackendNotInstalled as error:
            skipped[name] = str(error)
        except Exception as error:
            broken[name] = f"the adapter failed to load: {error_line(error)}"
    return chosen, skipped, broken


def _resolve_strategies(strategies, backends: Sequence[Backend]) -> list[str] | None:
    names = _split(strategies)
    if names is None:
        return None
    known = set(KNOWN_STRATEGIES).union(*(b.strategies for b in backends))
    unknown = [s for s in names if s not in known]
    if unknown:
        raise ValueError(
            f"strategies: unknown strategy {', '.join(map(repr, unknown))}; known strategies: {', '.join(sorted(known))}"
        )
    return names


def _resolve_devices(devices) -> list[str]:
    names = _split(devices) or list(DEFAULT_DEVICES)
    if names == ["all"]:
        return ["cpu", "gpu"]
    resolved: list[str] = []
    for name in names:
        try:
            device = check_device_name(name)
        except ValueError as error:
            raise ValueError(f"devices: {error}") from None
        if device not in resolved:
            resolved.append(device)
    return resolved


def _resolve_dtypes(dtypes) -> tuple[list[str], bool]:
    """The dtypes to run, and whether every case runs all of them ("all") or only those it lists."""
    names = _split(dtypes) or list(DTYPE_NAMES)
    if names == ["all"]:
        return list(DTYPE_NAMES), True
    try:
        return [check_dtype_name(name) for name in names], False
    except ValueError as error:
        raise ValueError(f"dtypes: {error} (or 'all': every case in every dtype)") from None


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


def _run_one(backend: Backend, strategy: str, device: str, dtype: str, oracle: _Oracle, uniform: np.ndarray) -> Run:
    case = oracle.case
    run = Run(case.name, Implementation(backend.name, strategy, device), dtype, backend.kind, Status.ERROR)
    data = oracle.data
    started = time.perf_counter()
    try:
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
        output = np.asarray(prepared.output())
    except Exception as error:  # a failing cell is reported and the check goes on
        run.status, run.reason = failure_status(error)
        return run
    run.seconds = time.perf_counter() - started
    run.info = dict(prepared.info)
    expected = oracle.stages["output"]
    if output.shape != expected.shape:
        run.reason = f"output has shape {output.shape}, expected {expected.shape} (batch, q_tokens, d_model)"
        return run
    run.output = output
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
        known = _empty_row_difference(output, expected, oracle, dtype, uniform) if backend.kind == "oracle" else None
        if known:
            rest, run.reason = known
            run.status = Status.KNOWN_DIFFERENCE
            run.max_abs, run.max_rel = rest.max_abs, rest.max_rel  # on the rows the spec and the library share
        else:
            run.status = Status.DISAGREE
            run.reason = result.summary()
    if run.status in (Status.DISAGREE, Status.CAUGHT):
        run.divergence = _divergence(oracle.stages, run, dtype)
    return run


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
    mistakes = (a.impl.known_mistake, b.impl.known_mistake)
    if result.ok:
        if mistakes[0] != mistakes[1]:
            mistake = a if mistakes[0] else b
            if mistake.status is Status.CAUGHT:  # caught at a stage against the oracle
                pair.status, pair.reason = Status.CAUGHT, f"outputs agree; {mistake.label}: {mistake.reason}"
            else:
                pair.status, pair.reason = Status.MISSED, "the known mistake agrees with a correct implementation"
        return pair
    if any(mistakes):
        pair.status = Status.CAUGHT
        return pair
    known_sides = [run for run in (a, b) if run.status is Status.KNOWN_DIFFERENCE]
    if known_sides:
        known = _empty_row_difference(a.output, b.output, oracle, dtype)
        if known:
            rest = known[0]
            pair.status, pair.max_abs, pair.max_rel = Status.KNOWN_DIFFERENCE, rest.max_abs, rest.max_rel
            pair.reason = "; ".join(f"{run.label}: {run.reason}" for run in known_sides)
            return pair
    pair.status, pair.reason = Status.DISAGREE, result.summary()
    try:
        pair.divergence = first_divergence(a.stages(), b.stages(), dtype)
    except Exception as error:
        pair.reason += f"; stages unavailable ({error_line(error)})"
    return pair


# -- the check ----------------------------------------------------------------------------
def run_check(
    backends=None,
    strategies=None,
    devices=None,
    dtypes=None,
    cases=None,
    progress: Callable[[str], None] | None = None,
) -> CheckResult:
    """Run every selected implementation on every selected case and compare all pairs.

    backends:   None (every installed backend), names ("numpy,torch" or a list) or Backend objects.
    strategies: None (each backend's own strategies) or names to keep.
    devices:    None (cpu), names ("cpu", "gpu", "cuda") or "all". Naming the GPU makes every
                installed GPU-capable framework that sees none an error (`checks.devices`);
                "all" runs on whatever devices are present.
    dtypes:     None or names: each case runs those of them it lists (`SpecCase.dtypes`), and an
                implementation that supports none of those runs it in the first requested
                dtype it supports (`case_dtypes_for`), so every implementation gets every case;
                "all": every case in every dtype (the exhaustive product).
    cases:      None (every spec case), names, or SpecCase objects.
    progress:   called with a short message before each case and dtype.

    Bad names raise ValueError naming the option, the bad value and the accepted ones.
    """
    started = time.perf_counter()
    sel = resolve_selection(backends, strategies, devices, dtypes, cases)
    declared = {
        b.name: tuple(getattr(b, "known_differences", ())) for b in sel.backends if getattr(b, "known_differences", ())
    }
    result = CheckResult(
        sel.settings, sel.cases, sel.skipped, [], [], broken_backends=sel.broken, declared_differences=declared
    )
    if "gpu" in sel.devices and _split(devices) != ["all"]:  # "all": whatever devices are here
        result.frameworks_without_gpu = frameworks_without_gpu(sel.backends)
    try:
        for case in sel.cases:
            _check_case(case, sel, result, progress)
    except KeyboardInterrupt:
        result.interrupted = True  # keep what finished; the caller decides how to exit
    result.seconds = time.perf_counter() - started
    return result


@dataclass
class Selection:
    """What a check runs, resolved from its options (shared by the forward and the gradient check)."""

    backends: list[Backend]
    skipped: dict[str, str]
    broken: dict[str, str]
    strategy_filter: list[str] | None
    devices: list[str]
    dtypes: list[str]
    every_dtype: bool
    cases: list[SpecCase]

    @property
    def settings(self) -> dict:
        return {
            "backends": [b.name for b in self.backends],
            "strategies": self.strategy_filter,
            "devices": self.devices,
            "dtypes": "all" if self.every_dtype else self.dtypes,
            "cases": [c.name for c in self.cases],
        }

    def case_dtypes(self, case: SpecCase) -> list[str]:
        """The dtypes ``case`` runs: every selected one under "all", else those it lists."""
        return self.dtypes if self.every_dtype else [d for d in self.dtypes if d in case.dtypes]

    def implementations(self):
        """(backend, strategy, device) for every selected implementation."""
        for backend in self.backends:
            for strategy in backend.strategies:
                if self.strategy_filter is None or strategy in self.strategy_filter:
                    for device in self.devices:
                        yield backend, strategy, device


def resolve_selection(backends, strategies, devices, dtypes, cases) -> Selection:
    """Resolve a check's options (see `run_check`); bad names raise ValueError naming the option."""
    device_names = _resolve_devices(devices)
    dtype_names, every_dtype = _resolve_dtypes(dtypes)
    if cases is None or all(isinstance(c, str) for c in _as_list(cases)):
        spec_cases = get_cases(None if cases is None else _split(cases))
    else:
        spec_cases = list(cases)
    chosen, skipped, broken = resolve_backends(backends)
    strategy_filter = _resolve_strategies(strategies, chosen)
    return Selection(chosen, skipped, broken, strategy_filter, device_names, dtype_names, every_dtype, spec_cases)


def _as_list(values) -> list:
    return [values] if isinstance(values, (str, SpecCase)) else list(values)


def case_dtypes_for(backend: Backend, impl: Implementation, case: SpecCase, dtypes, every_dtype: bool) -> list[str]:
    """The dtypes one implementation runs ``case`` in: every case reaches every implementation.

    With ``every_dtype`` (``--dtypes all``): every requested dtype. Otherwise the case's own
    dtypes (`SpecCase.dtypes`) among the requested ones; and when the implementation supports
    none of the case's own dtypes (an adapter with only float64, a case listed in float16),
    the first requested dtype it does support, so no implementation misses a case (GQA,
    causal, padding) because of the dtypes the case happens to list. When it supports no
    requested dtype for this case, the case's dtypes run anyway and each run says why.
    """
    if every_dtype:
        return list(dtypes)
    listed = [d for d in dtypes if d in case.dtypes]

    def supported(dtype: str) -> bool:
        try:
            return backend.unsupported_reason(case.cfg, dtype, impl.device, impl.strategy) is None
        except Exception:  # a broken unsupported_reason shows as an error when the run raises
            return True

    if any(supported(d) for d in case.dtypes):
        return listed
    fallback = next((d for d in dtypes if supported(d)), None)
    return [fallback] if fallback is not None else listed


def _check_case(case: SpecCase, sel: Selection, result: CheckResult, progress) -> None:
    try:
        oracle = _oracle(case)
        uniform = _uniform_fallback_output(oracle)
    except Exception as error:  # the oracle itself failed: every run of the case is an error
        reason = f"oracle failed: {error_line(error)}"
        for backend in sel.backends:
            for dtype in sel.dtypes:
                result.runs.append(
                    Run(case.name, Implementation(backend.name), dtype, backend.kind, Status.ERROR, reason)
                )
        return
    plan = {}  # every selected implementation -> the dtypes it runs this case in
    for backend, strategy, device in sel.implementations():
        impl = Implementation(backend.name, strategy, device)
        plan[impl] = case_dtypes_for(backend, impl, case, sel.dtypes, sel.every_dtype)
    backend_of = {backend.name: backend for backend in sel.backends}
    for dtype in [d for d in sel.dtypes if any(d in chosen for chosen in plan.values())]:
        if progress:
            progress(f"{case.name} {dtype}")
        runs = [
            _run_one(backend_of[impl.backend], impl.strategy, impl.device, dtype, oracle, uniform)
            for impl, chosen in plan.items()
            if dtype in chosen
        ]
        result.runs.extend(runs)
        compared = [run for run in runs if run.compared]
        result.pairs += [_compare_pair(a, b, oracle) for a, b in combinations(compared, 2)]
        for run in runs:  # the stage tensors of this case are no longer needed
            run.release_stages()
