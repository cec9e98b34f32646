"""Everything a first GPU run depends on, proved on a CPU with fakes.

- ``check --devices gpu`` fails, naming the framework, when an installed framework sees no GPU;
- ``pytest --require-gpu`` turns a skipped GPU test into a failure;
- the explainer's JAX demonstrations ask for the CPU at "highest" precision;
- tox's gpu environment cannot be taken off the GPU by JAX_PLATFORMS or a pip constraint;
- ``scripts/gpu-run --dry-run`` lists its steps within 8 minutes of limits, and its
  path-based import works when the editable install does not.
"""

from __future__ import annotations

import configparser
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_check import FakeBackend, cases_in

from conftest import requires
from mha_rosetta.checks import devices as check_devices
from mha_rosetta.checks import run_check
from mha_rosetta.checks.report import format_seconds, summary_lines
from mha_rosetta.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-run"


class GpuFake(FakeBackend):
    """A fake adapter of one framework that runs on "gpu" as well (the fake ignores the device)."""

    def __init__(self, name, framework):
        super().__init__(name)
        self.requires = (framework,)

    def devices(self):
        return ("cpu", "gpu")


def _probes(**seen):
    return {
        name: (lambda ok=ok, name=name: (ok, "" if ok else f"{name} sees no GPU (fake)")) for name, ok in seen.items()
    }


@pytest.mark.parametrize(("torch_sees", "jax_sees"), [(True, False), (False, True), (True, True)])
def test_gpu_check_fails_naming_each_framework_that_misses_the_gpu(monkeypatch, torch_sees, jax_sees):
    monkeypatch.setattr(check_devices, "GPU_PROBES", _probes(torch=torch_sees, jax=jax_sees))
    backends = [GpuFake("fake-torch", "torch"), GpuFake("fake-jax", "jax")]
    result = run_check(backends=backends, devices="gpu", cases=cases_in(["float32"], "self_attention"))
    missing = [name for name, seen in (("jax", jax_sees), ("torch", torch_sees)) if not seen]
    assert sorted(result.frameworks_without_gpu) == missing
    # the runs that did happen on the "gpu" agree: only the missing framework fails the check
    assert all(run.compared for run in result.runs)
    if missing:
        assert result.exit_status == 2
        assert all(name in result.verdict() for name in missing)
        assert "see(s) no GPU" in summary_lines(result)[-1]
    else:
        assert result.exit_status == 0


@pytest.mark.parametrize("devices", [None, "cpu", "all"])
def test_only_a_named_gpu_asks_frameworks_for_one(monkeypatch, devices):
    monkeypatch.setattr(check_devices, "GPU_PROBES", _probes(torch=False, jax=False))
    backends = [GpuFake("fake-torch", "torch")]
    result = run_check(backends=backends, devices=devices, cases=cases_in(["float32"], "self_attention"))
    assert result.frameworks_without_gpu == {} and result.exit_status == 0


@requires("jax")
@requires("torch")
def test_real_probes_name_the_framework_and_the_fix(monkeypatch):
    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.frameworks import jax as _jax_common  # the layer owns the device lists
    from mha_rosetta.backends.frameworks import torch as _torch_common

    monkeypatch.setattr(_torch_common, "torch_devices", lambda: ("cpu", "gpu"))  # torch sees CUDA
    monkeypatch.setattr(_jax_common, "jax_devices", lambda: ("cpu",))  # plain CPU jax
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    problems = check_devices.frameworks_without_gpu([get_backend("torch"), get_backend("jax-dpa")])
    assert list(problems) == ["jax"]
    assert "JAX_PLATFORMS='cpu'" in problems["jax"] and "jax[cuda13]" in problems["jax"]
    monkeypatch.setattr(_torch_common, "torch_devices", lambda: ("cpu",))
    monkeypatch.setattr(_jax_common, "jax_devices", lambda: ("cpu", "gpu"))
    problems = check_devices.frameworks_without_gpu([get_backend("einops-torch"), get_backend("numpy")])
    assert list(problems) == ["torch"] and "torch.cuda.is_available() is False" in problems["torch"]


@requires("torch")
def test_cli_check_on_gpu_exits_2_on_a_machine_where_torch_sees_no_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    status = main(["check", "--devices", "gpu", "--backends", "numpy,torch", "--cases", "self_attention", "--plain"])
    out = capsys.readouterr().out
    assert status == 2
    assert "frameworks that see no GPU" in out and "torch" in out


def test_summary_time_has_three_significant_digits():
    assert [format_seconds(s) for s in (0.0465, 0.5, 3.07, 73.33, 1234.5)] == [
        "0.0465 s", "0.500 s", "3.07 s", "73.3 s", "1234 s",
    ]  # fmt: skip
    result = run_check(backends=[FakeBackend("fake-a")], cases=cases_in(["float32"], "self_attention"))
    assert result.seconds > 0
    assert " in 0.0 s" not in summary_lines(result)[0]


# -- pytest --require-gpu ---------------------------------------------------------------------------


_SAMPLE_TESTS = """
import pytest
from conftest import gpu_skipif, skip_without_gpu

@pytest.mark.gpu
@gpu_skipif(True, "no CUDA device (decorator)")
def test_gpu_skipped_by_mark():
    pass

@pytest.mark.gpu
def test_gpu_skipped_inside():
    skip_without_gpu("JAX sees no GPU (inside the test)")

@pytest.mark.gpu
def test_gpu_legitimate_skip():
    pytest.skip("this library offers no float64")

@pytest.mark.gpu
def test_gpu_that_runs():
    pass

def test_cpu_skip():
    pytest.skip("not about GPUs")
"""


def _run_pytest(folder: Path, tests: str, *options):
    (folder / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (folder / "test_sample.py").write_text(tests)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(folder), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=folder)


def test_require_gpu_turns_missing_gpu_skips_into_failures(tmp_path):
    plain = _run_pytest(tmp_path, _SAMPLE_TESTS)
    assert plain.returncode == 0 and "1 passed, 4 skipped" in plain.stdout, plain.stdout
    strict = _run_pytest(tmp_path, _SAMPLE_TESTS, "--require-gpu")
    assert strict.returncode == 1, strict.stdout
    # the decorator skip happens at setup (an error), the inner one in the call (a failure);
    # the legitimate skip of a GPU test and the CPU test's skip stay skips
    assert "1 failed, 1 passed, 2 skipped, 1 error" in strict.stdout, strict.stdout
    assert "--require-gpu: this GPU test skipped instead of running: Skipped: no GPU: JAX sees no GPU" in strict.stdout
    assert "no GPU: no CUDA device (decorator)" in strict.stdout


def test_require_gpu_fails_a_run_in_which_no_gpu_test_passed(tmp_path):
    only_legitimate_skips = (
        "import pytest\n\n@pytest.mark.gpu\ndef test_gpu_legitimate_skip():\n    pytest.skip('no float64 here')\n"
    )
    assert _run_pytest(tmp_path, only_legitimate_skips).returncode == 0
    strict = _run_pytest(tmp_path, only_legitimate_skips, "--require-gpu")
    assert strict.returncode == 1 and "--require-gpu: no test marked gpu passed" in strict.stderr


# -- the explainer's JAX demonstrations ---------------------------------------------------------------


@requires("jax")
def test_explainer_jax_demonstrations_run_on_cpu_at_highest_precision(monkeypatch):
    import jax

    from mha_rosetta.explain.differences import ON_THE_DEVICE, run_differences

    calls = []
    real = jax.nn.dot_product_attention

    def recording(*args, **kwargs):
        calls.append((jax.config.jax_default_matmul_precision, jax.config.jax_default_device))
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    before = jax.config.jax_default_matmul_precision
    differences = run_differences(keys=["mask_polarity", "fully_masked_row", "scale_placement"])
    assert calls, "no demonstration called jax.nn.dot_product_attention"
    assert all(precision == "highest" for precision, _ in calls)
    assert all(device.platform == "cpu" for _, device in calls)
    assert jax.config.jax_default_matmul_precision == before  # restored afterwards
    assert ON_THE_DEVICE == ("tf32_default",)  # the one demonstration about the device's own precision
    row = dict(differences[1].rows)["jax.nn.dot_product_attention"]
    assert row.startswith("uniform average"), row


# -- tox's gpu environment ---------------------------------------------------------------------------


def _tox_section(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser[f"testenv:{name}"]


def test_tox_gpu_env_cannot_be_taken_off_the_gpu():
    gpu = _tox_section("gpu")
    passed = gpu["pass_env"].split()
    assert "JAX_PLATFORMS" not in passed and not any(name.startswith("PIP_") for name in passed)
    set_env = [line.strip() for line in gpu["set_env"].splitlines()]
    assert "JAX_PLATFORMS =" in set_env  # emptied: JAX picks its GPU
    assert "PIP_CONSTRAINT =" in set_env  # tox passes PIP_* to pip regardless: CI's CPU pin must not apply
    assert "jax[cuda13]" in gpu["deps"]
    assert "--require-gpu" in gpu["commands"] and "check --devices gpu" in gpu["commands"]


def test_every_install_env_runs_the_main_job_before_any_test_tool():
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    base = parser["testenv"]
    assert base["extras"].strip() == ""  # the bare install
    base_commands = base["commands"].split("\n")
    assert [c for c in base_commands if c][:2] == ["mha-rosetta check --quiet", "mha-rosetta explain"]
    for extra in ("torch", "jax", "einops", "flax", "equinox"):
        assert parser[f"testenv:{extra}"]["extras"].strip() == extra
    assert parser["testenv:bench-only"]["extras"].strip() == "bench"
    assert "bench --preset quick" in parser["testenv:bench-only"]["commands"]
    env_list = parser["tox"]["env_list"].replace(",", " ").split()
    assert {"numpy", "torch", "jax", "einops", "flax", "equinox", "bench-only"} <= set(env_list)


# -- scripts/gpu-run ---------------------------------------------------------------------------------


def _script_module():
    loader = importlib.machinery.SourceFileLoader("gpu_run", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_run", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_run"] = module  # dataclasses look their module up while the class is made
    try:
        loader.exec_module(module)
    finally:
        del sys.modules["gpu_run"]
    return module


def test_gpu_run_dry_run_lists_the_steps_within_eight_minutes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    names = [line.split()[0] for line in lines[:-1]]
    assert names == ["install", "versions", "check", "tests", "precision", "bench", "bench-tf32"]
    module = _script_module()
    total = module.INSTALL_TIMEOUT_S + sum(step.timeout_s for step in module.STEPS)
    assert total <= 480 and f"limits {total} s in all" in lines[-1]
    # at most 8 files: the log plus what the steps write
    written = {"log.txt"}
    for step in module.STEPS:
        written |= {part.rsplit("/", 1)[1] for part in step.command if "{out}/" in part}
        if step.output:
            written.add(step.output)
    assert len(written) <= 8, written
    skipped = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--skip", "bench,bench-tf32"], capture_output=True, text=True
    )
    assert "bench" not in skipped.stdout.split("precision")[1]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--skip", "benchmark"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown step" in bad.stderr


def test_gpu_run_path_import_works_without_any_install(tmp_path):
    module = _script_module()
    shim = module.link_packages(ROOT, tmp_path / "shim")
    assert (shim / "mha_rosetta" / "core").resolve() == (ROOT / "core").resolve()
    # mha_rosetta is a real folder of links to package/'s files: nothing is written into the checkout
    assert (shim / "mha_rosetta" / "__init__.py").resolve() == (ROOT / "package" / "__init__.py").resolve()
    assert not (shim / "mha_rosetta").is_symlink()
    assert sorted(p.name for p in (ROOT / "package").iterdir() if p.is_symlink()) == []
    numpy_site = str(Path(np.__file__).resolve().parent.parent)
    # -S: no site module, so no .pth and no editable-install finder: only the links can supply mha_rosetta
    probe = (
        f"import sys; sys.path[:0] = [{str(shim)!r}, {numpy_site!r}]; "
        "import os, mha_rosetta.core, mha_rosetta.cli.main; print(os.path.realpath(mha_rosetta.core.__file__))"
    )
    done = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == (ROOT / "core" / "__init__.py").resolve()


def test_gpu_run_falls_back_when_the_editable_install_fails():
    module = _script_module()
    logged = []
    env = dict(os.environ)
    failing_pip = [sys.executable, "-c", "import sys; sys.exit('setuptools too old for license = \"MIT\"')"]
    mode = module.make_importable(logged.append, env, install_command=failing_pip)
    assert mode == "path"
    assert any("setuptools too old" in entry for entry in logged)
    assert "mha-rosetta-import-" in env["PYTHONPATH"].split(os.pathsep)[0]
    assert module.imports_from_checkout(env)


@requires("torch")
@pytest.mark.parametrize("nodes", [(), ("/dev/nvidiactl",), ("/dev/nvidia0",), ("/dev/nvidiactl", "/dev/nvidia0")])
def test_the_speed_questions_find_a_gpu_as_the_sweep_does(monkeypatch, nodes):
    # The questions once looked for /dev/nvidiactl only, the sweep for either node: a machine with
    # only /dev/nvidia0 got GPU cells in the sweep and no GPU speed questions.
    from mha_rosetta.benchmarks import questions, sweep

    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p in nodes if str(p).startswith("/dev/nvidia") else real(p))
    assert sweep.default_devices() == (["cpu", "gpu"] if nodes else ["cpu"])
    assert questions.question_targets() == [("numpy", "cpu"), ("torch", "cpu"), *([("torch", "gpu")] if nodes else [])]


@requires("torch")
@pytest.mark.parametrize("name", ["torch", "torch-mha", "torch-sdpa", "torch-flex"])
def test_every_torch_backend_refuses_a_gpu_torch_cannot_see_with_torchs_reason(monkeypatch, name):
    """`backends.torch.common.TorchDevices`: a torch backend's devices are torch's; a GPU torch does not see is
    refused with torch's own reason, and with one there, `Backend`'s rules still follow."""
    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.torch import common as torch_common
    from mha_rosetta.core import MHAConfig

    backend, cfg = get_backend(name), MHAConfig(d_model=16, n_heads=4)
    monkeypatch.setattr(torch_common, "torch_devices", lambda: ("cpu",))
    assert backend.devices() == ("cpu",)
    assert backend.unsupported_reason(cfg, "float32", "gpu", "standard") == (
        f"{name}: torch sees no CUDA device on this machine (torch.cuda.is_available() is False)"
    )
    assert backend.unsupported_reason(cfg, "float32", "cpu", "standard") is None
    monkeypatch.setattr(torch_common, "torch_devices", lambda: ("cpu", "gpu"))
    assert backend.devices() == ("cpu", "gpu")
    assert backend.unsupported_reason(cfg, "float32", "gpu", "standard") is None
    assert backend.unsupported_reason(cfg, "float32", "gpu", "no_such").startswith(f"{name} has no strategy 'no_such'")


@requires("torch")
def test_a_torch_backends_own_rule_comes_before_the_missing_gpu(monkeypatch):
    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.torch import common as torch_common
    from mha_rosetta.core import MHAConfig

    monkeypatch.setattr(torch_common, "torch_devices", lambda: ("cpu",))
    rope = MHAConfig(d_model=16, n_heads=4, rope="half")
    reason = get_backend("torch-mha").unsupported_reason(rope, "float32", "gpu", "standard")
    assert reason.startswith("nn.MultiheadAttention has no rotary embedding (cfg.rope='half')")
