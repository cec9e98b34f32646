"""Running the registered claims, and folding the benchmark questions' speed answers into their verdicts."""

from __future__ import annotations

from mha_rosetta.core import error_line

from ..seed_setup import Setup, make_setup
from .registry import CAVEAT, CLAIMS, CONFIRMED, PARTLY, REFUTED, ClaimResult, _result


def speed_answers(threads: int = 1, quick: bool = True) -> tuple[dict[int, list[dict]], str]:
    """Run the benchmark questions; answers grouped by claim number, or ({}, why not)."""
    try:
        from mha_rosetta.benchmarks.questions import run_speed_questions
    except ImportError as error:
        return {}, f"benchmark questions unavailable ({error})"
    try:
        answers = run_speed_questions(threads=threads, quick=quick)
    except Exception as error:  # a failed benchmark must not hide the other claims
        return {}, f"benchmark questions failed: {error_line(error)}"
    grouped: dict[int, list[dict]] = {}
    for answer in answers:
        grouped.setdefault(int(answer["claim"]), []).append(answer)
    return grouped, ""


def _evidence_lines(evidence) -> list[str]:
    if isinstance(evidence, str):
        return [evidence]
    if isinstance(evidence, dict):
        return [f"{key}: {value}" for key, value in evidence.items()]
    if isinstance(evidence, (list, tuple)):
        return [str(item) for item in evidence]
    return [str(evidence)]


def _speed_verdict(answer: dict) -> str:
    """The benchmark's verdict in this module's words ("partly" -> "partly confirmed")."""
    verdict = str(answer.get("verdict", "skipped"))
    if verdict == "partly":
        return PARTLY
    if verdict == "skipped":
        return "skipped: nothing could be measured"
    return verdict


def merge_verdicts(verdicts: list[str]) -> str:
    """One verdict for several measured parts (skipped parts do not count)."""
    measured = [v for v in verdicts if not v.startswith("skipped")]
    if not measured:
        return verdicts[0] if verdicts else "skipped: nothing measured"
    if all(v == CONFIRMED for v in measured):
        return CONFIRMED
    if all(v == REFUTED for v in measured):
        return REFUTED
    if all(v.startswith(CONFIRMED) for v in measured):
        return CAVEAT
    return PARTLY


def add_speed(result: ClaimResult, answers: list[dict], why_not: str) -> ClaimResult:
    """Fold the benchmark questions' answers for this claim into its verdict and evidence."""
    if not answers:
        note = why_not or "no benchmark question answers this claim"
        result.evidence.append(f"speed: not measured ({note})")
        if CLAIMS[result.claim].speed_only:
            result.verdict = f"skipped: speed not measured ({note})"
        return result
    speed_verdicts = []
    for answer in answers:
        verdict = _speed_verdict(answer)
        speed_verdicts.append(verdict)
        label = answer.get("title", "speed")
        result.evidence.append(f"speed ({label}): {verdict}: " + "; ".join(_evidence_lines(answer.get("evidence", ""))))
    # The per-cell timings stay in the benchmark output; the claim keeps the verdicts and ratios.
    result.measured["speed"] = [{k: answer.get(k) for k in ("title", "verdict", "evidence")} for answer in answers]
    speed = merge_verdicts(speed_verdicts)
    if CLAIMS[result.claim].speed_only:
        result.verdict = speed
    elif result.verdict == CONFIRMED and speed not in (CONFIRMED,) and not speed.startswith("skipped"):
        result.verdict = CAVEAT  # the layout facts hold; the speed part does not (or not everywhere)
    return result


def _run_check(number: int, setup: Setup) -> ClaimResult:
    """One claim's check; a configuration the check cannot express becomes a skip, not a crash.

    The claims are statements about plain multi-head attention; grouped kv heads or other
    widths can make a demonstration inapplicable, which the verdict then says.
    """
    if setup.cfg.n_kv_heads != setup.cfg.n_heads and CLAIMS[number].plain_mha_only:
        return _result(number, "skipped: the demonstration assumes one kv head per query head", [setup.cfg.describe()])
    return CLAIMS[number].check(setup)


def run_claims(
    numbers: list[int] | None = None,
    setup: Setup | None = None,
    speed: bool = False,
    threads: int = 1,
    quick: bool = True,
) -> list[ClaimResult]:
    """Run the claims (all by default); with ``speed=True`` also the benchmark questions."""
    numbers = sorted(CLAIMS) if numbers is None else list(numbers)
    unknown = [n for n in numbers if n not in CLAIMS]
    if unknown:
        raise ValueError(f"claims are numbered 1-12; got {unknown}")
    setup = make_setup() if setup is None else setup
    wants_speed = speed and any(CLAIMS[n].speed is not None for n in numbers)
    answers, why_not = speed_answers(threads, quick) if wants_speed else ({}, "")
    results = []
    for number in numbers:
        result = _run_check(number, setup)
        if CLAIMS[number].speed is not None:
            if speed:
                result = add_speed(result, answers.get(number, []), why_not)
            else:
                result.evidence.append(
                    "speed: not run (the benchmark questions run with speed=True, as `mha-rosetta explain --claims` does)"
                )
        results.append(result)
    return results
