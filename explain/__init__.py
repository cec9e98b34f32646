"""mha_rosetta.explain: every shape, stride and layout side by side, and the column/row-sample article's
claims made executable.

Nothing here is typed from memory: the stage tables measure the tensors of a real run
of each backend, the weight layouts are checked against the converters and the real
modules, and each of the column/row-sample article's claims is a check that returns its evidence.
Frameworks are imported only inside the functions that use them.
"""

from .claims import CLAIMS, ClaimResult, run_claims
from .differences import DEMONSTRATIONS, Difference, run_differences
from .explainer import SECTIONS, Explanation, explain
from .head_split import HeadSplit, head_splits, save_png
from .seed_setup import Setup, make_setup, seed_config
from .stages_table import BackendSummary, StageRow, build_stage_tables
from .weights import WeightLayout, weight_layouts

__all__ = [
    "CLAIMS",
    "DEMONSTRATIONS",
    "SECTIONS",
    "BackendSummary",
    "ClaimResult",
    "Difference",
    "Explanation",
    "HeadSplit",
    "Setup",
    "StageRow",
    "WeightLayout",
    "build_stage_tables",
    "explain",
    "head_splits",
    "make_setup",
    "run_claims",
    "run_differences",
    "save_png",
    "seed_config",
    "weight_layouts",
]
