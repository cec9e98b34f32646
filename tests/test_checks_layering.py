"""`mha_rosetta.checks` asks the backends layer, never a framework or an adapter's own modules.

The checks reach a library only through `Backend` objects (`get_backend`) and the public modules
of `mha_rosetta.backends` (the registry, the framework layer, `backends.precision` for the TF32
table, `backends.compiling` for the workers' compile clock and program cache). An AST walk of every
module of the package, function-local imports included, finds no other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CHECKS = Path(__file__).resolve().parents[1] / "checks"
FRAMEWORKS = {"torch", "jax", "jaxlib", "flax", "equinox", "keras", "einops", "transformers", "ml_dtypes"}
# The adapters' own packages: what lives there is reached through get_backend / the Backend interface.
ADAPTER_PACKAGES = {"numpy", "torch", "jax", "einops", "sharded", "oracles"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            if node.module == "mha_rosetta.backends":  # `from mha_rosetta.backends import torch` names a package
                found += [(node.lineno, f"mha_rosetta.backends.{alias.name}") for alias in node.names]
    return sorted(found)


def forbidden(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in FRAMEWORKS:
        return "a framework"
    if parts[:2] == ["mha_rosetta", "backends"] and len(parts) > 2 and parts[2] in ADAPTER_PACKAGES:
        return "an adapter's own module"
    return None


def test_the_walk_sees_every_kind_of_import(tmp_path):
    source = "import jax.monitoring\ndef f():\n    from mha_rosetta.backends.torch.common import to_tensor\n"
    source += "from mha_rosetta.backends import REGISTRY, jax\nfrom . import engine\n"
    (tmp_path / "m.py").write_text(source, encoding="utf-8")
    found = imported_modules(tmp_path / "m.py")
    assert [(line, module, forbidden(module)) for line, module in found if forbidden(module)] == [
        (1, "jax.monitoring", "a framework"),
        (3, "mha_rosetta.backends.torch.common", "an adapter's own module"),
        (4, "mha_rosetta.backends.jax", "an adapter's own module"),
    ]


@pytest.mark.parametrize("path", sorted(CHECKS.glob("*.py")), ids=lambda path: path.name)
def test_no_check_module_imports_a_framework_or_an_adapters_module(path):
    bad = [
        f"{path.name}:{line} imports {module} ({why})"
        for line, module in imported_modules(path)
        if (why := forbidden(module))
    ]
    assert not bad, "\n".join(bad)
