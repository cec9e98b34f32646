"""The result of a demonstration (`Difference`) and the loop that runs library calls into its rows.

The library calls themselves (each library's attention, called the way its users call it, fed the seed
setup's parameters and inputs) live with the other framework code in `mha_rosetta.backends.demos`; this
package words what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from mha_rosetta.backends.demos import LibraryMissing
from mha_rosetta.core import error_line, torch_mha_unsupported_reason

from ..seed_setup import Setup


@dataclass
class Difference:
    key: str
    title: str
    status: str  # "demonstrated" or "skipped: <reason>"
    rows: list[tuple[str, str]] = field(default_factory=list)  # (what was run, what came out)
    takeaway: str = ""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rows"] = [{"run": run, "result": result} for run, result in self.rows]
        return data


def _supported(setup: Setup) -> str | None:
    cfg = setup.cfg
    if not cfg.bias:
        return "the demonstrations use the biased layer; this configuration has bias=False"
    return torch_mha_unsupported_reason(cfg)


def library_rows(runs: Sequence[tuple], describe: Callable[..., str]) -> list[tuple[str, str]]:
    """One row per ``(label, call, *extra)`` in ``runs``: ``describe(what call returned, *extra)``; a library that
    does not import here is a skipped row with the reason, and a call the library refuses is itself the
    evidence (the error line)."""
    rows = []
    for label, call, *extra in runs:
        try:
            result = call()
        except LibraryMissing as missing:
            rows.append((label, f"skipped: {missing.reason}"))
            continue
        except Exception as error:  # a library refusing the call is itself the evidence
            rows.append((label, f"raised {error_line(error)}"))
            continue
        rows.append((label, describe(result, *extra)))
    return rows


def _keys_of_query0(weights) -> str:
    if weights is None:
        return "(attention weights not returned)"
    row = np.asarray(weights)[0, 0, 0]  # batch 0, head 0, query 0
    if np.isnan(row).any():
        return "query 0 has NaN weights"
    return f"query 0 attends keys {np.flatnonzero(row > 1e-12).tolist()}"
