"""`diagnose` stays bounded: a candidate that hangs, spins, ends its process or segfaults is reported with a
clear error (exit status 2) within its per-probe time limit, and a good candidate is still diagnosed.

The command line runs a candidate named by import path in a spawned child process (`diagnose.isolated`);
the Python API keeps a callable in process, in a daemon thread that never blocks the interpreter's exit.
Every command here runs under a `subprocess.run` timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import requires, run_cli

ROOT = Path(__file__).resolve().parents[1]
LIMIT = "1"  # seconds per probe for the bad candidates: small, so that each test is short

CANDIDATES = """
import ctypes
import os
import re
import time

from mha_rosetta.core import reference_mha
from mha_rosetta.diagnose.confusion import SETTINGS


def hangs(params, query, key, value, mask):
    time.sleep(3600)


def spins(params, query, key, value, mask):
    while True:  # pure Python: holds the GIL between switch intervals
        pass


def exits(params, query, key, value, mask):
    os._exit(3)


def holds_gil(params, query, key, value, mask):
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking inside the C regex engine, GIL held


def segfaults(params, query, key, value, mask):
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def good(params, query, key, value, mask):
    return reference_mha(SETTINGS["plain"], params, query, key, value, mask)
"""


@pytest.fixture(scope="module")
def candidates_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("candidates")
    (folder / "bad_candidates.py").write_text(CANDIDATES, encoding="utf-8")
    return folder


def _cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    # bounded: a hang in diagnose itself fails the test here
    return run_cli("diagnose", *args, cwd=ROOT, env={"PYTHONPATH": str(folder)}, timeout=240)


SIZES = ("--d-model", "12", "--heads", "3")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("hangs", "the candidate did not return within 1 s on probe 'random' (time limit per probe)"),
        ("spins", "the candidate did not return within 1 s on probe 'random' (time limit per probe)"),
        (
            "exits",
            "the candidate's process exited with status 3 on probe 'random', without a result (a crash in the candidate)",
        ),
        (
            "segfaults",
            "the candidate's process was killed by signal SIGSEGV (11) on probe 'random', without a result (a crash in the candidate)",
        ),
    ],
)
def test_a_bad_candidate_is_reported_and_diagnose_exits_with_status_2(candidates_dir, name, message):
    done = _cli(candidates_dir, f"bad_candidates:{name}", *SIZES, "--timeout", LIMIT)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == f"mha-rosetta diagnose: error: {message}", done.stderr
    assert done.stdout == ""


def test_a_good_candidate_in_the_child_process_agrees(candidates_dir):
    done = _cli(candidates_dir, "bad_candidates:good", *SIZES, "--json", "-")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["agrees"] is True and result["causes"] == []
    assert result["max_error"] < 1e-12  # the candidate is the oracle itself, in float64


@requires("torch")
def test_the_readme_example_is_still_diagnosed_through_the_child_process(candidates_dir):
    done = _cli(candidates_dir, "examples.my_attention:candidate", *SIZES, "--json", "-")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert [cause["code"] for cause in result["causes"]] == ["qkv_packing"]
    assert "packed as blocks, read as interleaved" in result["causes"][0]["detail"]


def test_an_import_path_error_still_names_the_path(candidates_dir):
    done = _cli(candidates_dir, "bad_candidates:nothing", *SIZES)
    assert done.returncode == 2
    assert "cannot import bad_candidates:nothing: 'bad_candidates' has no attribute 'nothing'" in done.stderr


def test_in_process_a_spinning_candidate_times_out_and_the_interpreter_still_exits():
    script = textwrap.dedent(
        """
        from mha_rosetta.diagnose import DiagnoseError, diagnose
        from mha_rosetta.diagnose.confusion import SETTINGS

        def spins(params, query, key, value, mask):
            while True:
                pass

        try:
            diagnose(spins, SETTINGS["plain"], timeout=0.5)
        except DiagnoseError as error:
            print(error)
        """
    )
    # The abandoned worker still spins when the script ends: only a daemon thread lets the process exit.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "the candidate did not return within 0.5 s on probe 'random' (time limit per probe)"


def test_the_child_process_api_checks_its_limits():
    from mha_rosetta.diagnose import DiagnoseError
    from mha_rosetta.diagnose.isolated import diagnose_import_path

    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds, got 0"):
        diagnose_import_path("bad_candidates:hangs", None, timeout=0)
    with pytest.raises(DiagnoseError, match=r"did not start within 0\.001 s \(importing it\)"):
        diagnose_import_path("examples.my_attention:candidate", None, timeout=1, start_timeout=0.001)
