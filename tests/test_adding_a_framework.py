"""Adding a backend for a new array library: the files it takes, proved end to end.

A throwaway array library (`boxed`: a class holding an ndarray), its framework-layer
module (one `Framework` subclass and one `register_framework` line), an adapter, and the
one registration line (an entry point of the group ``mha_rosetta.backends``) are written to a
temporary directory. Nothing in the project is edited. The CLIs run in subprocesses with
that directory on ``PYTHONPATH`` and show the new backend in ``check`` (agreeing with the
oracle), ``bench --list`` and its plan, and ``explain`` (whose stage table reads the new
arrays' strides and contiguity through the framework layer). docs/adding-a-backend.md cites
this test for the number of files a new framework touches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LIBRARY = '''
"""boxed: an array library of one class, holding a NumPy array it never exposes as its own type."""
import numpy as np


class BoxedArray:
    def __init__(self, data):
        self.data = np.asarray(data)

    @property
    def shape(self):
        return self.data.shape
'''

FRAMEWORK = '''
"""boxed in the framework layer: what the project needs to know about its arrays."""
from mha_rosetta.backends.frameworks import Framework, register_framework


class BoxedFramework(Framework):
    name = "boxed"
    modules = ("boxed",)

    def to_numpy(self, value):
        return value.data.copy()

    def strides(self, value):
        return tuple(stride // value.data.itemsize for stride in value.data.strides)

    def contiguity(self, value):
        return "C" if value.data.flags.c_contiguous else "F" if value.data.flags.f_contiguous else "no"


register_framework(BoxedFramework())
'''

ADAPTER = '''
"""The reference MHA computed on NumPy and handed back as boxed arrays, its stages in boxed arrays too."""
import boxed_framework  # noqa: F401  (registers the framework layer's answers for BoxedArray)
import numpy as np
from boxed import BoxedArray

from mha_rosetta.backends import Backend, Prepared, StageTensor
from mha_rosetta.core import reference_mha, reference_stages


class BoxedBackend(Backend):
    name = "boxed"
    convention = "the reference MHA, results in boxed arrays"
    requires = ("boxed",)
    dtypes = ("float64", "float32")
    causal_on_positions = True  # it runs the reference, whose causality is on positions (Backend rule 7)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        args = (inputs.query, inputs.key, inputs.value, inputs.mask)
        batch = inputs.query.shape[0]
        rotary = {  # MHAInputs holds them as (1|B, N); the oracle takes (N,) or (B, N)
            name: None if p is None else np.broadcast_to(p, (batch, p.shape[-1]))
            for name, p in (("positions", inputs.positions), ("kv_positions", inputs.kv_positions))
        }

        def forward():
            return BoxedArray(reference_mha(cfg, params, *args, **rotary).astype(dtype))

        def native_stages():
            stages = reference_stages(cfg, params, *args, **rotary)
            return {"output": StageTensor(BoxedArray(stages["output"].astype(dtype)), ("B", "Nq", "D"))}

        return Prepared(forward=forward, to_numpy=lambda result: result.data.astype("float64"),
                        native_stages=native_stages)
'''

# The one registration line: an entry point, as a pip-installed plugin declares it.
ENTRY_POINTS = "[mha_rosetta.backends]\nboxed = boxed_backend:BoxedBackend\n"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("boxed_plugin")
    for name, text in (("boxed", LIBRARY), ("boxed_framework", FRAMEWORK), ("boxed_backend", ADAPTER)):
        (where / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    meta = where / "boxed_plugin-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: boxed-plugin\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(ENTRY_POINTS)
    return where


def _cli(plugin_dir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")])))
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    code = "import sys; from mha_rosetta.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_the_plugin_adds_exactly_three_files_and_one_registration_line(plugin_dir):
    files = sorted(path.name for path in plugin_dir.glob("*.py"))
    assert files == ["boxed.py", "boxed_backend.py", "boxed_framework.py"]
    assert (plugin_dir / "boxed_plugin-0.1.dist-info" / "entry_points.txt").read_text().count(" = ") == 1


def test_check_runs_the_new_backend_against_the_oracle_and_it_agrees(plugin_dir, tmp_path):
    out = tmp_path / "check.json"
    done = _cli(plugin_dir, "check", "--backends", "boxed", "--json", str(out), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = [run for run in json.loads(out.read_text())["runs"] if run["backend"] == "boxed"]
    agreed = {run["case"] for run in runs if run["status"] == "agree"}
    assert {"self_attention", "cross_attention", "gqa", "causal", "padding"} <= agreed
    # the only runs that do not agree are the dtypes the adapter declares it lacks, and the variants it does not implement
    others = [run["reason"] for run in runs if run["status"] != "agree"]
    variants = [reason for reason in others if "does not implement" in reason]
    assert variants and {reason.split()[-1] for reason in others if reason not in variants} <= {"float16", "bfloat16"}


def test_bench_lists_and_plans_the_new_backend(plugin_dir):
    listed = _cli(plugin_dir, "bench", "--list")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "boxed" in listed.stdout.split()
    planned = _cli(plugin_dir, "bench", "--implementations", "boxed", "--list")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "boxed" in planned.stdout.split() and "numpy" not in planned.stdout.split()


def test_explain_reads_the_new_arrays_through_the_framework_layer(plugin_dir):
    # --plain: the same table whether or not rich is installed (the bare-NumPy tox env has no rich)
    done = _cli(plugin_dir, "explain", "--backends", "numpy,boxed", "--plain")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("boxed ")]
    # The output stage (B, Nq, D) = (2, 6, 12), C-contiguous: strides (72, 12, 1) in elements,
    # read from the boxed array by BoxedFramework, not typed in.
    assert any(" ".join(row).startswith("boxed (2, 6, 12) B x Nq x D (72, 12, 1) C") for row in rows), rows
