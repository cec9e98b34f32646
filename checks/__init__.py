"""mha_rosetta.checks: does every implementation compute the same attention?

- `cases`: the spec cases (small, named, distinct sizes; each says its dtypes).
- `results`: the results model (statuses, runs, pairs, the exit-status rule).
- `selection`: resolving the options into what a check runs.
- `facade`: every check's one entry point, `run_check(..., kind="forward" | "grad" | "decode")`.
- `agreement`: the forward check (``kind="forward"`` -> `CheckResult`): every installed
  implementation against the float64 oracle and against each other, one status per comparison.
- `grad`: the gradient check (``kind="grad"`` -> `GradCheckResult`).
- `decode_cases` and `decode`: the decode check (``kind="decode"`` -> `DecodeCheckResult`): every
  implementation's KV-cache decoding (prefill, then steps) against the full causal forward.
  (`run_grad_check` and `run_decode_check` are its deprecated aliases, kept for old scripts.)
- `engine`: one engine for every check (plan, execute, compare as results arrive); `pool`
  and `worker`: its spawned worker processes, with time limits and the JAX compilation cache.
- `divergence`: the first stage in pipeline order where two stage dicts differ.
- `matrices`: runs and pairs folded into agreement matrices.
- renderers, imported by no engine: `report` (rich or plain text, Markdown),
  `grad_report` (the gradient check's blocks), `decode_report` (the decode check's) and
  `json_report` (versioned JSON).

The ``mha-rosetta check`` command and the tests share `run_check`; the command adds
argument parsing, the worker pool (`engine.executor_for`) and printing. Importing this package imports no framework.
"""

from .cases import SPEC_CASES, CaseInputs, SpecCase, get_cases
from .decode_cases import DECODE_CASES, DecodeCase, get_decode_cases
from .divergence import Divergence, first_divergence
from .facade import CHECKS, run_check, run_decode_check, run_grad_check
from .results import FAILING, STATUS_MEANING, CheckResult, Implementation, Pair, Run, Status

__all__ = [
    "CHECKS",
    "DECODE_CASES",
    "FAILING",
    "SPEC_CASES",
    "STATUS_MEANING",
    "CaseInputs",
    "CheckResult",
    "DecodeCase",
    "Divergence",
    "Implementation",
    "Pair",
    "Run",
    "SpecCase",
    "Status",
    "first_divergence",
    "get_cases",
    "get_decode_cases",
    "run_check",
    "run_decode_check",
    "run_grad_check",
]
