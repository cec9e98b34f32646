"""The README's two commands are the ones CI runs, and its Python example runs as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import requires

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _quickstart_commands() -> list[str]:
    """The shell lines of the fenced block that follows the 'Quick start' heading."""
    section = README.split("## Quick start", 1)[1]
    block = re.search(r"```(?:sh|bash|console)\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_quickstart_has_setup_then_the_main_job_then_the_tests():
    commands = _quickstart_commands()
    assert commands[-2:] == ["tox -e check", "tox"], commands


def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert _quickstart_commands()[-1] in ci_lines


def test_tox_check_env_runs_the_check_subcommand():
    tox = (ROOT / "tox.ini").read_text()
    check_section = tox.split("[testenv:check]", 1)[1].split("\n[", 1)[0]
    assert "commands = mha-rosetta check" in check_section


@requires("torch")
def test_public_contract_example_runs():
    section = README.split("## The public contract", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
