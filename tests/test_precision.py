"""Float32 precision on GPUs, checked on a CPU: TF32 labels, switches restored, the GEMM peak's logic.

Nothing here needs a GPU. JAX programs are lowered and their ``precision = [...]`` read;
torch's TF32 switches are read and written through both of its APIs in fresh processes
(the switches are process-wide); the GPU peak's timing loop runs against a fake clock.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends import REGISTRY, available_backends, get_backend
from mha_rosetta.backends.jax.common import LOWERED_PRECISION, MATMUL_PRECISIONS, allows_tf32
from mha_rosetta.benchmarks import gemm
from mha_rosetta.benchmarks.timing import RepeatPolicy
from mha_rosetta.core import MHAConfig, init_params

# -- JAX: what each precision name lowers to ------------------------------------------------------


@requires("jax")
@pytest.mark.parametrize("name", MATMUL_PRECISIONS)
def test_each_jax_precision_name_lowers_to_the_precision_the_table_says(name):
    import jax
    import jax.numpy as jnp

    a = jnp.ones((3, 5), jnp.float32)
    b = jnp.ones((5, 2), jnp.float32)
    with jax.default_matmul_precision(name):
        text = jax.jit(jnp.matmul).lower(a, b).as_text()
    found = re.findall(r"precision = \[(\w+), (\w+)\]", text)
    assert found == [(LOWERED_PRECISION[name], LOWERED_PRECISION[name])], text


def test_only_full_float32_names_keep_tf32_off():
    assert {name for name in MATMUL_PRECISIONS if not allows_tf32(name)} == {"highest", "float32"}
    # the old labels were wrong for these two: "high" is "tensorfloat32", "bfloat16" is "default"
    assert allows_tf32("high") and allows_tf32("bfloat16")
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        allows_tf32("medium")


@requires("jax")
@pytest.mark.parametrize("name", MATMUL_PRECISIONS)
def test_jax_precision_info_labels_tf32_by_the_lowered_program(name):
    from mha_rosetta.backends.jax.common import precision_info

    info = precision_info(device="gpu", dtype="float32", matmul_precision=name)
    assert info["lowered_precision"] == LOWERED_PRECISION[name]
    assert info["tf32"] is (LOWERED_PRECISION[name] != "HIGHEST")
    assert "tf32" not in precision_info(device="cpu", dtype="float32", matmul_precision=name)  # TF32 is a GPU matter


@requires("jax")
def test_tf32_switch_from_the_environment_reaches_jax_programs(monkeypatch):
    from mha_rosetta.backends.jax.common import CompiledForward, effective_precision, precision_info

    monkeypatch.setenv("MHA_ROSETTA_TF32", "1")
    assert effective_precision("highest") == "tensorfloat32"
    assert effective_precision("default") == "default"  # already reduced: left as asked
    info = precision_info(device="gpu", dtype="float32", matmul_precision="highest")
    assert info["tf32"] is True and info["tf32_forced_by"] == "MHA_ROSETTA_TF32=1"
    import jax.numpy as jnp

    compiled = CompiledForward(jnp.matmul, (jnp.ones((2, 2), jnp.float32),) * 2, "highest")
    assert compiled.matmul_precision == "tensorfloat32"
    monkeypatch.setenv("MHA_ROSETTA_TF32", "0")
    assert effective_precision("highest") == "highest"


# -- torch: TF32 switches, both APIs --------------------------------------------------------------

# Each scenario runs in a fresh interpreter: it sets torch's process-wide switches, enters
# matmul_precision(True) and (False), and prints what it saw inside and after.
_SCENARIO = r"""
import json, sys, torch
from mha_rosetta.backends.torch.common import matmul_precision, tf32_switches
setup = sys.argv[1]
if setup == "legacy-on":
    torch.backends.cuda.matmul.allow_tf32 = True
elif setup == "new-tf32":
    torch.backends.cuda.matmul.fp32_precision = "tf32"
elif setup == "new-ieee":
    torch.backends.cuda.matmul.fp32_precision = "ieee"
elif setup == "set-high":
    torch.set_float32_matmul_precision("high")
before = tf32_switches()
inside = {}
for allow in (True, False):
    with matmul_precision(allow):
        inside[str(allow)] = tf32_switches()
print(json.dumps({"before": before, "inside": inside, "after": tf32_switches()}))
"""


@requires("torch")
@pytest.mark.parametrize("setup", ["fresh", "legacy-on", "new-tf32", "new-ieee", "set-high"])
def test_matmul_precision_sets_and_restores_through_either_torch_api(setup):
    done = subprocess.run([sys.executable, "-c", _SCENARIO, setup], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after"] == seen["before"]  # restored, and still readable through the same API
    on, off = seen["inside"]["True"], seen["inside"]["False"]
    if seen["before"]["api"] == "allow_tf32":
        assert (on["matmul"], on["cudnn"], off["matmul"], off["cudnn"]) == (True, True, False, False)
    else:
        # torch >= 2.9 after the new API set TF32 on: the old getters raise, so the new strings are used
        assert setup == "new-tf32"
        assert (on["matmul"], on["cudnn"], off["matmul"], off["cudnn"]) == ("tf32", "tf32", "ieee", "ieee")


@requires("torch")
def test_torch_precision_info_states_the_switches_and_the_environment_override(monkeypatch):
    from mha_rosetta.backends.torch.common import precision_info

    assert precision_info(device="gpu", dtype="float32", allow_tf32=False)["tf32"] is False
    assert (
        precision_info(device="gpu", dtype="float16", allow_tf32=True)["tf32"] is False
    )  # TF32 is about float32 products only
    monkeypatch.setenv("MHA_ROSETTA_TF32", "1")
    forced = precision_info(device="gpu", dtype="float32", allow_tf32=False)
    assert forced["tf32"] is True and forced["tf32_forced_by"] == "MHA_ROSETTA_TF32=1"
    assert precision_info(device="cpu", dtype="float32", allow_tf32=False)["tf32"] is False


@pytest.fixture
def tf32_sentinel():
    """torch's switches set to a state no adapter asks for (both on), restored afterwards."""
    pytest.importorskip("torch")
    from mha_rosetta.backends.torch.common import set_tf32_switches, tf32_switches

    saved = tf32_switches()
    sentinel = {"api": "allow_tf32", "matmul": True, "cudnn": True}
    set_tf32_switches(sentinel)
    assert tf32_switches() == sentinel  # the sentinel really is in place (the tests compare against it)
    yield lambda: tf32_switches()
    set_tf32_switches(saved)
    assert tf32_switches() == saved  # restored for the tests after this one


@requires("einops")
@pytest.mark.parametrize("precision", MATMUL_PRECISIONS)
def test_einops_numerics_info_leaves_torch_switches_alone(tf32_sentinel, precision):
    from mha_rosetta.backends.einops.adapter import EinopsBackend

    backend = EinopsBackend("einops-torch-probe", array_library="torch", matmul_precision=precision)
    info = backend._numerics_info("float32", "gpu")  # the old code set the switches here, for good
    assert tf32_sentinel() == {"api": "allow_tf32", "matmul": True, "cudnn": True}
    assert info["tf32"] is allows_tf32(precision)  # "float32" is full float32, as JAX reads it


@pytest.mark.parametrize("name", list(REGISTRY))
def test_no_backend_run_changes_torch_tf32_switches(tf32_sentinel, name):
    if name not in available_backends():
        pytest.skip(f"{name}: its framework is not installed")
    cfg = MHAConfig(d_model=16, n_heads=4)  # 4 heads: the sharded backends split them too
    backend = get_backend(name)
    if backend.unsupported_reason(cfg, "float32", "cpu", "standard"):  # a real decoder layer (hf-attention)
        cfg = MHAConfig(d_model=16, n_heads=4, causal=True, rope="half")
    x = np.random.default_rng(0).standard_normal((2, 7, 16))
    backend.run(cfg, init_params(cfg, seed=0), x, dtype="float32")
    assert tf32_sentinel() == {"api": "allow_tf32", "matmul": True, "cudnn": True}


# -- the GEMM peak ---------------------------------------------------------------------------------


def test_gpu_gemm_sizes_fill_the_gpu_and_cpu_keeps_the_requested_size():
    assert [gemm.gemm_size(d, "gpu") for d in ("bfloat16", "float16", "float32", "float64")] == [8192, 8192, 4096, 4096]
    assert gemm.gemm_size("bfloat16", "cpu", 512) == 512
    with pytest.raises(ValueError, match="dtype must be one of"):
        gemm.gemm_size("int8", "gpu")


def test_gemm_peak_children_get_the_gpu_size(monkeypatch):
    specs = []

    def fake_run_fresh(module, spec, **options):
        specs.append(dict(spec))
        return {"status": "ok", "gflops": 1000.0, "n": spec["n"], "cpu_util": 1.0}

    monkeypatch.setattr(gemm, "run_fresh", fake_run_fresh)
    peak = gemm.measure_gemm_peak("bfloat16", "gpu", 1, None, n=1024, libraries=["torch", "jax"])
    assert [spec["n"] for spec in specs] == [8192, 8192]  # the CPU size asked for does not shrink it
    assert peak["n"] == 8192
    monkeypatch.setenv("MHA_ROSETTA_TF32", "1")
    assert gemm.measure_gemm_peak("float32", "gpu", 1, None, libraries=["torch"])["tf32"] is True
    monkeypatch.delenv("MHA_ROSETTA_TF32")
    record = gemm.measure_gemm_peak("float32", "gpu", 1, None, libraries=["torch"])
    assert (record["n"], record["tf32"]) == (4096, False)


class FakeGpu:
    """Launches cost 2 ms of (fake) time each, enqueued; a sync costs nothing; everything is counted."""

    def __init__(self) -> None:
        self.now = 0.0
        self.launches = 0
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def launch(self) -> None:
        self.launches += 1
        self.now += 0.002

    def sync(self) -> None:
        self.syncs += 1


def test_gpu_timing_is_back_to_back_products_under_one_sync():
    gpu = FakeGpu()
    policy = RepeatPolicy(min_time=0.5, min_repeats=5, max_time=2.0, warmup=3)
    result = gemm.time_back_to_back(gpu.launch, gpu.sync, policy, clock=gpu.clock, cpu_clock=gpu.clock)
    k = result["back_to_back"]
    assert k == 25  # 0.05 s per sample / 2 ms per product
    assert result["syncs"] == result["repeats"]  # one sync per sample of k products, none in between
    assert result["median_s"] == pytest.approx(0.002)  # per product, not per sample
    assert result["min_s"] == pytest.approx(0.002)
    # warm-up (3 single products with their syncs, more until 0.05 s) and 3 to choose k come first
    warm = gpu.launches - 3 - k * result["repeats"]
    assert warm >= policy.warmup


@requires("jax")
def test_jax_float64_gemm_peak_multiplies_float64():
    result = gemm.measure(
        {"library": "jax", "dtype": "float64", "n": 32, "policy": dict(min_time=0.0, min_repeats=1, warmup=0)}
    )
    assert result["status"] == "ok"
    assert result["versions"]["operand_dtype"] == "float64"  # without jax_enable_x64 this was float32


@pytest.mark.parametrize("library", ["numpy", "torch", "jax"])
def test_cpu_gemm_peak_states_the_dtype_it_multiplied(library):
    pytest.importorskip(library)
    result = gemm.measure(
        {"library": library, "dtype": "float32", "n": 32, "policy": dict(min_time=0.0, min_repeats=1, warmup=0)}
    )
    assert (result["status"], result["n"], result["back_to_back"]) == ("ok", 32, 1)
    assert result["versions"]["operand_dtype"] == "float32"


# -- the TF32 table and the GPU questions, on a CPU --------------------------------------------------


@pytest.mark.slow
def test_tf32_table_on_cpu_has_every_setting_and_float32_errors():
    from mha_rosetta.checks.precision import tf32_markdown, tf32_table

    rows = tf32_table("cpu", n=64, mha_size={"batch": 1, "tokens": 9, "d_model": 16, "heads": 2})
    expected = []
    try:
        import torch  # noqa: F401

        expected += [("torch", "allow_tf32=False"), ("torch", "allow_tf32=True")]
    except ImportError:
        pass
    try:
        import jax  # noqa: F401

        expected += [("jax", f"default_matmul_precision={name!r}") for name in MATMUL_PRECISIONS]
    except ImportError:
        pass
    if not expected:
        pytest.skip("neither torch nor jax is installed")
    assert [(row["library"], row["setting"]) for row in rows] == expected
    for row in rows:
        assert row["tf32_allowed"] is False  # a CPU has no TF32
        # float32 products of 64 terms of N(0,1) entries: rounding shows, TF32-sized errors (1e-2) do not
        assert 0 < row["gemm_max_abs"] < 1e-4, row
        assert 0 < row["mha_max_abs"] < 2e-5, row
    table = tf32_markdown(rows, n=64)
    assert table.count("\n") == len(rows) + 2
    assert "64^3 product max abs err" in table


@requires("torch")
def test_gpu_questions_answer_on_cpu_what_torch_does_with_empty_rows():
    from mha_rosetta.checks.precision import empty_row_answers, sdpa_float32_error

    answers = empty_row_answers("cpu")
    assert answers["F.scaled_dot_product_attention(attn_mask)"] in ("zeros", "NaN", "mean of values")
    assert answers["nn.MultiheadAttention(need_weights=True)"] in ("zeros", "NaN", "mean of values")
    errors = sdpa_float32_error("cpu", tokens=64, width=16)
    assert 0 < errors["sdpa_float32_max_abs"] < 1e-5 and 0 < errors["by_hand_float32_max_abs"] < 1e-5


@requires("jax")
def test_the_jax_backward_records_the_precision_of_its_own_device_and_dtype(monkeypatch):
    # The backward once called precision_info(dtype, device, ...): on a GPU in float32 its info lost
    # the "tf32" entry. The arguments are keyword-only now; this pins what the backward passes.
    from mha_rosetta.backends.jax import adapter as jax_backend

    seen = []
    real = jax_backend.precision_info
    monkeypatch.setattr(jax_backend, "precision_info", lambda **kw: seen.append(kw) or real(**kw))
    cfg = MHAConfig(d_model=8, n_heads=2)
    query = np.random.default_rng(0).standard_normal((1, 3, 8))
    get_backend("jax").prepare_vjp(cfg, init_params(cfg, seed=0), query, dtype="float32")
    assert [(kw["device"], kw["dtype"]) for kw in seen] == [("cpu", "float32")]
