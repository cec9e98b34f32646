"""Provenance: every field present and typed, the git state read right, and no framework imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires, run_cli
from mha_rosetta.benchmarks import provenance as prov

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "jax", "jaxlib", "einops", "flax", "equinox", "keras", "transformers")
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_fields_present_and_typed():
    p = prov.provenance(["mha-rosetta", "check", "--quiet"])
    assert p["provenance_version"] == prov.PROVENANCE_VERSION == 1
    assert p["tool"] == "mha-rosetta"
    assert p["tool_version"] == prov.importlib.metadata.version("mha-rosetta")
    assert p["command"] == ["mha-rosetta", "check", "--quiet"]
    assert p["created_utc"].endswith("+00:00") and p["created_utc"][4] == "-"
    for key in ("host", "host_id", "cpu_model", "os", "python", "python_implementation"):
        assert isinstance(p[key], str) and p[key], key
    assert isinstance(p["cpu_count"], int) and p["cpu_count"] >= 1
    assert p["allowed_cores"] is None or 1 <= p["allowed_cores"] <= p["cpu_count"]
    assert p["python"] == ".".join(map(str, sys.version_info[:3]))
    assert p["libraries"]["numpy"] == prov.importlib.metadata.version("numpy")
    assert all(isinstance(v, str) for v in p["libraries"].values())
    assert p["git"] is None or set(p["git"]) == {"commit", "dirty", "branch"}
    json.dumps(p)  # plain JSON data


def test_command_defaults_to_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog", "--x"])
    assert prov.provenance()["command"] == ["prog", "--x"]


def test_host_id_is_stable_and_hides_the_machine_id():
    first = prov.host_id()
    assert first == prov.host_id() and len(first) == 16 and int(first, 16) >= 0
    machine_id = Path("/etc/machine-id")
    if machine_id.exists():
        assert first not in machine_id.read_text()


@needs_git
def test_commit_is_this_checkouts_head():
    if subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout (an sdist or a copy)")
    state = prov.git_state(ROOT)
    assert state["commit"] == _git(ROOT, "rev-parse", "HEAD")
    assert state["dirty"] == bool(_git(ROOT, "status", "--porcelain"))
    if prov.SOURCE_ROOT == ROOT:  # an editable install: the tool's own provenance names this commit
        assert prov.provenance()["git"]["commit"] == state["commit"]


@needs_git
def test_dirty_flag_ignores_ignored_files_and_sees_modified_ones(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "HEAD")
    assert prov.git_state(repo) == {
        "commit": head,
        "dirty": False,
        "branch": _git(repo, "rev-parse", "--abbrev-ref", "HEAD"),
    }
    (repo / "build.log").write_text("ignored\n")  # untracked but ignored: still clean
    assert prov.git_state(repo)["dirty"] is False
    (repo / "a.txt").write_text("two\n")  # a modified tracked file: dirty
    assert prov.git_state(repo)["dirty"] is True
    (repo / "a.txt").write_text("one\n")
    assert prov.git_state(repo)["dirty"] is False
    (repo / "new.txt").write_text("not ignored\n")  # untracked, not ignored: dirty
    assert prov.git_state(repo)["dirty"] is True
    # A folder inside a repository is not a checkout of the package: nothing is claimed.
    (repo / "sub").mkdir()
    assert prov.git_state(repo / "sub") is None


def test_no_checkout_or_no_git_gives_none(tmp_path, monkeypatch):
    assert prov.git_state(tmp_path) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    assert prov.git_state(ROOT) is None
    assert prov.provenance()["git"] is None


def test_provenance_imports_no_framework():
    code = (
        "import sys, json\n"
        "from mha_rosetta.benchmarks.provenance import provenance\n"
        "p = provenance()\n"
        f"print(json.dumps([sorted(m for m in {FRAMEWORKS!r} if m in sys.modules), sorted(p['libraries'])]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    loaded, versions = json.loads(done.stdout)
    assert loaded == [], f"provenance() imported {loaded}"
    assert "numpy" in versions  # read from metadata, not by importing


@pytest.mark.parametrize(
    "module", ["mha_rosetta", "mha_rosetta.report.build", "mha_rosetta.report.html", "mha_rosetta.cli.report"]
)
def test_report_modules_import_no_framework(module):
    code = f"import sys, {module}\nprint(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"importing {module} imported {done.stdout.strip()}"


# -- every JSON the tool writes carries it ------------------------------------------------------


def test_check_json_has_provenance_beside_created_and_versions(tmp_path):
    from mha_rosetta.cli.main import main

    target = tmp_path / "check.json"
    argv = ["check", "--backends", "numpy", "--cases", "self_attention", "--dtypes", "float64", "--quiet"]
    assert main([*argv, "--json", str(target)]) == 0
    data = json.loads(target.read_text())
    assert {"created", "versions"} <= set(data)  # the old fields keep working
    assert data["provenance"]["command"] == sys.argv  # the process's own command line
    assert data["provenance"]["libraries"]["numpy"] == data["versions"]["numpy"]


def test_bench_report_has_provenance_beside_machine():
    from mha_rosetta.benchmarks.report import assemble_report

    report = assemble_report({"preset": "test"}, [], [], machine={"cpu_model": "x"})
    assert report["machine"] == {"cpu_model": "x"}
    assert report["provenance"]["tool"] == "mha-rosetta" and "cpu_model" in report["provenance"]


def test_the_decode_bench_and_decode_check_json_have_provenance(tmp_path):
    from mha_rosetta.benchmarks.decode_sweep import assemble_decode_report, decode_settings
    from mha_rosetta.cli.main import main

    report = assemble_decode_report(decode_settings("decode-quick").as_dict(), [], [])
    assert report["kind"] == "decode" and report["provenance"]["tool"] == "mha-rosetta"
    assert report["provenance"]["command"] == sys.argv and "cpu_model" in report["provenance"]
    committed = json.loads((ROOT / "docs" / "bench" / "decode.json").read_text())
    assert committed["provenance"]["git"]["commit"] and committed["provenance"]["created_utc"]
    target = tmp_path / "decode-check.json"
    argv = ["check", "--decode", "--backends", "numpy", "--cases", "plain_mha", "--dtypes", "float64", "--quiet"]
    assert main([*argv, "--json", str(target)]) == 0
    data = json.loads(target.read_text())
    assert data["tool"] == "mha-rosetta check --decode" and data["provenance"]["command"] == sys.argv
    assert data["provenance"]["libraries"]["numpy"] == data["versions"]["numpy"]


def test_explain_json_has_provenance(tmp_path):
    from mha_rosetta.cli.main import main

    target = tmp_path / "explain.json"
    assert main(["explain", "--sections", "stages", "--json", str(target), "--plain", "--tokens", "4"]) == 0
    data = json.loads(target.read_text())
    assert data["schema"] == 1 and data["provenance"]["tool"] == "mha-rosetta"


@requires("torch")  # the docs' example candidate (docs/your-own-implementation.md) is written in torch
def test_diagnose_json_has_provenance():
    argv = ["diagnose", "examples.my_attention:fixed_candidate", "--d-model", "12", "--heads", "3", "--json", "-"]
    done = run_cli(*argv, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["agrees"] is True and data["provenance"]["tool"] == "mha-rosetta"


def test_the_git_state_is_the_one_the_command_started_with(monkeypatch):
    """A sweep writes its JSON at the end; a commit made while it ran is not the code that measured."""
    states = iter([{"commit": "a" * 40, "dirty": False, "branch": "main"}, {"commit": "b" * 40, "dirty": True}])
    monkeypatch.setattr(prov, "git_state", lambda root=None: next(states))
    monkeypatch.setattr(prov, "_START", {})
    prov.remember_start()
    record = prov.provenance()
    assert record["git"] == {"commit": "a" * 40, "dirty": False, "branch": "main"}
    assert record["started_utc"] <= record["created_utc"]
    monkeypatch.setattr(prov, "_START", {})  # no command started: the state now
    live = prov.provenance()
    assert live["git"]["commit"] == "b" * 40 and "started_utc" not in live


def test_each_cli_command_records_its_start(tmp_path):
    from mha_rosetta.cli.main import main

    path = tmp_path / "claims.json"
    assert main(["explain", "--claims", "--json", str(path)]) in (0, 1)
    assert json.loads(path.read_text())["provenance"]["started_utc"]
    assert prov._START == {} and "started_utc" not in prov.provenance()  # forgotten when the command ends
