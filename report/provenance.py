"""Kept for the importers outside `benchmarks` and `report`: provenance lives in `mha_rosetta.benchmarks.provenance`.

It moved below `report` (issue 42: `report` reads `benchmarks`, and `benchmarks.report` wrote provenance
through this module, a cycle). New code imports `mha_rosetta.benchmarks.provenance`; this module only
re-exports its public names, so that both spell the same functions and the same start state.
"""

from __future__ import annotations

from mha_rosetta.benchmarks.provenance import (
    GIT_TIMEOUT_S,
    PROVENANCE_VERSION,
    SOURCE_ROOT,
    allowed_cores,
    cpu_model,
    forget_start,
    git_state,
    host_id,
    package_versions,
    provenance,
    remember_start,
    tool_version,
)

__all__ = [
    "GIT_TIMEOUT_S",
    "PROVENANCE_VERSION",
    "SOURCE_ROOT",
    "allowed_cores",
    "cpu_model",
    "forget_start",
    "git_state",
    "host_id",
    "package_versions",
    "provenance",
    "remember_start",
    "tool_version",
]
