"""Every subpackage of the project is in pyproject.toml's packages list.

setuptools installs only the packages that list names (`package-dir` maps the top-level folders),
so a new subpackage missing from it works in an editable install and in this test run, and is
absent from a wheel: `pip install .`, every tox environment and every user. The structure work
added three (core.variants, backends.demos, backends.best), each a line that is easy to forget.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_folder_with_an_init_is_a_listed_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    assert found - listed == set(), f"subpackages missing from [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages with no folder: {sorted(listed - found)}"
