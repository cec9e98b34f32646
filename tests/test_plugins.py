"""Backends from outside the project: a class, a module path, an entry point, `check --backend`.

A tiny package is written to a temporary folder with a dist-info that carries an
``entry_points.txt``, put on ``PYTHONPATH`` of a fresh interpreter, and driven through the
real command line: nothing in this project is edited to make it work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import requires
from mha_rosetta import backends
from mha_rosetta.backends import REGISTRY, Backend, BackendEntry, get_backend, registry
from mha_rosetta.backends.entries import module_name, registered_entry
from mha_rosetta.backends.registry import load_class, parse_target
from mha_rosetta.checks import SPEC_CASES, Status, run_check

PLUGIN_SOURCE = '''
"""A user's adapter: the spec oracle, float64 only, plus one that answers empty rows with NaN."""
import numpy as np

from mha_rosetta.backends import Backend, Prepared, StageTensor
from mha_rosetta.core import STAGE_BY_NAME, reference_stages


class MyBackend(Backend):
    name = "my-attention"
    convention = "the user's own attention (the oracle, re-run)"
    dtypes = ("float64",)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        positions = np.broadcast_to(inputs.positions, (inputs.batch, inputs.q_tokens))  # (B, Nq) from (1|B, Nq)
        kv_positions = np.broadcast_to(inputs.kv_positions, (inputs.batch, inputs.kv_tokens))  # (B, Nk)
        args = (inputs.query, inputs.key, inputs.value, inputs.mask, positions, kv_positions)
        stages = reference_stages(cfg, params, *args)
        native = {name: StageTensor(value, STAGE_BY_NAME[name].shape) for name, value in stages.items()}
        return Prepared(forward=lambda: stages["output"], to_numpy=np.asarray, native_stages=lambda: native)


class MyNaNOracle(MyBackend):
    name = "my-nan-oracle"
    kind = "oracle"
    known_differences = ("a row with nothing to attend to gives NaN",)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        prepared = super()._prepare(cfg, params, inputs, dtype, device, strategy)
        output = prepared.forward().copy()
        if inputs.mask is not None:
            allowed = np.broadcast_to(inputs.mask, (inputs.batch, cfg.n_heads, inputs.q_tokens, inputs.kv_tokens))
            output[(~allowed.any(axis=-1)).any(axis=1)] = np.nan
        return Prepared(forward=lambda: output, to_numpy=np.asarray, native_stages=lambda: {})
'''


def _make_plugin(root, entry_points=True):
    """Write the package and (optionally) a dist-info whose entry points name both classes."""
    package = root / "myattn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "impl.py").write_text(PLUGIN_SOURCE)
    if not entry_points:
        return root
    dist = root / "myattn-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myattn\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[mha_rosetta.backends]\nmine-ep = myattn.impl:MyBackend\nmine-nan = myattn.impl:MyNaNOracle\n"
    )
    return root


def _cli(root, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "mha_rosetta.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_check_backend_runs_a_class_from_a_package_outside_the_project(tmp_path):
    root = _make_plugin(tmp_path, entry_points=False)
    done = _cli(root, "check", "--backend", "myattn.impl:MyBackend", "--json", "-", "--plain")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    runs = [run for run in report["runs"] if run["implementation"] == "my-attention"]
    # The adapter has float64 only, yet it is given every spec case (the fallback dtype).
    # It declares no variant (Backend.variants), so it agrees on every 2017-23 case and runs no variant case;
    # nor does it say that its causal mask is on positions (Backend.causal_on_positions), so it does not run
    # the cases whose positions make causality other than top-left on indices (bottom-right; restarting per
    # packed document).
    assert {run["case"] for run in runs if run["status"] == "agree"} == {
        n for n, c in SPEC_CASES.items() if not c.cfg.variants and n not in ("causal_cache", "packed")
    }
    bottom_right = [run for run in runs if run["case"] == "causal_cache"]
    assert bottom_right and all(run["status"] == "unsupported" for run in bottom_right)
    assert "top-left causal rule on indices" in bottom_right[0]["reason"]
    assert {run["dtype"] for run in runs if run["status"] == "agree"} == {"float64"}
    # With the entry point installed too, --backend finds the class already registered under its name.
    _make_plugin(tmp_path / "with_ep")
    again = _cli(tmp_path / "with_ep", "check", "--backend", "myattn.impl:MyBackend", "--json", "-")
    assert again.returncode == 0, again.stderr
    assert {run["implementation"] for run in json.loads(again.stdout)["runs"]} == {"mine-ep"}


def test_check_grad_includes_the_backend_given_by_path(tmp_path):
    """--backend MODULE:CLASS reaches the gradient check too: a class without a backward pass is listed as
    unsupported there, with the reason, instead of being left out."""
    root = _make_plugin(tmp_path, entry_points=False)
    case = next(iter(SPEC_CASES))
    args = ("check", "--backend", "myattn.impl:MyBackend", "--backends", "numpy", "--cases", case, "--grad")
    done = _cli(root, *args, "--json", "-")
    assert done.returncode == 0, done.stderr
    grad_runs = json.loads(done.stdout)["grad"]["runs"]
    runs = [run for run in grad_runs if run["implementation"] == "my-attention"]
    assert runs and all(run["status"] == "unsupported" for run in runs)
    assert "has no backward pass" in runs[0]["reason"]
    assert any(run["backend"] == "numpy" and run["status"] == "agree" for run in grad_runs)
    # Alone, it leaves the gradient check nothing to compare: that is exit status 2, said as such.
    alone = _cli(root, "check", "--backend", "myattn.impl:MyBackend", "--cases", case, "--grad", "--plain")
    assert alone.returncode == 2 and "gradients: nothing was checked (exit status 2)" in alone.stdout


def test_entry_points_are_discovered_without_importing_the_plugin(tmp_path):
    root = _make_plugin(tmp_path)
    probe = (
        "import sys; from mha_rosetta.backends import REGISTRY; "
        "print(REGISTRY['mine-ep'].module, REGISTRY['mine-ep'].cls, REGISTRY['mine-nan'].kind, "
        "'myattn.impl' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["myattn.impl", "MyBackend", "None", "False"]
    # Through the CLI: the entry-point oracle is an oracle (its class says so), so its NaN
    # for rows with nothing to attend to is its named known difference, not a failure.
    done = _cli(root, "check", "--backends", "mine-ep,mine-nan", "--cases", "fully_masked_row,gqa", "--json", "-")
    assert done.returncode == 0, done.stderr
    runs = {(r["implementation"], r["case"]): r for r in json.loads(done.stdout)["runs"]}
    assert runs[("mine-nan", "fully_masked_row")]["status"] == "known difference"
    assert runs[("mine-nan", "fully_masked_row")]["kind"] == "oracle"
    assert runs[("mine-ep", "gqa")]["status"] == "agree"


def test_a_bad_backend_path_is_a_clear_error(tmp_path):
    root = _make_plugin(tmp_path, entry_points=False)
    cases = {
        "myattn.nowhere:MyBackend": "cannot import myattn.nowhere:MyBackend",
        "myattn.impl:Missing": "module 'myattn.impl' has no attribute 'Missing'",
        "myattn.impl:np": "is not a subclass of mha_rosetta.backends.Backend",
        "myattn.impl.MyBackend": "expected an import path 'package.module:ClassName'",
    }
    for path, message in cases.items():
        done = _cli(root, "check", "--backend", path)
        assert done.returncode == 2, (path, done.stdout)
        assert "--backend" in done.stderr and message in done.stderr, done.stderr


class Unregistered(Backend):
    pass


def test_an_instance_knows_its_kind_from_construction():
    pytest.importorskip("torch", reason="torch is not installed")
    from mha_rosetta.backends.oracles.torch import TorchMHAOracle, TorchSDPAOracle

    assert (TorchMHAOracle().kind, TorchMHAOracle().requires) == ("oracle", ("torch",))
    assert TorchSDPAOracle(name="x").kind == "oracle"
    assert Unregistered().kind == "implementation"  # registered nowhere: its class attributes


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry dict restored in place after the test, and no cached instances: never leak into other tests."""
    saved = dict(REGISTRY)
    monkeypatch.setattr(registry, "_INSTANCES", {})
    yield
    REGISTRY.clear()
    REGISTRY.update(saved)


def test_register_takes_a_class_a_path_and_a_fully_qualified_entry(scratch_registry):

    class Oracle(Backend):
        kind = "oracle"
        requires = ("numpy",)

    backends.register("by-class", Oracle)
    assert backends.REGISTRY["by-class"].kind == "oracle"
    assert backends.REGISTRY["by-class"].requires == ("numpy",)
    backends.register("by-path", "mha_rosetta.backends.numpy.adapter:NumpyBackend")
    assert backends.REGISTRY["by-path"].kind is None  # not imported yet
    backends.register("by-entry", BackendEntry("mha_rosetta.backends.numpy.adapter", "NumpyBackend"))
    loaded = backends.get_backend("by-path")
    assert loaded.name == "by-path" and loaded.kind == "implementation"
    assert backends.get_backend("by-entry").strategies == get_backend("numpy").strategies
    with pytest.raises(TypeError, match="must be a BackendEntry, a Backend subclass"):
        backends.register("bad", 42)
    with pytest.raises(ValueError, match="already registered"):
        backends.register("by-class", Oracle)


def test_module_names_are_relative_only_with_a_leading_dot():
    assert module_name(".numpy.adapter") == "mha_rosetta.backends.numpy.adapter"
    assert module_name("numpy") == "numpy"  # no leading dot: an absolute module path
    assert module_name("mypkg.attention") == "mypkg.attention"
    assert parse_target("a.b:C") == ("a.b", "C")
    assert load_class(REGISTRY["numpy"]).__name__ == "NumpyBackend"
    assert registered_entry(load_class(REGISTRY["numpy"]), "numpy") is REGISTRY["numpy"]


def test_a_user_registered_oracle_gets_its_known_difference(scratch_registry):
    """The same oracle that NaNs empty rows: an oracle by its class, so the NaN is named, not failed."""
    from test_check import FakeBackend

    class NaNOracle(FakeBackend):
        kind = "oracle"

    backends.register("nan-oracle", NaNOracle)
    oracle = NaNOracle("nan-oracle", kind="oracle", empty_rows="nan")
    oracle.strategies = ("standard",)
    result = run_check(backends=[oracle], cases=[replace(SPEC_CASES["fully_masked_row"], dtypes=("float64",))])
    assert [run.status for run in result.runs] == [Status.KNOWN_DIFFERENCE]


@requires("torch")
def test_the_readme_example_backends_pass_and_fail_as_the_readme_says():
    root = Path(__file__).resolve().parents[1]
    good = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_rosetta.cli.main",
            "check",
            "--backend",
            "examples.my_backend:MyBackend",
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert good.returncode == 0, good.stderr
    statuses = [run["status"] for run in json.loads(good.stdout)["runs"]]
    runs = json.loads(good.stdout)["runs"]
    # The example implements no variant of core.VARIANTS: those cases are unsupported with that reason.
    variant_runs = [run for run in runs if SPEC_CASES[run["case"]].cfg.variants]
    assert variant_runs and all("does not implement" in run["reason"] for run in variant_runs)
    assert all(run["status"] == "unsupported" for run in variant_runs)
    statuses = [run["status"] for run in runs if not SPEC_CASES[run["case"]].cfg.variants]
    # 24: the packed case (float64 and float32) is refused too: its causality is not top-left on indices.
    assert statuses.count("agree") == 6 and statuses.count("unsupported") == 24
    bad = subprocess.run(
        [sys.executable, "-m", "mha_rosetta.cli.main", "check", "--backend", "examples.my_backend:MyBuggyBackend"],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert bad.returncode == 1
    assert "against the oracle: unsupported 71, DISAGREE 6" in bad.stdout  # 47 of the 71: variant cases
