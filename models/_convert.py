"""Moving a checkpoint from one family's layout to another's, through the canonical parameters.

Takes `Layout` objects, so that a family's runner (`meta_llama`) can convert without the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.rotary import to_interleaved_params, to_rotate_half_params

from ._layout import Layout


def convert_layouts(
    cfg: MHAConfig, state_dict: Mapping, source_layout: Layout, target_layout: Layout
) -> tuple[MHAConfig, dict[str, np.ndarray]]:
    """`mha_rosetta.models.convert_state_dict` on layout objects: (target cfg, target state dict)."""
    params = source_layout.from_state_dict(cfg, state_dict)
    target_cfg = cfg
    target_rope = _rope_target(target_layout, cfg)
    if target_rope is not None and target_rope != cfg.rope:  # None only when cfg.rope is None too
        convert = {"half": to_rotate_half_params, "interleaved": to_interleaved_params}[target_rope]
        target_cfg, params = convert(cfg, params)  # the per-head row permutation of w_q/w_k (and b_q/b_k)
    return target_cfg, target_layout.to_state_dict(target_cfg, params)


def _rope_target(layout: Layout, cfg: MHAConfig) -> str | None:
    """The rotary convention ``layout`` needs for ``cfg`` (the other one when only that one fits)."""
    rope = cfg.rope
    if rope is None or layout.unsupported_reason(cfg) is None:
        return rope
    other = {"half": "interleaved", "interleaved": "half"}[rope]
    if layout.unsupported_reason(dataclasses.replace(cfg, rope=other)) is None:
        return other
    return rope  # neither fits: to_state_dict raises with the layout's own reason
