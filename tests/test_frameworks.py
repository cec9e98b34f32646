"""The framework layer, asked directly with real arrays of each library.

Every answer is checked against a value worked out by hand or read from the library's own
API: round trips to NumPy (bfloat16 included, exact), strides/contiguity/sharing of a
transposed view, thread knobs read back, precision facts, GPU probes, the GEMM program.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import python_stdout, requires
from mha_rosetta.backends import frameworks as layer
from mha_rosetta.backends.frameworks import FRAMEWORKS, Framework, get_framework

# (2, 3) float64 with distinct, exactly representable entries; its transpose is a (3, 2) view.
VALUES = np.arange(6, dtype=np.float64).reshape(2, 3) / 4


def test_registry_is_keyed_by_library_name_in_preference_order():
    assert list(FRAMEWORKS) == ["numpy", "torch", "jax", "onnxruntime", "mlx"]
    assert all(framework.name == name for name, framework in FRAMEWORKS.items())
    assert [name for name, f in FRAMEWORKS.items() if f.drives_gpu] == ["torch", "jax", "mlx"]
    assert get_framework("numpy").namespace() is np
    with pytest.raises(ValueError, match="framework must be one of numpy, torch, jax, onnxruntime, mlx; got 'cupy'"):
        get_framework("cupy")


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_each_namespace_is_the_module_its_array_module_names(name):
    """`Framework.namespace` imports `array_module`: the same module object the library's own import gives."""
    framework = get_framework(name)
    module = pytest.importorskip(framework.array_module, reason=f"{framework.array_module} is not installed")
    assert framework.namespace() is module


def test_a_framework_without_an_array_module_says_so():
    class Bare(Framework):
        name = "bare"

    with pytest.raises(NotImplementedError, match="bare names no array module"):
        Bare().namespace()


def test_importing_the_layer_and_asking_about_numpy_imports_no_framework():
    code = (
        "import sys, numpy as np; from mha_rosetta.backends import frameworks as f; "
        "a = np.ones((2, 3)); f.to_numpy(a); f.strides_in_elements(a.T); f.contiguity(a); f.shares_memory(a, a.T); "
        "print(sorted(m for m in ('torch', 'jax', 'einops', 'mlx') if m in sys.modules))"
    )
    assert python_stdout(code, timeout=120) == "[]"


def test_numpy_strides_contiguity_and_sharing_of_a_transposed_view():
    a = VALUES.copy()
    assert layer.array_library(a) == "numpy"
    assert layer.strides_in_elements(a) == (3, 1) and layer.strides_in_elements(a.T) == (1, 3)
    assert layer.contiguity(a) == "C" and layer.contiguity(a.T) == "F" and layer.contiguity(a[:, ::2]) == "no"
    assert layer.shares_memory(a, a.T) is True and layer.shares_memory(a, a.copy()) is False
    snap = layer.snapshot(a.T)
    assert snap.strides == a.T.strides and not np.shares_memory(snap, a)  # order kept, memory fresh


def test_numpy_gemm_is_refused_without_blas_and_off_the_cpu():
    numpy = get_framework("numpy")
    assert numpy.gemm_unsupported("float16", "cpu") == "NumPy has no BLAS product for float16"
    assert numpy.gemm_unsupported("float32", "gpu") == "NumPy runs on the CPU only"
    launch, sync, facts = numpy.gemm_program(4, "float32", "cpu")
    launch()
    sync()
    assert facts == {"numpy": np.__version__, "operand_dtype": "float32"}


@requires("torch")
def test_torch_round_trip_including_bfloat16_and_view_facts():
    import torch

    assert get_framework("torch").namespace() is torch
    t = torch.tensor(VALUES)
    assert layer.array_library(t) == "torch"
    np.testing.assert_array_equal(layer.to_numpy(t), VALUES)
    # 0.25, 0.5, ... are exact in bfloat16: the round trip through bfloat16 -> float32 is exact.
    back = layer.to_numpy(t.to(torch.bfloat16))
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, VALUES.astype(np.float32))
    assert layer.strides_in_elements(t.T) == (1, 3)
    assert layer.contiguity(t) == "C" and layer.contiguity(t.T) == "F" and layer.contiguity(t[:, ::2]) == "no"
    assert layer.shares_memory(t, t.T) is True and layer.shares_memory(t, t.clone()) is False
    assert layer.snapshot(t.T).stride() == (1, 3)
    assert layer.shares_memory(t, VALUES) is None  # two libraries: no answer


@requires("torch")
def test_torch_threads_are_read_back_and_precision_facts_say_ieee_on_cpu():
    import torch

    torch_framework = get_framework("torch")
    before = torch.get_num_threads()
    try:
        applied = torch_framework.configure_threads(1)
        assert applied["torch_threads"] == 1 == torch.get_num_threads()
        assert "torch_interop_threads" in applied or "torch_interop_error" in applied
    finally:
        torch.set_num_threads(before)
    from mha_rosetta.backends.frameworks.torch import precision_info, tf32_state

    assert precision_info(device="cpu", dtype="float32", allow_tf32=True) == {
        "tf32": False,
        "matmul_precision": "ieee (CPU: TF32 does not apply)",
    }
    assert tf32_state(True, "fp32_precision") == {"api": "fp32_precision", "matmul": "tf32", "cudnn": "tf32"}
    seen, reason = torch_framework.gpu_probe()
    assert seen == torch.cuda.is_available()
    assert seen or "torch.cuda.is_available() is False" in reason


@requires("jax")
def test_jax_round_trip_including_bfloat16_and_xla_managed_layout():
    import jax.numpy as jnp

    j = jnp.asarray(VALUES, dtype=jnp.float32)
    assert layer.array_library(j) == "jax"
    np.testing.assert_array_equal(layer.to_numpy(j), VALUES.astype(np.float32))
    back = layer.to_numpy(j.astype(jnp.bfloat16))
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, VALUES.astype(np.float32))
    assert layer.strides_in_elements(j.T) is None
    assert layer.contiguity(j.T) == layer.XLA_MANAGED == layer.unknown_layout(j)
    assert layer.shares_memory(j, j.T) is None
    assert layer.provenance_unknown(j) == "n/a (immutable; XLA places buffers)"
    assert layer.provenance_unknown(VALUES) is None


@requires("jax")
def test_jax_precision_facts_and_gemm_program():
    from mha_rosetta.backends.frameworks.jax import LOWERED_PRECISION, allows_tf32, check_matmul_precision

    assert [name for name in LOWERED_PRECISION if not allows_tf32(name)] == ["highest", "float32"]
    with pytest.raises(ValueError, match="matmul_precision must be one of highest, "):
        check_matmul_precision("fast")
    launch, sync, facts = get_framework("jax").gemm_program(4, "float32", "cpu")
    launch()
    sync()
    assert facts["operand_dtype"] == "float32" and facts["matmul_precision"] in ("highest", "tensorfloat32")


class _Boxed:
    """An array type of no registered library that follows no protocol."""

    def __init__(self, array):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        return self.array


def test_unknown_types_fall_back_to_numpy_protocol_or_say_why_not():
    boxed = _Boxed(VALUES)
    assert layer.framework_of(boxed) is None
    assert layer.array_library(boxed) == type(boxed).__module__.split(".")[0]  # named by its module
    np.testing.assert_array_equal(layer.to_numpy(boxed), VALUES)
    assert layer.strides_in_elements(boxed) is None and layer.contiguity(boxed) == layer.UNKNOWN_LAYOUT


def test_register_framework_checks_its_argument():
    with pytest.raises(TypeError, match="framework must be a Framework instance; got str"):
        layer.register_framework("numpy")
    with pytest.raises(ValueError, match="framework name must be new and non-empty; got 'numpy'"):
        layer.register_framework(type("Again", (Framework,), {"name": "numpy"})())


def test_startup_estimates_cover_every_framework_and_helper_library():
    assert layer.startup_s("torch") == 2.5 and layer.startup_s("jax") == 1.5 and layer.startup_s("numpy") == 0.5
    assert layer.startup_s("flax") == 2.0 and layer.startup_s("unheard-of") == 0.5


def test_the_copy_bandwidth_asks_the_layer_which_libraries_copy_and_why_not():
    assert layer.copy_libraries() == ["numpy", "torch"]  # JAX offers no copy program
    numpy, jax = get_framework("numpy"), get_framework("jax")
    assert (numpy.copy_dtype, numpy.copy_unsupported("cpu")) == ("float64", None)
    assert numpy.copy_unsupported("gpu") == "NumPy has no GPU: the device copy is PyTorch's"
    assert jax.copy_unsupported("cpu") == "jax offers no copy program" and jax.copy_program(1024, "cpu") is None
    launch, sync, facts = numpy.copy_program(8 * 1000 + 5, "cpu")  # whole elements only: 1000 float64
    source, destination = facts["arrays"]
    assert (facts["elements"], facts["itemsize"], facts["dtype"]) == (1000, 8, "float64")
    assert destination.sum() == 0.0
    launch()
    sync()
    assert np.array_equal(destination, np.arange(1000.0)) and destination is not source


@requires("torch")
def test_torch_copy_program_and_kernel_arrays():
    import torch

    torch_layer = get_framework("torch")
    launch, sync, facts = torch_layer.copy_program(4 * 257, "cpu")
    launch()
    sync()
    assert (facts["elements"], facts["dtype"]) == (257, "float32")
    assert torch.equal(facts["arrays"][1], torch.arange(257, dtype=torch.float32))
    module, wait, make = torch_layer.kernel_arrays("cpu", "float32")
    first = make(2, 3)
    # One generator seeded 0, drawn in order: the draws a benchmark kernel always had.
    expected = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    assert module is torch and wait(first) is first and torch.equal(first, expected)
    assert not torch.equal(make(2, 3), expected)  # the next draw
    with pytest.raises(NotImplementedError, match="numpy has no benchmark kernels"):
        get_framework("numpy").kernel_arrays("cpu", "float32")
