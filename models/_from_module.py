"""`from_module` / `to_module` on one layout: its reader, then its exact unpacking (the dispatch by class is in
`mha_rosetta.models`)."""

from __future__ import annotations

import math
from dataclasses import replace

from mha_rosetta.core import MHAConfig, MHAParams

from ._errors import LayoutError
from ._layout import Layout
from ._module_io import ModuleReader, ModuleSpec, class_name, config_differences


def _reader(layout: Layout) -> ModuleReader:
    if layout.reader is None:
        raise LayoutError(f"layout {layout.name!r} has no module reader")
    return layout.reader


def read_module(layout: Layout, module) -> ModuleSpec:
    """``module`` read by ``layout``'s reader: its configuration, and its tensors unpacked exactly."""
    reader = _reader(layout)
    cfg = _default_scale_as_default(reader.config(module))
    return ModuleSpec(cfg, layout.from_state_dict(cfg, reader.state(module, cfg)))


def _default_scale_as_default(cfg: MHAConfig) -> MHAConfig:
    """A module's ``head_dim**-0.5`` and the spec's ``1/sqrt(d_k)`` can differ in the last bit: the default is kept."""
    default = 1.0 / math.sqrt(cfg.d_k)  # MHAConfig's own default, bit for bit
    return replace(cfg, scale=default) if math.isclose(cfg.scale, default, rel_tol=1e-12) else cfg


def load_module(layout: Layout, cfg: MHAConfig, params: MHAParams, module):
    """``params`` (for ``cfg``) written into ``module`` by ``layout``'s reader; the module (or the new one)."""
    reader = _reader(layout)
    differences = config_differences(_default_scale_as_default(reader.config(module)), cfg)
    if differences:
        raise LayoutError(
            f"to_module: {class_name(module)} was built for another configuration than the parameters' "
            f"({'; '.join(differences)})"
        )
    return reader.load(module, layout.to_state_dict(cfg, params))
