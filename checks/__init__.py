"""mha_rosetta.checks: does every implementation compute the same attention?

- `cases`: the spec cases (small, named, distinct sizes; each says its dtypes).
- `agreement`: `run_check(...) -> CheckResult`, every installed implementation against
  the float64 oracle and against each other, with one status per comparison.
- `divergence`: the first stage in pipeline order where two stage dicts differ.
- `report`: the agreement matrix as rich or plain text, Markdown and versioned JSON.

The ``mha-rosetta check`` command and the tests share `run_check`; the command adds
only argument parsing and printing. Importing this package imports no framework.
"""

from .agreement import (
    FAILING,
    STATUS_MEANING,
    CheckResult,
    Implementation,
    Pair,
    Run,
    Status,
    run_check,
)
from .cases import SPEC_CASES, CaseInputs, SpecCase, get_cases
from .divergence import Divergence, first_divergence

__all__ = [
    "FAILING",
    "SPEC_CASES",
    "STATUS_MEANING",
    "CaseInputs",
    "CheckResult",
    "Divergence",
    "Implementation",
    "Pair",
    "Run",
    "SpecCase",
    "Status",
    "first_divergence",
    "get_cases",
    "run_check",
]
