"""The versions of the libraries a result depends on: one list, used by the check and the benchmark.

The frameworks come from the registry (every module a registered backend requires), so a
new backend's library is reported without editing this file; the rest are libraries that
change numbers or timings without being a backend's requirement.
"""

from __future__ import annotations

import importlib.metadata

# jaxlib holds JAX's kernels, ml_dtypes NumPy's bfloat16, threadpoolctl and scipy the BLAS
# thread pools the benchmark reports.
SUPPORTING_PACKAGES = ("jaxlib", "ml_dtypes", "threadpoolctl", "scipy")


def versioned_packages() -> tuple[str, ...]:
    """This project, every module a registered backend requires, then the supporting packages."""
    from .entries import REGISTRY

    names = ["mha-rosetta"]
    for entry in REGISTRY.values():
        names += [module for module in entry.requires if module not in names]
    return (*names, *(name for name in SUPPORTING_PACKAGES if name not in names))


def library_versions() -> dict[str, str]:
    """Installed version of each of `versioned_packages()`; packages that are not installed are left out."""
    versions = {}
    for name in versioned_packages():
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
