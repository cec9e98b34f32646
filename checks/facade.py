"""The one entry point of every check: ``run_check(..., kind="forward" | "grad" | "decode")``.

A kind is an engine job (`checks.engine`) that also says how it reads ``cases``
(``select_cases``), what its empty result holds (``new_result``) and the prefix of its progress
messages (``label``); `CHECKS` is the registry of kinds, and everything else (resolving the
options, the clock, the engine) is written here once. ``mha-rosetta check`` (``--grad``,
``--decode``), the explainer and the tests call `run_check`; `grad.run_grad_check` and
`decode.run_decode_check` are its deprecated aliases.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

from .agreement import FORWARD
from .decode import DECODE
from .engine import run_job
from .grad import GRADIENT
from .results import CheckResult, DecodeCheckResult, GradCheckResult
from .selection import resolve_selection

# kind -> its engine job: the forward check, the gradient check, the decode check.
CHECKS = {"forward": FORWARD, "grad": GRADIENT, "decode": DECODE}


def run_check(
    backends=None,
    strategies=None,
    devices=None,
    dtypes=None,
    cases=None,
    progress: Callable[[str], None] | None = None,
    executor=None,
    on_update: Callable[[object], None] | None = None,
    *,
    kind: str = "forward",
) -> CheckResult | GradCheckResult | DecodeCheckResult:
    """Run every selected implementation on every selected case and compare all pairs.

    kind:       "forward" (the default: outputs against the float64 oracle, `CheckResult`), "grad"
                (gradients against the float64 backward oracle, `GradCheckResult`) or "decode"
                (KV-cache decoding against the full causal forward, `DecodeCheckResult`).
    backends:   None (every installed backend), names ("numpy,torch" or a list) or Backend objects.
    strategies: None (each backend's own strategies) or names to keep.
    devices:    None (cpu), names ("cpu", "gpu", "cuda") or "all". Naming the GPU makes every
                installed GPU-capable framework that sees none an error (`checks.devices`);
                "all" runs on whatever devices are present.
    dtypes:     None or names: each case runs those of them it lists (`SpecCase.dtypes`), and an
                implementation that supports none of those runs it in the first requested
                dtype it supports (`case_dtypes_for`), so every implementation gets every case;
                "all": every case in every dtype (the exhaustive product).
    cases:      None (every case of the kind), names, or case objects: `SpecCase` for "forward" and
                "grad", `DecodeCase` (names of `checks.decode_cases.DECODE_CASES`) for "decode".
    progress:   called with a short message as each case and dtype starts.
    executor:   None (every run in this process) or an open executor (`engine.executor_for`:
                a worker pool with time limits), kept by the caller across checks.
    on_update:  called with the result so far as results arrive, and at the end (`engine.run_job`).

    Bad names raise ValueError naming the option, the bad value and the accepted ones.
    """
    if kind not in CHECKS:
        raise ValueError(f"kind: expected one of {', '.join(CHECKS)}; got {kind!r}")
    job = CHECKS[kind]
    started = time.perf_counter()
    sel = resolve_selection(backends, strategies, devices, dtypes, job.select_cases(cases), executor)
    result = job.new_result(sel, devices)
    labelled = progress and job.label and (lambda message: progress(f"{job.label} {message}"))
    run_job(job, sel, result, executor, labelled or progress, on_update, started)
    return result


def _deprecated_alias(name: str, kind: str, args: tuple, kwargs: dict):
    """``name(*args, **kwargs)``, an old facade: a DeprecationWarning, then `run_check` of ``kind``."""
    warnings.warn(f"{name} is deprecated: use run_check(..., kind={kind!r})", DeprecationWarning, stacklevel=3)
    return run_check(*args, **kwargs, kind=kind)


def run_grad_check(*args, **kwargs) -> GradCheckResult:
    """Deprecated: use `run_check` with ``kind="grad"`` (the same arguments, the same result)."""
    return _deprecated_alias("run_grad_check", "grad", args, kwargs)


def run_decode_check(*args, **kwargs) -> DecodeCheckResult:
    """Deprecated: use `run_check` with ``kind="decode"`` (the same arguments, the same result)."""
    return _deprecated_alias("run_decode_check", "decode", args, kwargs)
