"""`benchmarks` sits below `report` and `cli` and asks the framework layer: an AST walk of its modules
(function-local imports count too) finds no import of `report`, `cli` or a framework."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "jax", "jaxlib", "einops", "flax", "equinox", "keras", "transformers")
ABOVE = ("mha_rosetta.report", "mha_rosetta.cli", "mha_rosetta.checks", "mha_rosetta.explain", "mha_rosetta.diagnose")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda path: path.name)
def test_a_benchmarks_module_imports_nothing_above_it_and_no_framework(path):
    names = imported_modules(path)
    above = sorted(name for name in names if name.startswith(ABOVE))
    frameworks = sorted(name for name in names if name.split(".")[0] in FRAMEWORKS)
    assert above == [] and frameworks == [], f"{path.name} imports {above + frameworks}"


def test_the_walk_sees_function_local_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import torch\n    from mha_rosetta.report.runs import load_run\n")
    assert imported_modules(sample) == {"torch", "mha_rosetta.report.runs"}
