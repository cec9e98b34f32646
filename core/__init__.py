"""mha_rosetta.core: the multi-head attention pipeline written down once.

Imports NumPy only. Everything a backend, a check or a benchmark needs to agree on
lives here: the configuration, the canonical parameter layout and its converters,
the stage contract, the float64 oracle and the tolerance table.
"""

from .config import ROPE_STYLES, MHAConfig
from .dtypes import DTYPE_NAMES, check_dtype_name, numpy_dtype
from .errors import error_line
from .inputs import MHAInputs, allowed_positions, causal_mask, prepare_inputs
from .layouts import (
    from_dense_general_kernel,
    from_equinox_weights,
    from_flax_params,
    from_row_sample,
    from_torch_mha_state_dict,
    merge_head_bias,
    merge_head_matrices,
    merge_output_matrix,
    split_head_bias,
    split_head_matrices,
    split_output_matrix,
    to_dense_general_kernel,
    to_equinox_weights,
    to_flax_params,
    to_row_sample,
    to_torch_mha_state_dict,
    torch_mha_unsupported_reason,
)
from .params import MHAParams, expected_param_shapes, init_params, validate_params
from .reference import linear, reference_mha, reference_stages, softmax_with_empty_rows
from .rotary import (
    RotaryTables,
    apply_rotary,
    inverse_frequencies,
    rope_permutation,
    rotary_pairs,
    rotary_tables,
    to_interleaved_params,
    to_rotate_half_params,
)
from .stages import PIPELINE_STEPS, STAGE_BY_NAME, STAGE_NAMES, STAGES, Stage, stage_shapes
from .tolerances import TOLERANCES, Comparison, Tolerance, assert_close, compare, lower_precision, tolerance_for

__all__ = [
    "DTYPE_NAMES",
    "PIPELINE_STEPS",
    "ROPE_STYLES",
    "STAGES",
    "STAGE_BY_NAME",
    "STAGE_NAMES",
    "TOLERANCES",
    "Comparison",
    "MHAConfig",
    "MHAInputs",
    "MHAParams",
    "RotaryTables",
    "Stage",
    "Tolerance",
    "allowed_positions",
    "apply_rotary",
    "assert_close",
    "causal_mask",
    "check_dtype_name",
    "compare",
    "error_line",
    "expected_param_shapes",
    "from_dense_general_kernel",
    "from_equinox_weights",
    "from_flax_params",
    "from_row_sample",
    "from_torch_mha_state_dict",
    "init_params",
    "inverse_frequencies",
    "linear",
    "lower_precision",
    "merge_head_bias",
    "merge_head_matrices",
    "merge_output_matrix",
    "numpy_dtype",
    "prepare_inputs",
    "reference_mha",
    "reference_stages",
    "rope_permutation",
    "rotary_pairs",
    "rotary_tables",
    "softmax_with_empty_rows",
    "split_head_bias",
    "split_head_matrices",
    "split_output_matrix",
    "stage_shapes",
    "to_dense_general_kernel",
    "to_equinox_weights",
    "to_flax_params",
    "to_interleaved_params",
    "to_rotate_half_params",
    "to_row_sample",
    "to_torch_mha_state_dict",
    "tolerance_for",
    "torch_mha_unsupported_reason",
    "validate_params",
]
