"""Importing core, backends, models or the CLI must not import any framework (checked in a fresh interpreter).

`available_backends()` is another matter: it imports each framework once to be sure it
loads (a library that is installed but fails to import is a skip, not a crash).
"""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "mha_rosetta.core",
        "mha_rosetta.backends",
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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"importing {module} imported {result.stdout.strip()}"


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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "(2, 6, 12) False False"
