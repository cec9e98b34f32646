"""The real modules of each family, built tiny from config objects and loaded with a layout's state dict.

Nothing is downloaded: every module is built from its library's config object with the
sizes of an ``MHAConfig``, in float64, and loaded from `Layout.to_state_dict` by the
module's own parameter names (``load_state_dict(strict=True)`` for torch modules; by
variable path for Keras). `run_real` then runs it on
row-sample inputs with an optional key padding mask, building the mask the way the
family's own model does (Hugging Face's ``create_causal_mask`` /
``create_bidirectional_mask``, Keras's boolean ``attention_mask``...).

Where the real library cannot run here, the runner says so in `RealRun.kind`:
``"real"`` (the library's own module), ``"equivalent"`` (another real module with the
same packing, e.g. ``nn.MultiheadAttention`` for timm's ``qkv``) or ``"reimplementation"``
(the family's split written from its source, for Megatron-LM and Meta's Llama).

Each family's runner lives next to its layout and is registered with it (`Layout.runner`,
`Layout.requires`); this module looks it up. Flax and Equinox have no runner here: their real
modules run through the project's oracle backends (`mha_rosetta.explain.oracle_modules`).

Every framework is imported inside the function that uses it; importing this module
imports NumPy only.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.probe import probe

from . import get_layout
from ._real import HF_IMPLEMENTATIONS, RealRun, RunOptions, allowed_mask
from .megatron import megatron_split
from .meta_llama import meta_reference_forward

# The extra that installs each library: its own name, except where the "models" extra brings it.
INSTALL = {"transformers": "models", "keras": "models", "mlx_lm": "mlx", "keras_hub": "keras-hub"}


def unavailable_reason(layout: str) -> str | None:
    """None when the libraries `run_real` needs for ``layout`` import here; else why not, with the install command."""
    found_layout = get_layout(layout)
    if found_layout.runner is None:
        return (
            f"layout {layout!r} has no real-module runner in mha_rosetta.models (its library's oracle backend runs it)"
        )
    return libraries_missing(found_layout.requires)


def libraries_missing(modules) -> str | None:
    """None when every module imports here; else why the first one does not, with the install command."""
    for module in modules:
        found = probe(module)
        if not found.installed:
            return f"{found.reason}: pip install 'mha-rosetta[{INSTALL.get(module, module)}]'"
        if not found.ok:
            return found.reason
    return None


def run_real(
    layout: str,
    cfg: MHAConfig,
    state: dict[str, np.ndarray],
    x: np.ndarray,
    padding=None,
    implementation: str = "eager",
    float64_rotary: bool = False,
) -> RealRun:
    """Load ``state`` into ``layout``'s real module built for ``cfg`` and run it on ``x (B, N, E)``.

    ``padding (B, N)``: True for real tokens (a key padding mask); ``cfg.causal`` adds the
    causal mask. ``implementation``: Hugging Face's attention path for the ``hf-*`` and
    ``meta-llama`` families (``"eager"`` or ``"sdpa"``). ``float64_rotary``: give Llama and
    GPT-NeoX the spec's float64 cos/sin tables instead of their rotary module's, which
    computes its angles in float32 even in a float64 model.
    """
    reason = unavailable_reason(layout)
    if reason:
        raise ImportError(f"layout {layout!r}: cannot build the real module: {reason}")
    found = get_layout(layout)
    found.require(cfg)
    x = np.asarray(x, dtype=np.float64)
    padding = None if padding is None else np.asarray(padding, dtype=bool)
    if found.hf_options:
        if implementation not in HF_IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(HF_IMPLEMENTATIONS)}, got {implementation!r}")
    elif implementation != "eager" or float64_rotary:
        raise ValueError(f"implementation and float64_rotary apply to Hugging Face layouts only, not {layout!r}")
    runner = found.runner
    if runner is None:  # unavailable_reason says so first; this keeps the type checker informed
        raise ImportError(f"layout {layout!r}: cannot build the real module: it has no runner")
    return runner(cfg, state, x, padding, RunOptions(implementation, float64_rotary))


def run_module(
    module, x: np.ndarray, padding=None, implementation: str = "eager", float64_rotary: bool = False
) -> tuple[RealRun, MHAConfig, object]:
    """Run a real module **instance** on ``x (B, N, E)`` as its own model would: ``(RealRun, cfg, params)``.

    ``cfg, params`` are `from_module(module)`; the run's output is what ``reference_mha(cfg, params, x,
    mask=allowed_mask(cfg, B, N, padding))`` should equal, at the run's ``precision``. The options are
    those of `run_real`. Hugging Face's rotary families get their cos/sin from their rotary module built
    from the module's own config (or the spec's float64 tables with ``float64_rotary``).
    """
    from . import from_module, layout_of_module

    layout = layout_of_module(module)
    if layout.reader is None or layout.reader.forward is None:
        raise ImportError(f"layout {layout.name!r}: mha_rosetta.models has no forward for {type(module).__name__}")
    cfg, params = from_module(module)
    if implementation not in HF_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(HF_IMPLEMENTATIONS)}, got {implementation!r}")
    if not layout.hf_options and (implementation != "eager" or float64_rotary):
        raise ValueError(f"implementation and float64_rotary apply to Hugging Face layouts only, not {layout.name!r}")
    x = np.asarray(x, dtype=np.float64)
    padding = None if padding is None else np.asarray(padding, dtype=bool)
    run = layout.reader.forward(module, cfg, x, padding, RunOptions(implementation, float64_rotary))
    return run, cfg, params


__all__ = [
    "HF_IMPLEMENTATIONS",
    "INSTALL",
    "RealRun",
    "allowed_mask",
    "libraries_missing",
    "megatron_split",
    "meta_reference_forward",
    "run_module",
    "run_real",
    "unavailable_reason",
]
