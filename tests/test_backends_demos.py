"""`mha_rosetta.backends.demos`: the library calls the explainer shows, and how a missing library is reported.

The demonstrations themselves are tested through the explainer (tests/test_explain.py, test_claims.py); here,
the contract explain relies on: a library that does not import raises `LibraryMissing` with the probe's
reason before anything runs, `run_installed` keeps the installed libraries' rows in order, and no module of
the explainer imports a framework or an adapter's module (the AST walk below, function-local imports included).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import mha_rosetta.core.probe as probe
from conftest import requires
from mha_rosetta.backends import BackendNotInstalled, installed
from mha_rosetta.backends.demos import LibraryMissing, head_projections, needs, output_from_context, run_installed
from mha_rosetta.core import MHAConfig, init_params, reference_mha

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "equinox", "keras", "einops", "transformers")


def test_a_missing_library_raises_library_missing_with_the_probes_reason_and_runs_nothing():
    ran = []

    @needs("numpy", "no_such_library_for_mha_rosetta")
    def demonstration():
        ran.append(True)

    with pytest.raises(LibraryMissing) as caught:
        demonstration()
    assert ran == []
    assert caught.value.library == "no_such_library_for_mha_rosetta"
    assert caught.value.reason == "no_such_library_for_mha_rosetta is not installed"
    assert isinstance(caught.value, BackendNotInstalled)  # callers that catch a missing backend catch this too
    assert demonstration.libraries == ("numpy", "no_such_library_for_mha_rosetta")


def test_run_installed_keeps_the_rows_of_installed_libraries_in_order(monkeypatch):
    monkeypatch.setitem(probe._ANSWERS, "pretend_absent", probe.Probe("pretend_absent", installed=False))

    @needs("numpy")
    def first(value):
        return [("first", value)]

    @needs("pretend_absent")
    def absent(value):
        raise AssertionError("a demonstration whose library is absent must not run")

    @needs("numpy")
    def last(value):
        return [("last", value), ("last again", value + 1)]

    assert run_installed((first, absent, last), 1) == [("first", 1), ("last", 1), ("last again", 2)]
    assert installed("numpy") and not installed("pretend_absent")


def test_head_projections_and_the_output_projection_rebuild_the_oracle():
    """The NumPy halves every library call shares: projections split to (B, N, H, d), and back through w_o."""
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=5)
    params = init_params(cfg, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 7, 15))
    q, k, v = head_projections(cfg, params, x)
    assert q.shape == k.shape == v.shape == (2, 7, 3, 5)
    scores = np.einsum("bnhd,bmhd->bhnm", q, k) * cfg.scale  # (B, H, N, N)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = np.einsum("bhnm,bmhd->bnhd", weights, v)  # (B, N, H, Dv)
    assert np.max(np.abs(output_from_context(params, context) - reference_mha(cfg, params, x))) < 1e-12


@requires("torch")
def test_the_torch_mha_call_takes_the_blocked_polarity():
    from mha_rosetta.backends.demos import torch_mha_call

    cfg = MHAConfig(d_model=12, n_heads=3)
    params = init_params(cfg, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 6, 12))
    allowed = np.tril(np.ones((6, 6), dtype=bool))
    output, weights = torch_mha_call(cfg, params, x, ~allowed, need_weights=True)
    assert np.max(np.abs(output - reference_mha(cfg, params, x, mask=allowed))) < 1e-12
    assert weights.shape == (2, 3, 6, 6) and np.all(weights[:, :, 0, 1:] == 0)  # query 0 sees key 0 only


@pytest.mark.parametrize("package", ["explain"])
def test_no_module_of_the_package_imports_a_framework_or_an_adapters_module(package):
    """Function-local imports count: the package asks `backends` (get_backend, installed, demos, frameworks)."""
    public = {"mha_rosetta.backends", "mha_rosetta.backends.demos", "mha_rosetta.backends.frameworks"}
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                framework = name.split(".")[0] in FRAMEWORKS
                adapter = name.startswith("mha_rosetta.backends") and name not in public
                if framework or adapter:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert found == [], "\n".join(found)


def test_the_onnx_probe_says_which_runtime_is_missing_and_why(monkeypatch):
    """Without onnx the explainer's ONNX section is skipped with core.probe's reason (a tox env without [onnx]
    printed "LibraryMissing.__init__() missing 1 required positional argument" here before)."""
    from mha_rosetta.backends import demos
    from mha_rosetta.backends.onnx import probe

    monkeypatch.setattr(probe, "import_failure", lambda module: f"{module} is not installed (test)")
    with pytest.raises(demos.LibraryMissing) as missing:
        demos.onnx_findings("onnxruntime")
    assert (missing.value.library, missing.value.reason) == ("onnx", "onnx is not installed (test)")
