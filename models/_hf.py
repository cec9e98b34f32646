"""The helpers every Hugging Face family's runner shares: the model's own mask, the attention path, loading.

transformers and torch are imported inside the functions.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig

from ._real import RealRun, RunOptions, module_shapes, torch_state


def hf_mask(config, cfg: MHAConfig, x, padding):
    """The mask the family's own model passes to its attention layers (None: the module's own is_causal / no mask).

    Eager gets a 4-D additive float mask; SDPA a boolean one, or None where the mask is
    plain causal or empty, leaving the causal part to the module's ``is_causal``.
    """
    import torch
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    pad = None if padding is None else torch.from_numpy(padding.astype(np.int64))  # (B, N), 1 = real token
    if cfg.causal:
        tokens = x.shape[1]
        return create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=torch.arange(tokens)[None]
        )
    return create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=pad)


def hf_config(config, options: RunOptions):
    config._attn_implementation = options.implementation
    return config


def hf_run(layout: str, module, description: str, state, x, forward, **extra) -> RealRun:
    """Load ``state`` into the HF ``module`` (strict) and run ``forward(x as a tensor)`` without gradients."""
    import torch

    module.load_state_dict(torch_state(state), strict=True)
    with torch.no_grad():
        output = forward(torch.from_numpy(x))
    return RealRun(layout, "real", description, output.numpy(), parameters=module_shapes(module), **extra)


def rotary_tables(cfg: MHAConfig, options: RunOptions, rotary, x):
    """The (cos, sin) each HF rotary model passes its attention layers, each (1, N, rope_dims), rotate-half layout."""
    import torch

    tokens = x.shape[1]
    if not options.float64_rotary:
        return rotary(x, torch.arange(tokens)[None])  # the module's own tables, positions 0..N-1
    from mha_rosetta.core.rotary import angles

    theta = angles(cfg, np.arange(tokens))  # (N, r/2), float64: the spec's angles
    doubled = np.concatenate([theta, theta], axis=-1)[None]  # (1, N, r): HF repeats them for the two halves
    return torch.from_numpy(np.cos(doubled)), torch.from_numpy(np.sin(doubled))


def rotary_precision(options: RunOptions) -> dict[str, str]:
    """Where Llama and GPT-NeoX compute in float32 inside a float64 model, and so which tolerance applies."""
    causes = []
    if not options.float64_rotary:
        causes.append("the rotary module computes its angles in float32 (inv_freq and positions in torch.float)")
    if options.implementation == "eager":
        causes.append("eager attention's softmax runs in float32 (softmax(..., dtype=torch.float32))")
    return {"precision": "float32", "note": "; ".join(causes)} if causes else {}
