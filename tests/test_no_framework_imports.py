"""Importing core, backends, models or the CLI must not import any framework (checked in a fresh interpreter).

`available_backends()` is another matter: it imports each framework once to be sure it
loads (a library that is installed but fails to import is a skip, not a crash).
"""

import pytest

from conftest import python_stdout


@pytest.mark.parametrize(
    "module",
    [
        "mha_rosetta.core",
        "mha_rosetta.backends",
        "mha_rosetta.backends.demos",
        "mha_rosetta.models",
        "mha_rosetta.cli.main",
        "mha_rosetta.diagnose.confusion",
        "mha_rosetta.cli.diagnose",
    ],
)
def test_import_pulls_in_no_framework(module):
    code = (
        f"import sys, {module}\n"
        "frameworks = ('torch', 'jax', 'jaxlib', 'einops', 'flax', 'equinox', 'ml_dtypes', 'keras', 'transformers')\n"
        "loaded = sorted(m for m in frameworks if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    loaded = python_stdout(code)
    assert loaded == "", f"importing {module} imported {loaded}"


def test_contract_example_runs_with_numpy_only():
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from mha_rosetta.core import MHAConfig, init_params, reference_mha\n"
        "cfg = MHAConfig(d_model=12, n_heads=3)\n"
        "params = init_params(cfg, seed=0)\n"
        "x = np.random.default_rng(1).standard_normal((2, 6, 12))\n"
        "print(reference_mha(cfg, params, x).shape, 'torch' in sys.modules, 'jax' in sys.modules)\n"
    )
    assert python_stdout(code) == "(2, 6, 12) False False"


def test_models_imports_only_core_among_the_projects_packages():
    """`mha_rosetta.models` (every layout and every real-module runner module) loads no other project package."""
    code = (
        "import sys, pkgutil, importlib, mha_rosetta.models as models\n"
        "for info in pkgutil.iter_modules(models.__path__):\n"
        "    importlib.import_module('mha_rosetta.models.' + info.name)\n"
        "ours = {m.split('.')[1] for m in sys.modules if m.startswith('mha_rosetta.') and m.count('.') >= 1}\n"
        "print(','.join(sorted(ours)))\n"
    )
    assert python_stdout(code) == "core,models"


def test_no_models_module_imports_another_project_package_even_lazily():
    """Function-local imports count too: an AST walk of every models file finds only core among ours."""
    import ast
    from pathlib import Path

    found = set()
    for path in sorted((Path(__file__).resolve().parents[1] / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mha_rosetta."):
                found.add((path.name, node.module.split(".")[1]))
            elif isinstance(node, ast.Import):
                found |= {(path.name, a.name.split(".")[1]) for a in node.names if a.name.startswith("mha_rosetta.")}
    assert {package for _, package in found} == {"core"}, sorted(p for p in found if p[1] != "core")
