"""An optional library that is installed but fails to import is a skip that names it, never a crash.

The case seen in the wild: Keras 3 next to JAX and torch, no TensorFlow, no
``KERAS_BACKEND``: ``find_spec("keras")`` finds it, ``import keras`` raises
``No module named 'tensorflow'``, and ``mha-rosetta explain`` used to exit 1. Here a fake
package on ``PYTHONPATH`` whose ``__init__`` raises stands in for any broken install, and
``check`` and ``explain`` run through it in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mha_rosetta.backends._probe import Probe, import_failure, probe
from mha_rosetta.core import probe as core_probe

backends_probe = sys.modules[probe.__module__]  # wherever the backends keep it
assert (Probe, import_failure) == (backends_probe.Probe, backends_probe.import_failure)

# The same probe serves the backends and (standard library only, in core) the models' real-module runners.
PROBES = pytest.mark.parametrize("probes", [backends_probe, core_probe], ids=["backends._probe", "core.probe"])


def _broken_packages(tmp_path, **errors: str):
    """A folder with one package per name whose import raises the given exception text."""
    for name, raise_line in errors.items():
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text(raise_line + "\n")
    return tmp_path


def _run(args: list[str], pythonpath=None, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"})
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = "import sys; from mha_rosetta.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


@PROBES
def test_probe_names_a_missing_module_and_caches_the_answer(probes):
    result = probes.probe("mha_rosetta_no_such_library")
    assert result == probes.Probe("mha_rosetta_no_such_library", installed=False)
    assert result.reason == "mha_rosetta_no_such_library is not installed"
    assert probes.probe("mha_rosetta_no_such_library") is result  # imported (or looked for) once per process
    assert probes.import_failure("numpy") is None


@PROBES
def test_probe_reports_the_import_error_of_an_installed_module(tmp_path, probes):
    _broken_packages(tmp_path, mha_rosetta_broken_lib='raise RuntimeError("simulated: no device library")')
    sys.path.insert(0, str(tmp_path))
    try:
        result = probes.probe("mha_rosetta_broken_lib")
    finally:
        sys.path.remove(str(tmp_path))
    assert result.installed and not result.ok
    assert (
        result.reason
        == "mha_rosetta_broken_lib is installed but failed to import: RuntimeError: simulated: no device library"
    )


def test_check_skips_a_backend_whose_library_fails_to_import(tmp_path):
    fake = _broken_packages(tmp_path, einops='raise ImportError("simulated broken einops")')
    result = _run(
        ["check", "--backends", "numpy,einops-numpy", "--cases", "self_attention", "--dtypes", "float64", "--plain"],
        fake,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "backend 'einops-numpy' cannot load: einops is installed but failed to import: ImportError: simulated broken einops"
        in result.stdout
    )


def test_explain_runs_through_libraries_that_fail_to_import(tmp_path):
    fake = _broken_packages(
        tmp_path,
        einops='raise ImportError("simulated broken einops")',
        equinox='raise RuntimeError("simulated broken equinox")',
    )
    args = ["explain", "--plain", "--backends", "numpy,einops-numpy", "--sections", "stages,weights"]
    result = _run(args, fake)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "einops is installed but failed to import: ImportError: simulated broken einops" in result.stdout
    assert (
        "equinox is installed but failed to import: RuntimeError: simulated broken equinox: real-module check skipped"
        in result.stdout
    )


def test_explain_with_keras_and_no_keras_backend_names_the_remedy():
    """The reported bug: keras installed, no TensorFlow, KERAS_BACKEND unset -> exit 1 and nothing printed."""
    from importlib.util import find_spec

    if find_spec("keras") is None:
        pytest.skip("keras is not installed: pip install 'mha-rosetta[models]'")
    if find_spec("tensorflow") is not None:
        pytest.skip("tensorflow is installed, so keras imports without KERAS_BACKEND")
    result = _run(["explain", "--plain", "--sections", "differences"], drop=("KERAS_BACKEND",))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "keras is installed but failed to import: ModuleNotFoundError: No module named 'tensorflow'" in result.stdout
    assert "KERAS_BACKEND=jax" in result.stdout
