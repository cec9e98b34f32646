"""The check's machine-readable result: versioned JSON (`SCHEMA_VERSION`) of the forward, gradient and decode checks.

Non-finite numbers appear as the strings "inf", "-inf" and "nan", because JSON has no literal
for them. `write_json` writes atomically (`core.files.write_output`).
"""

from __future__ import annotations

import datetime
import json
import math

from mha_rosetta.backends.versions import library_versions
from mha_rosetta.benchmarks.provenance import provenance
from mha_rosetta.core import TOLERANCES
from mha_rosetta.core.errors import INTERRUPTED

from .matrices import Cell, Matrix, build_matrices, worst_by_dtype, worst_cases
from .results import STATUS_MEANING, CheckResult, DecodeCheckResult, GradCheckResult, Pair, Run

SCHEMA_VERSION = 1


def json_number(value: float | None):
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def run_identity_json(run) -> dict:
    """The keys that say which run a JSON entry is, shared by the forward, gradient and decode checks.

    ``cache`` (the decode check's KV-cache kind) appears only where there is one, so the
    forward and gradient checks' JSON is unchanged.
    """
    identity = {
        "case": run.case,
        "implementation": run.label,
        "backend": run.impl.backend,
        "strategy": run.impl.strategy,
        "device": run.impl.device,
    }
    if run.impl.cache:
        identity["cache"] = run.impl.cache
    return {**identity, "dtype": run.dtype, "kind": run.kind}


def _run_json(run: Run) -> dict:
    return {
        **run_identity_json(run),
        "known_mistake": run.impl.known_mistake,
        "status": str(run.status),
        "reason": run.reason,
        "max_abs": json_number(run.max_abs),
        "max_rel": json_number(run.max_rel),
        "tolerance": None if run.tolerance is None else {"atol": run.tolerance.atol, "rtol": run.tolerance.rtol},
        "first_divergence": None if run.divergence is None else _divergence_json(run.divergence),
        "info": run.info,
        "seconds": run.seconds,
    }


def _divergence_json(divergence) -> dict:
    data = divergence.as_dict()
    data["max_abs"], data["max_rel"] = json_number(data["max_abs"]), json_number(data["max_rel"])
    return data


def _pair_json(pair: Pair) -> dict:
    data = {
        "case": pair.case,
        "dtype": pair.dtype,
        "a": pair.a.label,
        "b": pair.b.label,
        "status": str(pair.status),
        "max_abs": json_number(pair.max_abs),
        "max_rel": json_number(pair.max_rel),
    }
    if pair.reason:
        data["reason"] = pair.reason
    if pair.divergence:
        data["first_divergence"] = _divergence_json(pair.divergence)
    return data


def _cell_json(cell: Cell | None, attribute: str):
    if cell is None:
        return None
    return str(cell.status) if attribute == "status" else json_number(getattr(cell, attribute))


def _matrix_json(matrix: Matrix) -> dict:
    labels = matrix.labels

    def grid(attribute: str) -> list[list]:
        # Row a, column b: the comparison of a with b (symmetric; None on the diagonal).
        return [[_cell_json(matrix.cells.get((a, b)) if a != b else None, attribute) for b in labels] for a in labels]

    return {
        "dtype": matrix.dtype,
        "case": matrix.case,
        "labels": labels,
        "oracle": [
            {
                "implementation": label,
                "status": _cell_json(matrix.oracle[label], "status"),
                "max_abs": _cell_json(matrix.oracle[label], "max_abs"),
                "max_rel": _cell_json(matrix.oracle[label], "max_rel"),
            }
            for label in labels
        ],
        "max_abs": grid("max_abs"),
        "max_rel": grid("max_rel"),
        "status": grid("status"),
    }


def to_json(result: CheckResult) -> dict:
    """The whole result as plain JSON data (schema `SCHEMA_VERSION`)."""
    if not result.provenance:
        result.provenance = provenance()  # once per result, however often the JSON is rewritten
    return {
        "schema": SCHEMA_VERSION,
        "tool": "mha-rosetta check",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exit_status": result.exit_code,
        "verdict": result.verdict(),
        "interrupted": result.interrupted,
        "seconds": result.seconds,
        "settings": result.settings,
        "versions": library_versions(),
        "provenance": result.provenance,  # mha_rosetta.benchmarks.provenance: commit, host, CPU, command line
        "tolerances": {name: {"atol": t.atol, "rtol": t.rtol} for name, t in TOLERANCES.items()},
        "statuses": {str(status): meaning for status, meaning in STATUS_MEANING.items()},
        "summary": {
            "runs": {str(s): n for s, n in result.run_counts().items()},
            "pairs": {str(s): n for s, n in result.pair_counts().items()},
            "worst": [
                {**row, "vs_oracle": _nums(row["vs_oracle"]), "pair": _nums(row["pair"])} for row in worst_cases(result)
            ],
        },
        "skipped_backends": [{"backend": name, "reason": reason} for name, reason in result.skipped_backends.items()],
        "broken_backends": [{"backend": name, "error": error} for name, error in result.broken_backends.items()],
        "frameworks_without_gpu": [
            {"framework": name, "error": error} for name, error in result.frameworks_without_gpu.items()
        ],
        "declared_differences": {name: list(notes) for name, notes in result.declared_differences.items()},
        "cases": [case.as_dict() for case in result.cases],
        "runs": [_run_json(run) for run in result.runs],
        "pairs": [_pair_json(pair) for pair in result.pairs],
        "matrices": [_matrix_json(m) for m in build_matrices(result)],
        "timings": result.timings,
    }


def _nums(entry: dict | None) -> dict | None:
    if entry is None:
        return None
    return {k: json_number(v) if k in ("max_abs", "max_rel") else v for k, v in entry.items()}


def write_json(result: CheckResult, path: str, grad=None, partial: bool = False) -> None:
    """Write the JSON report to ``path`` atomically, or to stdout for "-"; ``grad``: a gradient check too.

    ``partial``: the check is still running (the command rewrites the file as results arrive): the
    file says ``"interrupted": true`` and exit status 130, which stays true if the check never ends.
    """
    data = to_json(result)
    if grad is not None:
        data["grad"] = grad_to_json(grad)
    _write(data, path, partial)


def grad_to_json(result: GradCheckResult) -> dict:
    """The ``grad`` section of ``mha-rosetta check --grad --json``."""
    return {
        "settings": result.settings,
        "exit_status": result.exit_status,
        "verdict": result.verdict(),
        "seconds": result.seconds,
        "worst_by_dtype": {
            dtype: {
                label: {
                    **entry,
                    "status": str(entry["status"]),
                    "max_abs": json_number(entry["max_abs"]),
                    "ratio": json_number(entry["ratio"]),
                }
                for label, entry in rows.items()
            }
            for dtype, rows in worst_by_dtype(result).items()
        },
        "runs": [
            {
                **run_identity_json(run),
                "status": str(run.status),
                "reason": run.reason,
                "divergent_stage": run.divergent_stage,
                "tensors": {
                    name: {"max_abs": json_number(t.max_abs), "atol": t.atol, "ok": t.ok}
                    for name, t in run.tensors.items()
                },
            }
            for run in result.runs
        ],
        "pairs": [
            {
                "case": p.case,
                "a": p.a.label,
                "b": p.b.label,
                "dtype": p.dtype,
                "status": str(p.status),
                "tensor": p.tensor,
                "max_abs": json_number(p.max_abs),
                "reason": p.reason,
            }
            for p in result.pairs
        ],
        "skipped_backends": result.skipped_backends,
        "broken_backends": result.broken_backends,
        "timings": result.timings,
    }


def decode_to_json(result: DecodeCheckResult) -> dict:
    """``mha-rosetta check --decode --json``: the forward check's document (`to_json`) for decode runs.

    Each run and pair adds ``where`` (the first chunk, its position and first divergent stage,
    "" when it agrees); a run's ``cache`` (in its identity) and ``info["cache"]`` say which cache
    it ran and its kind, layout, slots and bytes; each case lists its ``chunks``.
    """
    data = to_json(result)
    data["tool"] = "mha-rosetta check --decode"
    for entry, run in zip(data["runs"], result.runs, strict=True):
        entry["where"] = run.where
    for entry, pair in zip(data["pairs"], result.pairs, strict=True):
        entry["where"] = pair.where
    return data


def write_decode_json(result: DecodeCheckResult, path: str, partial: bool = False) -> None:
    """Write the decode check's JSON to ``path`` atomically (or stdout for "-"); ``partial`` as `write_json`'s."""
    _write(decode_to_json(result), path, partial)


def _write(data: dict, path: str, partial: bool) -> None:
    """Write a check's JSON ``data`` to ``path`` atomically (or stdout for "-"), `write_json`'s and
    `write_decode_json`'s rule: a partial file marked interrupted (exit status 130) and compact (JSON's C encoder:
    0.045 s for the default check's 3.4 MB, against 0.15 s indented; the command rewrites it as results arrive);
    the final one indented, to read and to diff."""
    from mha_rosetta.core.files import write_output

    if partial:
        data["interrupted"], data["exit_status"] = True, INTERRUPTED
        data["verdict"] = "interrupted: the results that finished are here (the check did not end)"
    text = json.dumps(data, default=str) if partial else json.dumps(data, indent=1, default=str)
    write_output(path, text + "\n")
