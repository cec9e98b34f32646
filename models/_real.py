"""What every real-module runner shares: the result (`RealRun`), the run options, the spec's mask, torch helpers.

A runner is registered with its layout (`Layout.runner`, with `Layout.requires`); its signature is
``runner(cfg, state, x, padding, options) -> RealRun``. Imports NumPy and `core` only; torch is imported
inside the functions that use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.core import MHAConfig

HF_IMPLEMENTATIONS = ("eager", "sdpa")  # Hugging Face's reference path, and the default one (torch SDPA)
HF_REQUIRES = ("torch", "transformers")  # what every Hugging Face family's runner imports


@dataclass
class RealRun:
    """What a real module computed, and what it was."""

    layout: str
    kind: str  # "real", "equivalent" or "reimplementation"
    module: str  # what ran, in words
    output: np.ndarray  # (B, N, E)
    merged: np.ndarray | None = None  # (B, N, H*Dv) where the module stops before the output projection
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the real module's own names and shapes
    precision: str = "float64"  # the dtype whose tolerance applies (float32 where the module computes in float32)
    note: str = ""
    known_difference: str = ""  # what failed in the module's default path (the output then comes from another path)


@dataclass(frozen=True)
class RunOptions:
    """Options of the Hugging Face runners (`Layout.hf_options`); the other runners take the defaults only."""

    implementation: str = "eager"  # "eager" (HF's reference path) or "sdpa" (its default: torch SDPA)
    float64_rotary: bool = False  # the spec's cos/sin tables instead of the module's float32 ones


def allowed_mask(cfg: MHAConfig, batch: int, tokens: int, padding: np.ndarray | None) -> np.ndarray:
    """The spec's boolean mask (B, 1, N, N) for key padding ``padding (B, N)`` (True = real token) and cfg.causal."""
    allowed = np.ones((batch, 1, tokens, tokens), dtype=bool)
    if padding is not None:
        allowed &= np.asarray(padding, dtype=bool)[:, None, None, :]
    if cfg.causal:
        allowed &= np.tril(np.ones((tokens, tokens), dtype=bool))
    return allowed


def torch_state(state: dict[str, np.ndarray]):
    import torch

    return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in state.items()}


def module_shapes(module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in module.state_dict().items()}


def state_shapes(state: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a state dict (for runners whose module is not a torch module)."""
    return {name: tuple(np.shape(value)) for name, value in state.items()}
