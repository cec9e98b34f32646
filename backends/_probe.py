"""Is an optional library usable here? The backends ask `mha_rosetta.core.probe`.

The probe is standard library only, so it lives in `core`, where `mha_rosetta.models` (which
imports only `core`) can ask it too; this module re-exports it under the name the backends
have always imported, so there is one probe and one cache. The packages above the backends
(checks, explain, diagnose, benchmarks) ask the public names `mha_rosetta.backends.installed`
and `mha_rosetta.backends.import_failure`.
"""

from __future__ import annotations

from mha_rosetta.core.probe import REMEDIES, Probe, import_failure, importable, probe


def installed(library: str) -> bool:
    """True when ``library`` imports here (imported once to find out, and remembered): `core.probe`."""
    return importable(library)


__all__ = ["REMEDIES", "Probe", "import_failure", "importable", "installed", "probe"]
