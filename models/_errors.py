"""`LayoutError`: the one error of `mha_rosetta.models` (its own module, so that every other module can raise it)."""

from __future__ import annotations


class LayoutError(ValueError):
    """A configuration a layout cannot hold, a state dict that does not fit it, or a module it cannot read."""
