"""The library calls the explainer shows, behind one public interface: `mha_rosetta.backends.demos`.

The explainer (`mha_rosetta.explain`) demonstrates how the libraries differ by calling them: their own
attention modules and functions fed the canonical parameters, their real modules' parameter shapes,
their float32 precision defaults, torch's tensors as the column/row-sample article uses them. That code
lives here, with the other framework code, so that the explainer imports no framework: it asks for a
demonstration by name and words what comes back.

Design rules:

1. One function per library call; it takes canonical objects (`MHAConfig`, `MHAParams`, NumPy arrays in
   the exchange layout) and returns plain values: NumPy arrays, shapes, booleans, error lines. Wording a
   comparison with the spec is the explainer's job.
2. Each framework is imported inside the function that uses it. A function is decorated with
   `needs(library, ...)`: where a library does not import, it raises `LibraryMissing` (a
   `BackendNotInstalled`) whose ``reason`` is `core.probe`'s (not installed, or the import error and its
   remedy). A function whose answer gathers several libraries (`float16_attention`,
   `float32_matmul_defaults`) answers for the installed ones only (`run_installed`).
3. The modules: `attention` (each library's attention called on the canonical parameters, axis order),
   `modules` (real modules' parameter shapes and head sizes; canonical weights loaded into them),
   `precision` (TF32), `tensors` (torch tensors for the article's claims), `planted` (a planted
   backward-only bug built on the numpy adapter), `mlx` (MLX's conventions beside torch's), `onnx` (the ONNX
   Attention op's known differences, measured in three runtimes).
"""

from __future__ import annotations

from ._needs import LibraryMissing, needs, run_installed
from .attention import (
    equinox_given_a_batch,
    equinox_mha_call,
    flax_mha_call,
    head_projections,
    jax_dpa_call,
    jax_on_cpu_at_highest,
    output_from_context,
    sdpa_and_dpa_axis_order,
    torch_mha_call,
    torch_sdpa_call,
)
from .mlx import (
    mlx_causal_weights,
    mlx_float64_facts,
    mlx_fully_masked_row,
    mlx_linear_weight_shape,
    mlx_rope_errors,
    torch_causal_weights,
)
from .modules import (
    equinox_query_weight_shape,
    flax_kernel_shapes,
    float16_attention,
    keras_query_kernel_shape,
    torch_linear,
    torch_mha_head_size,
    torch_mha_state_round_trip,
)
from .onnx import onnx_findings, onnx_known_differences, onnx_runtimes
from .planted import NoGroupSumBackend, NoGroupSumVJP
from .precision import float32_matmul_defaults, float32_matmul_on_gpu
from .tensors import batched_head_split, linear_weight_facts, torch_mha_axis_order, view_after_transpose

__all__ = [
    "LibraryMissing",
    "NoGroupSumBackend",
    "NoGroupSumVJP",
    "batched_head_split",
    "equinox_given_a_batch",
    "equinox_mha_call",
    "equinox_query_weight_shape",
    "flax_kernel_shapes",
    "flax_mha_call",
    "float16_attention",
    "float32_matmul_defaults",
    "float32_matmul_on_gpu",
    "head_projections",
    "jax_dpa_call",
    "jax_on_cpu_at_highest",
    "keras_query_kernel_shape",
    "linear_weight_facts",
    "mlx_causal_weights",
    "mlx_float64_facts",
    "mlx_fully_masked_row",
    "mlx_linear_weight_shape",
    "mlx_rope_errors",
    "needs",
    "onnx_findings",
    "onnx_known_differences",
    "onnx_runtimes",
    "output_from_context",
    "run_installed",
    "sdpa_and_dpa_axis_order",
    "torch_causal_weights",
    "torch_linear",
    "torch_mha_axis_order",
    "torch_mha_call",
    "torch_mha_head_size",
    "torch_mha_state_round_trip",
    "torch_sdpa_call",
    "view_after_transpose",
]
