"""One version: pyproject's, read back from the installed metadata by __version__ and --version."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import mha_rosetta
from mha_rosetta.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_metadata_one(capsys):
    version = importlib.metadata.version("mha-rosetta")
    assert mha_rosetta.__version__ == version
    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert capsys.readouterr().out == f"mha-rosetta {version}\n"


def test_pyproject_is_the_source():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    [version] = re.findall(r'^version = "([^"]+)"$', text, re.M)
    assert "dynamic" not in text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert mha_rosetta.__version__ == version


def test_no_root_folder_shadows_the_package():
    # Python puts the current directory first on sys.path: from the repository root, a folder
    # named mha_rosetta/ would be imported instead of the installed package.
    assert not (ROOT / "mha_rosetta").exists()
    code = "import mha_rosetta, mha_rosetta.core; print(mha_rosetta.__version__, mha_rosetta.core.MHAConfig.__name__)"
    for cwd in (ROOT, Path("/")):
        done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
        assert done.stdout.split() == [mha_rosetta.__version__, "MHAConfig"], cwd
