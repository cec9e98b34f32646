"""The claims' registry: each claim is a check registered by `claim` with its number, its title and its
speed question, so that the title, the check and whether the benchmark questions answer it live in one place.

Design rules: the checks (`layouts`, `heads`, `modules`) import this module and nothing else of the package;
`run` reads `CLAIMS` only. The helpers below are shared by the checks: they format numbers and run the
project's own backends as extra evidence (a backend that is missing or fails is reported, never fatal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.core import error_line, reference_mha

from ..seed_setup import Setup

CONFIRMED, REFUTED, CAVEAT, PARTLY = "confirmed", "refuted", "confirmed with caveat", "partly confirmed"
SPEED_NOT_RUN = "skipped: speed not measured in this run"


@dataclass(frozen=True)
class Claim:
    """One registered claim. ``speed`` is the question `benchmarks.questions` answers for it (None: no speed
    part); ``speed_only`` claims are about speed and nothing else; ``plain_mha_only`` demonstrations assume one
    kv head per query head and are skipped on grouped configurations."""

    number: int
    title: str
    check: Callable[[Setup], ClaimResult]
    speed: str | None = None
    speed_only: bool = False
    plain_mha_only: bool = False


CLAIMS: dict[int, Claim] = {}  # number -> Claim, filled by `claim` when the check modules are imported


def claim(
    number: int, title: str, *, speed: str | None = None, speed_only: bool = False, plain_mha_only: bool = False
) -> Callable[[Callable[[Setup], ClaimResult]], Callable[[Setup], ClaimResult]]:
    """Register the decorated check as claim ``number`` (the claims are numbered as in the article)."""
    if speed_only and speed is None:
        raise ValueError(f"claim {number}: speed_only=True needs a speed question (speed=...), got None")

    def register(check: Callable[[Setup], ClaimResult]) -> Callable[[Setup], ClaimResult]:
        if number in CLAIMS:
            raise ValueError(
                f"claim {number} is registered twice: {CLAIMS[number].check.__name__} and {check.__name__}"
            )
        CLAIMS[number] = Claim(number, title, check, speed, speed_only, plain_mha_only)
        return check

    return register


def speed_claims() -> tuple[int, ...]:
    """The claims with a speed part measured by the benchmark questions, in order."""
    return tuple(n for n in sorted(CLAIMS) if CLAIMS[n].speed is not None)


def speed_only_claims() -> tuple[int, ...]:
    """The claims that are about speed and nothing else."""
    return tuple(n for n in sorted(CLAIMS) if CLAIMS[n].speed_only)


@dataclass
class ClaimResult:
    claim: int
    title: str
    verdict: str
    evidence: list[str]
    measured: dict = field(default_factory=dict)  # the numbers, for scripts and tests

    def to_dict(self) -> dict:
        return {
            "claim": self.claim,
            "title": self.title,
            "verdict": self.verdict,
            "evidence": "; ".join(self.evidence),
            "measured": _jsonable(self.measured),
        }


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _fmt(values) -> str:
    """A short list of numbers: [40, 41, 42, 43] or [0.5, 2.5]."""
    array = np.asarray(values)
    if np.all(array == np.round(array)) and np.all(np.abs(array) < 1e15):
        return str(array.astype(np.int64).tolist())
    return np.array2string(array, precision=4, separator=", ")


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# --- running the project's own backends as extra evidence ---------------------------------------


def _backend_run(name: str, setup: Setup, strategy: str = "standard", dtype: str = "float64"):
    """Output of backend ``name`` for the setup, or (None, why not)."""
    try:
        from mha_rosetta.backends import get_backend

        return get_backend(name).run(setup.cfg, setup.params, setup.x, dtype=dtype, strategy=strategy), ""
    except Exception as error:  # a missing or unfinished adapter is reported, not fatal
        return None, f"{name} ({strategy}) not run: {error_line(error)}"


def _backend_stages(name: str, setup: Setup, dtype: str = "float64"):
    """Native stage tensors of backend ``name``, or (None, why not)."""
    try:
        from mha_rosetta.backends import get_backend

        prepared, _ = get_backend(name).prepare(setup.cfg, setup.params, setup.x, dtype=dtype)
        return prepared.native_stages(), ""
    except Exception as error:
        return None, f"{name} stages not available: {error_line(error)}"


def _strategy_errors(
    setup: Setup, strategy: str, spec: str = ".1e", backends=("numpy", "torch")
) -> tuple[dict[str, float], list[str]]:
    """Max abs error against the float64 oracle of each backend running ``strategy``, and the evidence lines
    (each error formatted with ``spec``, then why a backend did not run)."""
    reference = reference_mha(setup.cfg, setup.params, setup.x)
    errors, lines, notes = {}, [], []
    for name in backends:
        output, why = _backend_run(name, setup, strategy)
        if output is None:
            notes.append(why)
        else:
            errors[name] = _max_abs(output, reference)
            lines.append(f"{name} adapter, {strategy} strategy: max error vs oracle {errors[name]:{spec}}")
    return errors, lines + notes


def _result(number: int, verdict: str, evidence: list[str], measured: dict | None = None) -> ClaimResult:
    """Claim ``number``'s result, with its registered title."""
    return ClaimResult(number, CLAIMS[number].title, verdict, evidence, {} if measured is None else measured)
