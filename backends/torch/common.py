"""Torch plumbing shared by the torch adapter and the torch oracles.

Torch is imported inside each function: importing this module imports nothing heavy.

TF32: the switches, their two APIs and `precision_info` live in the framework layer
(`mha_rosetta.backends.frameworks.torch`); `matmul_precision` below sets them around a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, rotary_tables

from .._inputs import convert_inputs
from .._recording import record_stages
from .._tf32 import tf32_forced

# Re-exported: the torch adapters and oracles import these from here (the conversions are torch's ops object's).
from ..frameworks.ops_torch import bool_tensor, optional_tensor, to_tensor, torch_device, torch_dtype  # noqa: F401
from ..frameworks.torch import (  # noqa: F401
    precision_info,
    set_tf32_switches,
    synchronizer,
    tf32_state,
    tf32_switches,
    torch_devices,
)
from ..prepared import Prepared, PreparedDecode, tensor_to_numpy


def torch_inputs(inputs, dtype: str, device: str, layout: Callable = lambda x: x) -> tuple:
    """(x_q, x_k, x_v) as tensors, ``layout`` applied to each; self-attention stays one tensor.

    torch's fast paths check that identity (query is key is value), as a caller's code has it.
    """
    return convert_inputs(inputs, lambda array: layout(to_tensor(array, dtype, device)))


@contextmanager
def matmul_precision(allow_tf32: bool):
    """Set torch's TF32 switches for the block, then restore what was there (through the API it was read with)."""
    saved = tf32_switches()
    set_tf32_switches(tf32_state(bool(allow_tf32), saved["api"]))
    try:
        yield
    finally:
        set_tf32_switches(saved)


def with_matmul_precision(run: Callable, device: str, allow_tf32: bool) -> Callable:
    """``run`` wrapped so that TF32 is set explicitly while it runs (GPU only; `_tf32` can force it on)."""
    if device != "gpu":
        return run
    allow_tf32 = allow_tf32 or tf32_forced()

    def wrapped(*args, **kwargs):
        with matmul_precision(allow_tf32):
            return run(*args, **kwargs)

    return wrapped


def in_inference_mode(run: Callable) -> Callable:
    """``run`` under ``torch.inference_mode``: no tensor here requires grad, and it skips version counting."""
    import torch

    def wrapped(*args, **kwargs):
        with torch.inference_mode():
            return run(*args, **kwargs)

    return wrapped


def inference_run(run: Callable, device: str, allow_tf32: bool) -> Callable:
    """``run`` as every torch pass here runs: TF32 set explicitly (`with_matmul_precision`) under
    ``torch.inference_mode`` (`in_inference_mode`)."""
    return in_inference_mode(with_matmul_precision(run, device, allow_tf32))


def param_tensors(params: MHAParams, dtype: str, device: str) -> dict:
    """The parameters as tensors by name, None where absent (no bias): the ``p`` a torch pass reads."""
    return {name: optional_tensor(array, dtype, device) for name, array in params.as_dict().items()}


def recorded_prepared(run: Callable, device: str, info: dict, **extra) -> Prepared:
    """The `Prepared` of a recording pass ``run(rec)``: ``run(None)`` timed, ``run`` with a recorder for the stages,
    synchronized for ``device``; ``extra``: `Prepared`'s other fields (``compile``, ``stage_cuts``)."""
    return Prepared(
        lambda: run(None),
        tensor_to_numpy,
        lambda: record_stages(run),
        synchronize=synchronizer(device),
        info=info,
        **extra,
    )


def decode_prepared(run: Callable, device: str, info: dict, step_stages: Callable | None = None) -> PreparedDecode:
    """The `PreparedDecode` of a run ``run()`` that returns each chunk's output (B, s, D): them concatenated on the
    tokens (B, N, D), synchronized for ``device``."""

    def to_numpy(outputs):
        import torch

        return tensor_to_numpy(torch.cat(outputs, dim=1))  # (B, N, D) in token order

    return PreparedDecode(run, to_numpy, step_stages, synchronize=synchronizer(device), info=info)


def no_gpu_reason(backend_name: str, device: str, devices: tuple[str, ...]) -> str | None:
    if device not in devices:
        return f"{backend_name}: torch sees no CUDA device on this machine (torch.cuda.is_available() is False)"
    return None


class TorchDevices:
    """A mixin for a `Backend` that runs on torch: its devices are torch's, and a missing GPU is named as torch's.

    Put it before `Backend` in the bases; a subclass's own `unsupported_reason` checks its own rules first and
    then calls ``super()``, which reaches this one (the GPU) and then `Backend`'s (strategy, dtype, ...).
    """

    def devices(self) -> tuple[str, ...]:
        return torch_devices()

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        # has_device: the CPU is always there, so planning a CPU run does not import torch (`Backend.has_device`).
        if not self.has_device(device):  # type: ignore[attr-defined]
            return no_gpu_reason(self.name, device, self.devices())  # type: ignore[attr-defined]
        return super().unsupported_reason(cfg, dtype, device, strategy)  # type: ignore[misc]


def torch_rotary_tables(cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str) -> dict | None:
    """The rotary cos/sin tables as tensors ``(1|B, N, r/2)``: {"q": (cos, sin), "k": (cos, sin)}; None without rope."""
    tables = rotary_tables(cfg, inputs)
    if tables is None:
        return None
    return {
        "q": (to_tensor(tables.q_cos, dtype, device), to_tensor(tables.q_sin, dtype, device)),
        "k": (to_tensor(tables.k_cos, dtype, device), to_tensor(tables.k_sin, dtype, device)),
    }


def temperature_table(cfg: MHAConfig, positions, dtype: str, device: str):
    """The temperature's factors of ``positions`` (1|B, N) as a tensor in at least float32, or None without it
    (`TorchOps.temper_queries` multiplies in float32 for half precision and rounds once)."""
    from ..frameworks.ops import temperature_factors
    from ..frameworks.ops_torch import HALF

    compute = "float32" if dtype in HALF else dtype
    return optional_tensor(temperature_factors(cfg, positions), compute, device)


def heads_rotator(cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str):
    """``rotate(heads, "q" | "k")`` for heads ``(B, heads, N, d)``: rotated; the heads themselves without rope."""
    return table_rotator(torch_rotary_tables(cfg, inputs, dtype, device), cfg.rope)


def table_rotator(tables: dict | None, style: str | None):
    """``rotate(heads, "q" | "k")`` for heads ``(B, heads, N, d)`` with ``tables`` {"q": (cos, sin), "k": (cos, sin)},
    each (1|B, N, r/2) (`torch_rotary_tables`, or a chunk's slice of them), in rotary ``style``; the heads themselves
    when ``tables`` is None (no rope)."""

    def rotate(heads, which: str):
        if tables is None:
            return heads
        cos, sin = tables[which]
        return rotate_last_axis(heads, cos.unsqueeze(1), sin.unsqueeze(1), style)  # tables (1|B, 1, N, r/2)

    return rotate


def rotate_last_axis(x, cos, sin, style: str):
    """The rotary embedding in row samples: features on the last axis of x (..., N, Dk), tables (..., N, r/2).

    "half" pairs features i and i + r/2 (two slices); "interleaved" pairs 2i and 2i + 1
    (``unflatten`` of the feature axis into (r/2, 2), a view). Features past r pass through.
    """
    import torch

    h = cos.shape[-1]  # r/2 pairs
    r = 2 * h
    x_rot = x[..., :r]  # (..., N, r), a view
    if style == "half":
        a, b = x_rot[..., :h], x_rot[..., h:]  # (..., N, r/2) each, views
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., N, r)
    else:
        pairs = x_rot.unflatten(-1, (h, 2))  # (..., N, r/2, 2), a view
        a, b = pairs[..., 0], pairs[..., 1]  # (..., N, r/2) each
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (..., N, r)
    return rotated if r == x.shape[-1] else torch.cat((rotated, x[..., r:]), dim=-1)  # (..., N, Dk)
