"""The results model of the check: statuses, implementations, runs, pairs and the outcome rule.

Shared by the forward check (`checks.agreement`), the gradient check (`checks.grad`), the
engine that runs them (`checks.engine`) and the renderers (`checks.report`, `checks.grad_report`,
`checks.json_report`). Design rule: this module holds data and the exit-status rule only; it
runs nothing and renders nothing, and imports no framework.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from mha_rosetta.backends import KNOWN_WRONG_STRATEGIES, STANDARD
from mha_rosetta.core import MHAGrads, Tolerance
from mha_rosetta.core.errors import exit_code

from .cases import SpecCase
from .divergence import Divergence


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


def worst_status(statuses: Iterable[Status]) -> Status | None:
    statuses = set(statuses)
    return next((s for s in SEVERITY if s in statuses), None)


@dataclass(frozen=True)
class Implementation:
    """One (backend, strategy, device[, cache]): a row and a column of the agreement matrix.

    ``cache`` is the decode check's KV-cache kind (`Backend.decode_caches`); "" everywhere else.
    """

    backend: str
    strategy: str = STANDARD
    device: str = "cpu"
    cache: str = ""

    @property
    def label(self) -> str:
        """``torch``, ``numpy:per_head``, ``torch:direct_reshape@gpu``, ``torch[static]`` (a decode cache)."""
        label = self.backend if self.strategy == STANDARD else f"{self.backend}:{self.strategy}"
        label = label if not self.cache else f"{label}[{self.cache}]"
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


def settle_known_mistake(pair, a, b, agree: bool, what: str, missed: str = "") -> bool:
    """Set ``pair``'s status where a known mistake decides it; True when it did (the pair is then final).

    ``what`` (``"outputs"``, ``"gradients"``) agree with a known mistake on one side: CAUGHT where the
    mistake was caught at a stage against the oracle, else MISSED (``missed``: its reason, else the
    mistake's own). They differ with a mistake on either side: CAUGHT. Any other pair: False.
    """
    mistakes = (a.impl.known_mistake, b.impl.known_mistake)
    if agree:
        if mistakes[0] != mistakes[1]:
            mistake = a if mistakes[0] else b
            pair.status = Status.CAUGHT if mistake.status is Status.CAUGHT else Status.MISSED
            pair.reason = f"{what} agree; {mistake.label}: {mistake.reason}"
            if pair.status is Status.MISSED and missed:
                pair.reason = missed
        return True
    if any(mistakes):
        pair.status = Status.CAUGHT
        return True
    return False


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
    # Where the result came from (`benchmarks.provenance`), stamped by its first JSON write and kept:
    # the command rewrites the JSON as results arrive, and git and the metadata are read once.
    provenance: dict = field(default_factory=dict, repr=False)
    # --devices gpu: installed frameworks that see no GPU (`checks.devices`), each an error.
    frameworks_without_gpu: dict[str, str] = field(default_factory=dict)
    # What each backend declares about its library's conventions (Backend.known_differences).
    declared_differences: dict[str, tuple[str, ...]] = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # where the time went (`engine.run_job`)

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


@dataclass
class TensorError:
    """One gradient tensor against the oracle (or another run)."""

    max_abs: float
    atol: float
    ok: bool
    reason: str = ""


@dataclass
class GradRun(RunRecord):
    tensors: dict[str, TensorError] = field(default_factory=dict)
    divergent_stage: str | None = None
    seconds: float = 0.0
    grads: MHAGrads | None = field(default=None, repr=False)

    @property
    def compared(self) -> bool:
        """True when the run produced gradients that were compared (kept after the arrays are dropped)."""
        return bool(self.tensors) and self.status not in (Status.ERROR, Status.UNSUPPORTED, Status.SKIPPED)

    def worst(self) -> tuple[str, TensorError] | None:
        """The tensor with the largest error relative to its tolerance."""
        if not self.tensors:
            return None
        return max(self.tensors.items(), key=lambda item: item[1].max_abs / max(item[1].atol, 1e-300))


@dataclass
class GradPair:
    case: str
    a: GradRun
    b: GradRun
    dtype: str
    status: Status
    tensor: str
    max_abs: float
    reason: str = ""


@dataclass
class GradCheckResult(Outcome):
    settings: dict
    cases: list[SpecCase]
    skipped_backends: dict[str, str]
    broken_backends: dict[str, str]
    runs: list[GradRun] = field(default_factory=list)
    pairs: list[GradPair] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False
    timings: dict = field(default_factory=dict)  # where the time went (`engine.run_job`)

    def verdict(self) -> str:
        if self.error_count:
            return f"gradients: ERROR: {self.error_count} run(s) or backend(s) raised an exception"
        if self.nothing_checked:
            return "gradients: nothing was checked"
        if self.failures():
            return f"gradients: FAIL: {len(self.failures())} failing comparison(s)"
        return (
            "gradients: OK: every implementation agrees or has a named known difference; every known mistake is caught"
        )


@dataclass
class DecodeRun(Run):
    """One implementation's decode run (prefill, then steps through its cache) against the full-forward oracle.

    ``output`` is every token's output, (B, N, D); ``where`` names the first chunk, its position
    and its first divergent stage when the run disagrees ("step 3 (position 7) diverges at
    q_rotated"); ``info["cache"]`` is the cache's kind, layout, slots and bytes.
    """

    where: str = ""


@dataclass
class DecodePair(Pair):
    """Two decode runs of the same case and dtype, with ``where`` they part when they disagree."""

    where: str = ""


@dataclass
class DecodeCheckResult(CheckResult):
    """Everything ``mha-rosetta check --decode`` produced (``cases`` are `checks.decode_cases.DecodeCase`)."""

    def verdict(self) -> str:
        return "decode: " + super().verdict()
