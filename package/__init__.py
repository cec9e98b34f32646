"""mha_rosetta: multi-head attention written once, implemented, checked, timed and explained.

This folder is the top-level package (pyproject maps ``mha_rosetta`` to it, and each
subpackage to its own top-level folder: ``mha_rosetta.core`` to ``core/`` ...). It is not
named ``mha_rosetta/`` on purpose: a folder of that name at the repository root would be
found first when Python runs from the root (``sys.path[0]`` is the current directory) and
hide the installed subpackages.

It imports nothing: ``import mha_rosetta.core`` loads NumPy only, as before.
"""

from __future__ import annotations

import importlib.metadata

try:  # one source: the version in pyproject.toml, read back from the installed metadata
    __version__ = importlib.metadata.version("mha-rosetta")
except importlib.metadata.PackageNotFoundError:  # sources on sys.path that were never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
