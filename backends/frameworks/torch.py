"""PyTorch in the framework layer: tensors, CUDA, TF32, threads and the GEMM product.

Torch is imported inside each method: importing this module imports nothing heavy.

TF32. On NVIDIA GPUs since Ampere, float32 matrix products may run on tensor cores in
TF32 (10-bit mantissa): about 1e-3 relative error instead of float32's 1e-7. Whether
torch does so is a process-wide switch, ``torch.backends.cuda.matmul.allow_tf32`` (and
``torch.backends.cudnn.allow_tf32`` for cuDNN). A comparison must not depend on whatever
another library set, so a GPU run sets both switches explicitly for the duration of each
forward pass (`backends.torch.common.matmul_precision`) and restores them afterwards. The default is TF32
off; an adapter built with ``allow_tf32=True`` turns it on, which is how a test or the
check shows what TF32 does to the error. On the CPU the switches have no effect.

Two APIs hold these switches since torch 2.9: the old booleans and the new
``fp32_precision`` strings ("ieee", "tf32", "none" = inherit). Once the new one has set
TF32 on, reading the old getters raises ``RuntimeError`` ("mix of the legacy and new
APIs"). `tf32_switches` therefore reads through the old API where torch allows it and
through the new one otherwise, and `matmul_precision` writes and restores through the same
API it read, so a program that uses either API finds its own state unchanged afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from collections.abc import Callable

from .._tf32 import forced_note, tf32_forced
from .interface import CopyProgram, Framework, GemmProgram, env_note


def torch_devices() -> tuple[str, ...]:
    """("cpu",) plus "gpu" when torch sees a CUDA device."""
    import torch

    return ("cpu", "gpu") if torch.cuda.is_available() else ("cpu",)


def synchronizer(device: str) -> Callable[[object], None]:
    """Waits for queued GPU work (the result is computed when it returns)."""
    if device != "gpu":
        return lambda result: None
    import torch

    return lambda result: torch.cuda.synchronize()


def tf32_switches() -> dict:
    """torch's TF32 switches now: ``{"api", "matmul", "cudnn"}``, read through an API that torch lets us read.

    ``api`` is "allow_tf32" (the values are booleans) or "fp32_precision" (the values are
    the strings of torch >= 2.9's new API, used when the old getters refuse to answer).
    """
    import torch

    try:
        return {
            "api": "allow_tf32",
            "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn": bool(torch.backends.cudnn.allow_tf32),
        }
    except RuntimeError:  # torch >= 2.9 after the new API turned TF32 on: the old getters raise
        return {
            "api": "fp32_precision",
            "matmul": torch.backends.cuda.matmul.fp32_precision,
            "cudnn": torch.backends.cudnn.fp32_precision,
        }


def set_tf32_switches(state: dict) -> None:
    """Write a `tf32_switches` state back, through the API it names."""
    import torch

    if state["api"] == "allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = state["matmul"]
        torch.backends.cudnn.allow_tf32 = state["cudnn"]
    else:
        torch.backends.cuda.matmul.fp32_precision = state["matmul"]
        torch.backends.cudnn.fp32_precision = state["cudnn"]


def tf32_state(allow_tf32: bool, api: str) -> dict:
    """The switches that turn TF32 on or off for both cuBLAS and cuDNN, in ``api``'s terms."""
    if api == "allow_tf32":
        return {"api": api, "matmul": allow_tf32, "cudnn": allow_tf32}
    value = "tf32" if allow_tf32 else "ieee"
    return {"api": api, "matmul": value, "cudnn": value}


def precision_info(*, device: str, dtype: str, allow_tf32: bool) -> dict:
    """What `Prepared.info` records about float32 matmul precision."""
    if device != "gpu":
        return {"tf32": False, "matmul_precision": "ieee (CPU: TF32 does not apply)"}
    allow_tf32 = allow_tf32 or tf32_forced()
    used = allow_tf32 and dtype == "float32"
    return {
        "tf32": used,
        "matmul_precision": "tf32" if used else "ieee",
        "tf32_switches": f"cuBLAS and cuDNN TF32 {'on' if allow_tf32 else 'off'} during forward, restored after",
        **forced_note(),
    }


class TorchFramework(Framework):
    name = "torch"
    modules = ("torch",)
    drives_gpu = True
    startup_s = 2.5
    copy_dtype = "float32"
    array_module = "torch"

    def to_numpy(self, value) -> np.ndarray:
        value = value.detach()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()  # exact: every bfloat16 is a float32
        return value.cpu().numpy()

    def snapshot(self, value):
        return value.detach().clone()  # clone() preserves the strides of dense tensors

    def shares_memory(self, a, b) -> bool | None:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def strides(self, value) -> tuple[int, ...]:
        return tuple(value.stride())

    def contiguity(self, value) -> str:
        if value.is_contiguous():
            return "C"
        # A tensor whose reversed dims are contiguous is column-major (F order).
        return "F" if value.dim() > 1 and value.permute(*reversed(range(value.dim()))).is_contiguous() else "no"

    def synchronize(self, value) -> None:
        if getattr(value, "is_cuda", False):
            import torch

            torch.cuda.synchronize()

    def gpu_probe(self) -> tuple[bool, str]:
        import torch

        if "gpu" in torch_devices():
            return True, ""
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return False, (
            f"torch {torch.__version__} ({build}) sees no CUDA device: torch.cuda.is_available() is False"
            f"{env_note('CUDA_VISIBLE_DEVICES')}; install a CUDA build of torch"
        )

    def reset_peak_memory(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_mb(self) -> float | None:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None

    def configure_threads(self, threads: int) -> dict:
        import torch

        applied: dict = {}
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError as error:  # already started: keep going, but say so
            applied["torch_interop_error"] = str(error)
        applied["torch_threads"] = torch.get_num_threads()
        applied["torch_interop_threads"] = torch.get_num_interop_threads()
        return applied

    def gemm_unsupported(self, dtype: str, device: str) -> str | None:
        return None

    def gemm_program(self, n: int, dtype: str, device: str) -> GemmProgram:
        import torch

        target = "cuda" if device == "gpu" else "cpu"
        facts: dict = {"torch": torch.__version__}
        if target == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            # The cells compare float32 with TF32 off (unless MHA_ROSETTA_TF32=1): the peak must be the
            # same arithmetic. A fresh child process: the switches are set once, for its whole life.
            allow = tf32_forced()
            set_tf32_switches(tf32_state(allow, tf32_switches()["api"]))
            facts.update(
                gpu=torch.cuda.get_device_name(0), tf32=allow and dtype == "float32", tf32_switches=tf32_switches()
            )
        else:
            # torch's own BLAS is linked in and invisible to threadpoolctl: record what it says it has.
            facts.update(mkl=torch.backends.mkl.is_available(), mkldnn=torch.backends.mkldnn.is_available())
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=generator, dtype=torch.float64).to(device=target, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, generator=generator, dtype=torch.float64).to(device=target, dtype=getattr(torch, dtype))
        out = torch.empty_like(a)
        facts["operand_dtype"] = str(a.dtype).removeprefix("torch.")

        def launch() -> None:
            torch.matmul(a, b, out=out)

        sync = torch.cuda.synchronize if target == "cuda" else (lambda: None)
        return launch, sync, facts

    def copy_program(self, array_bytes: int, device: str) -> CopyProgram:
        import torch

        target = "cuda" if device == "gpu" else "cpu"
        elements = max(1, array_bytes // 4)
        src = torch.arange(elements, dtype=torch.float32, device=target)  # exact up to 2**24, enough to check
        dst = torch.zeros_like(src)

        def launch() -> None:
            dst.copy_(src)

        sync = torch.cuda.synchronize if target == "cuda" else (lambda: None)
        facts = {"library": "torch", "version": torch.__version__, "dtype": "float32", "itemsize": 4}
        return launch, sync, {**facts, "elements": elements, "arrays": (src, dst)}

    def kernel_arrays(self, device: str, dtype: str):
        import torch

        target = "cuda" if device == "gpu" else "cpu"
        if target == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            set_tf32_switches(tf32_state(False, tf32_switches()["api"]))  # float32 products in float32
        generator = torch.Generator().manual_seed(0)

        def sync(result):
            if target == "cuda":
                torch.cuda.synchronize()
            return result

        def make(*shape):
            return torch.randn(*shape, generator=generator).to(device=target, dtype=getattr(torch, dtype))

        return torch, sync, make
