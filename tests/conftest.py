"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from mha_rosetta.backends._probe import import_failure, importable
from mha_rosetta.checks.worker import fast_compile_enabled, xla_flags
from mha_rosetta.core import MHAConfig, init_params

# The suite compiles hundreds of small JAX programs, each run once: with the check's fast XLA:CPU settings
# (`checks.worker.FAST_COMPILE_FLAGS`) tests/test_jax_variants.py and tests/test_backend_jax.py took 23.0 s
# instead of 37.9 s here. Set before anything imports JAX; MHA_ROSETTA_FAST_COMPILE=0 (the gpu env,
# scripts/gpu-run) keeps XLA's defaults, and flags of the caller's own XLA_FLAGS still win.
if fast_compile_enabled() and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = xla_flags(True)

# Distinct sizes everywhere, so that no two axes can be swapped without a shape error:
# batch 2, q tokens 7, kv tokens 5, d_model 15, 3 heads of d_k 5 (d_v 4 where it may differ).
BATCH, Q_TOKENS, KV_TOKENS, D_MODEL, HEADS, D_K = 2, 7, 5, 15, 3, 5


def python_stdout(code: str, timeout: int = 300) -> str:
    """What a fresh interpreter prints running ``code`` (stripped); fails the test, with its stderr, if it exits
    non-zero."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """The module ``examples/<name>.py``, imported as ``examples.<name>`` whatever the working directory.

    ``python -m pytest`` puts the working directory on ``sys.path`` and plain ``pytest`` (tox, CI) does not, so
    ``from examples import ...`` passed here and failed in CI's ``all`` env (2026-12-05).
    """
    if not (EXAMPLES / f"{name}.py").is_file():
        raise FileNotFoundError(f"load_example: name must name a file in {EXAMPLES}, got {name!r}")
    sys.path.insert(0, str(EXAMPLES.parent))
    try:
        return importlib.import_module(f"examples.{name}")
    finally:
        sys.path.remove(str(EXAMPLES.parent))


def load_script(name: str):
    """The Python script ``scripts/<name>`` (no .py suffix), loaded as a module named after it."""
    import importlib.machinery

    path = EXAMPLES.parent / "scripts" / name
    if not path.is_file():
        raise FileNotFoundError(f"load_script: name must name a file in {path.parent}, got {name!r}")
    module_name = name.replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(module_name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader))
    loader.exec_module(module)
    return module


def run_cli(*argv: str, cwd, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``mha-rosetta *argv`` in a fresh interpreter run from ``cwd`` (one BLAS thread, ``timeout`` s at most);
    ``env``: variables set on top of this process's (KERAS_BACKEND, PYTHONPATH)."""
    return subprocess.run(
        [sys.executable, "-m", "mha_rosetta.cli.main", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def refusal_reason(name: str, cfg: MHAConfig) -> str | None:
    """Why backend ``name`` will not run ``cfg``'s variants (None: it runs them); a skip where the library is missing.

    For the forms no adapter applies yet (the gate, MLA: `Variant.implemented_by == ()`), each must refuse by name.
    """
    from mha_rosetta.backends import get_backend

    try:
        backend = get_backend(name)
    except Exception as error:  # a library missing here: the refusal is its own, not ours to prove
        pytest.skip(f"{name}: {error}")
    return backend.variant_reason(cfg, "standard")


def skip_unless_installed(*modules: str) -> None:
    """Skip the calling test module (called at import) or test unless every library of ``modules`` imports here: the
    reason names the first that does not, with its install command (`models.real_modules.libraries_missing`)."""
    from mha_rosetta.models.real_modules import libraries_missing

    reason = libraries_missing(modules)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def agreeing_comparison(a, b, steps: int = 7):
    """`diagnose.compare(a, b, decode=True)` of two honest ports, checked and returned: no field differs, the outputs
    agree within float32's tolerance (the level such ports declare) but not bit for bit, and so do all ``steps``
    decode steps."""
    from mha_rosetta.diagnose.compare import compare

    result = compare(a, b, decode=True)
    assert result.differences == []
    assert result.agrees and result.dtype == "float32" and 0 < result.max_error < 2e-5
    assert len(result.decode_steps) == steps and result.first_decode_step is None
    return result


def requires(module: str):
    """Skip (with the reason) when an optional framework is not installed or fails to import."""
    return pytest.mark.skipif(not importable(module), reason=str(import_failure(module)))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def cfg():
    return MHAConfig(d_model=D_MODEL, n_heads=HEADS)


@pytest.fixture
def params(cfg):
    return init_params(cfg, seed=0)


# -- --require-gpu: on a GPU machine, a GPU test that skips for want of a GPU is a failure -----------

# Every skip for a missing GPU says so with this prefix (use `gpu_skipif` / `skip_without_gpu`),
# so that --require-gpu can tell it from a legitimate skip of a GPU test (a dtype a library
# does not offer, NumPy which never runs on a GPU).
NO_GPU = "no GPU:"


def gpu_skipif(condition: bool, reason: str):
    """``pytest.mark.skipif`` for a missing GPU; --require-gpu turns it into a failure."""
    return pytest.mark.skipif(condition, reason=f"{NO_GPU} {reason}")


def skip_without_gpu(reason: str):
    """``pytest.skip`` for a missing GPU; --require-gpu turns it into a failure."""
    __tracebackhide__ = True  # report the skip at the test that called this
    pytest.skip(f"{NO_GPU} {reason}")


def pytest_addoption(parser):
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="on a GPU machine (`pytest -m gpu --require-gpu`): a test marked gpu that skips for want of a GPU "
        "fails, and the run fails unless some test marked gpu passed",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.get_closest_marker("gpu") is None or not item.config.getoption("require_gpu"):
        return
    if report.passed and report.when == "call":
        item.config.stash[_GPU_PASSED] = item.config.stash.get(_GPU_PASSED, 0) + 1
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if NO_GPU in reason:
            report.outcome = "failed"
            report.longrepr = f"--require-gpu: this GPU test skipped instead of running: {reason}"


_GPU_PASSED = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if config.getoption("require_gpu") and exitstatus == 0 and not config.stash.get(_GPU_PASSED, 0):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\n--require-gpu: no test marked gpu passed", file=sys.stderr)


# -- helpers the suites share (issue 42: one copy each; keep new ones in this block) ----------------------------


def installed_backend(name: str):
    """``get_backend(name)``, or a skip naming the missing library and its install command.

    get_backend raises BackendNotInstalled for a backend whose framework is not installed (tox's numpy and einops
    envs): the skip is its reason, not a failure of ours.
    """
    from mha_rosetta.backends import get_backend, missing_backends

    missing = missing_backends()
    if name in missing:
        pytest.skip(missing[name])
    return get_backend(name)


def hf_attention(package: str, config_class: str, attention_class: str, **config):
    """Hugging Face's attention of ``package`` (layer 0, eager, float64, seeded weights) from a tiny config."""
    import torch
    import transformers

    torch.manual_seed(0)
    built = getattr(transformers, config_class)(num_hidden_layers=1, **config)
    built._attn_implementation = "eager"
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    return getattr(modeling, attention_class)(built, layer_idx=0).double().eval()


def normal(shape, seed: int = 0) -> np.ndarray:
    """Standard normal draws of ``shape`` from ``default_rng(seed)``: the inputs of the hand-checked cases."""
    return np.random.default_rng(seed).standard_normal(shape)


@contextmanager
def library_absent(monkeypatch, library: str):
    """Pretend ``library`` is not installed: the backends' probe asks ``importlib.util.find_spec`` first, so patch that
    and forget the probe's cached answers (before and after)."""
    from mha_rosetta.backends._probe import probe

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == library else real_find_spec(name, *a)
    )
    probe.cache_clear()
    try:
        yield
    finally:
        probe.cache_clear()
