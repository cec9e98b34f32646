"""mha_rosetta.checks: does every implementation compute the same attention?

- `cases`: the spec cases (small, named, distinct sizes; each says its dtypes).
- `results`: the results model (statuses, runs, pairs, the exit-status rule).
- `selection`: resolving the options into what a check runs.
- `agreement`: the forward check, `run_check(...) -> CheckResult`: every installed
  implementation against the float64 oracle and against each other, one status per comparison.
- `grad`: the gradient check, `run_grad_check(...) -> GradCheckResult`.
- `decode_cases` and `decode`: the decode check, `run_decode_check(...) -> DecodeCheckResult`: every
  implementation's KV-cache decoding (prefill, then steps) against the full causal forward.
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

from .agreement import run_check
from .cases import SPEC_CASES, CaseInputs, SpecCase, get_cases
from .decode import run_decode_check
from .decode_cases import DECODE_CASES, DecodeCase, get_decode_cases
from .divergence import Divergence, first_divergence
from .results import FAILING, STATUS_MEANING, CheckResult, Implementation, Pair, Run, Status

__all__ = [
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
]
