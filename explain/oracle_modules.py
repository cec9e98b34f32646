"""The real modules of every layout, the library oracles included: `models` runs the families, a backend the rest.

`mha_rosetta.models` imports only `core`, so it cannot run a backend. Flax's and Equinox's layouts have
no runner there: the project's own oracle backends of the same name already build the real module's tree
from the same converters (`core.to_flax_params` / `to_equinox_weights`) and run it. This module gives the
explainer and the tests one entry point for both kinds.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig


def unavailable_reason(layout_name: str) -> str | None:
    """None when ``layout_name``'s real module can run here; else why not, with the install command."""
    from mha_rosetta.models import get_layout
    from mha_rosetta.models.real_modules import libraries_missing
    from mha_rosetta.models.real_modules import unavailable_reason as family_reason

    if get_layout(layout_name).runner is not None:
        return family_reason(layout_name)
    from mha_rosetta.backends import REGISTRY

    if layout_name not in REGISTRY:
        return f"layout {layout_name!r} has neither a real-module runner nor an oracle backend of that name"
    return libraries_missing(REGISTRY[layout_name].requires)


def run_layout(layout_name: str, cfg: MHAConfig, state: dict[str, np.ndarray], x: np.ndarray, padding=None, **options):
    """`models.real_modules.run_real` for the families; the oracle backend for Flax and Equinox (a `RealRun`)."""
    from mha_rosetta.models import get_layout
    from mha_rosetta.models.real_modules import RealRun, allowed_mask, run_real

    layout = get_layout(layout_name)
    if layout.runner is not None:
        return run_real(layout_name, cfg, state, x, padding, **options)
    reason = unavailable_reason(layout_name)
    if reason:
        raise ImportError(f"layout {layout_name!r}: cannot build the real module: {reason}")
    if options:
        raise ValueError(f"{', '.join(options)} apply to Hugging Face layouts only, not {layout_name!r}")
    from mha_rosetta.backends import get_backend

    # from_state_dict checks every flat name against the layout; the backend then builds the real module's
    # tree from the same converter (core.to_flax_params / to_equinox_weights) and runs it in float64.
    params = layout.from_state_dict(cfg, state)  # layout.module names the library's class
    x = np.asarray(x, dtype=np.float64)
    B, N, _ = x.shape
    padding = None if padding is None else np.asarray(padding, dtype=bool)
    backend = get_backend(layout_name)
    output = backend.run(cfg, params, x, mask=allowed_mask(cfg, B, N, padding), dtype="float64")
    shapes = {name: tuple(value.shape) for name, value in state.items()}
    description = f"{layout.module} (through the {layout_name!r} oracle backend)"
    return RealRun(layout_name, "real", description, output, parameters=shapes)
