"""Is an optional library usable here? The backends ask `mha_rosetta.core.probe`.

The probe is standard library only, so it lives in `core`, where `mha_rosetta.models` (which
imports only `core`) can ask it too; this module re-exports it under the name the backends,
the explainer and the checks have always imported, so there is one probe and one cache.
"""

from __future__ import annotations

from mha_rosetta.core.probe import REMEDIES, Probe, import_failure, importable, probe

__all__ = ["REMEDIES", "Probe", "import_failure", "importable", "probe"]
