"""The helpers every Hugging Face family's runner shares: the model's own mask, the attention path, loading.

transformers and torch are imported inside the functions.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import TypedDict

import numpy as np

from mha_rosetta.core import MHAConfig

from ._module_io import to_array
from ._real import RealRun, RunOptions, module_shapes, torch_state


def hf_mask(config, cfg: MHAConfig, x, padding):
    """The mask the family's own model passes to its attention layers (None: the module's own is_causal / no mask).

    Eager gets a 4-D additive float mask; SDPA a boolean one, or None where the mask is
    plain causal or empty, leaving the causal part to the module's ``is_causal``. A causal layer
    with ``cfg.window`` gets the model's sliding-window mask, built from ``config.sliding_window``
    (``kv_idx > q_idx - sliding_window``: the spec's W keys). A two-sided window is no family's
    here (each model builds its own: Gemma 3's overlay, ``create_bidirectional_sliding_window_mask``'s
    ``<=``), so it is refused rather than guessed.
    """
    import torch
    from transformers import masking_utils as masks

    pad = None if padding is None else torch.from_numpy(padding.astype(np.int64))  # (B, N), 1 = real token
    if cfg.causal:
        tokens = x.shape[1]
        build = masks.create_causal_mask if cfg.window is None else masks.create_sliding_window_causal_mask
        return build(
            config=config, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=torch.arange(tokens)[None]
        )
    if cfg.window is not None:
        raise ValueError(f"hf_mask: a two-sided window (window={cfg.window}, causal=False) is no runner's here")
    return masks.create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=pad)


def hf_rope_parameters(cfg: MHAConfig, partial: bool = False) -> dict:
    """``config.rope_parameters`` (transformers 5.x) for ``cfg``'s rotary: its base, its scaling in Hugging Face's own
    form (`MHAConfig.rope_scaling` is that form), and ``partial_rotary_factor`` where the family reads it."""
    scaling = {
        key: list(value) if isinstance(value, tuple) else value for key, value in (cfg.rope_scaling or {}).items()
    }
    # longrope's tables as the lists transformers' validation asks for (the spec keeps tuples)
    parameters: dict = {"rope_type": "default", "rope_theta": cfg.rope_base, **scaling}
    if partial:
        parameters["partial_rotary_factor"] = (cfg.rope_dims or cfg.d_k) / cfg.d_k  # rope_dims: None only without rope
    return parameters


def hf_max_positions(cfg: MHAConfig) -> dict:
    """``max_position_embeddings`` consistent with ``cfg.rope_scaling`` (empty without scaling): dynamic NTK's L is
    it; for YaRN, llama3 and longrope transformers expects factor * original_max_position_embeddings (and warns
    otherwise; longrope's factor may be None, beside its attention_factor: then L)."""
    scaling = cfg.rope_scaling
    if scaling is None or "original_max_position_embeddings" not in scaling:
        return {}
    original = scaling["original_max_position_embeddings"]
    factor = 1.0 if scaling["rope_type"] == "dynamic" or scaling.get("factor") is None else scaling["factor"]
    return {"max_position_embeddings": round(factor * original)}


def hf_config(config, options: RunOptions):
    config._attn_implementation = options.implementation
    return config


def hf_run(layout: str, module, description: str, state, x, forward, **extra) -> RealRun:
    """Load ``state`` into the HF ``module`` (strict) and run it (`hf_forward`)."""
    module.load_state_dict(torch_state(state), strict=True)
    return hf_forward(layout, module, description, x, forward, **extra)


def hf_forward(layout: str, module, description: str, x, forward, **extra) -> RealRun:
    """Run ``forward(x as a tensor of the module's dtype)`` without gradients on a loaded HF ``module``.

    A module held in float32 (or lower) computes in it: the run's precision says so.
    """
    import torch

    dtype = next(module.parameters()).dtype
    with torch.no_grad():
        output = forward(torch.from_numpy(x).to(dtype))
    run = RealRun(layout, "real", description, to_array(output).astype(np.float64), parameters=module_shapes(module))
    for name, value in extra.items():
        setattr(run, name, value)
    if dtype != torch.float64:
        run.precision = str(dtype).removeprefix("torch.")
        run.note = "; ".join(filter(None, [f"the module holds {run.precision} parameters", run.note]))
    return run


@contextmanager
def hf_implementation(config, options: RunOptions):
    """``config._attn_implementation`` set to ``options.implementation`` for the duration, then restored."""
    before = getattr(config, "_attn_implementation", None)
    config._attn_implementation = options.implementation
    try:
        yield config
    finally:
        config._attn_implementation = before


def rotary_tables(cfg: MHAConfig, options: RunOptions, rotary, x, repeated: bool = True, **rotary_kwargs):
    """The (cos, sin) each HF rotary model passes its attention layers, each (1, N, rope_dims), rotate-half layout.

    ``rotary`` is the family's rotary module (its own float32 angles, and its own scaling); ``rotary_kwargs``
    go to its forward (Gemma 3's ``layer_type``). ``options.float64_rotary`` gives the spec's tables instead:
    the angles of ``cfg`` (its ``rope_scaling`` too) and YaRN's attention factor on cos and sin, as Hugging
    Face's ``attention_scaling``. Either way the tables come in ``x``'s dtype, as the model casts them.
    ``repeated``: the family's tables hold each angle twice, ``(1, N, r)`` (Llama's ``cat((freqs, freqs))``);
    False: once, ``(1, N, r/2)`` (gpt-oss, whose rotation splits q into halves itself).
    """
    import torch

    tokens = x.shape[1]
    if not options.float64_rotary:
        return rotary(x, torch.arange(tokens)[None], **rotary_kwargs)  # the module's own tables, positions 0..N-1
    from mha_rosetta.core.rotary import angles, frequencies

    theta = angles(cfg, np.arange(tokens))  # (N, r/2), float64: the spec's angles
    factor = frequencies(cfg, tokens)[1]  # YaRN's attention factor (1.0 otherwise)
    doubled = (np.concatenate([theta, theta], axis=-1) if repeated else theta)[None]  # (1, N, r) or (1, N, r/2)
    cos, sin = factor * np.cos(doubled), factor * np.sin(doubled)
    return torch.from_numpy(cos).to(x.dtype), torch.from_numpy(sin).to(x.dtype)


def rotary_precision(options: RunOptions, eager_softmax_float32: bool = True) -> dict[str, str]:
    """Where a rotary HF family computes in float32 inside a float64 model, and so which tolerance applies.

    ``eager_softmax_float32``: the family's eager path is the shared ``eager_attention_forward``, whose softmax
    is float32 (Llama, GPT-NeoX, Phi-3, and Falcon from transformers 5.25); Falcon's own eager path, before,
    kept the hidden states' dtype (`hf_falcon.falcon_eager_is_shared`).
    """
    causes = []
    if not options.float64_rotary:
        causes.append("the rotary module computes its angles in float32 (inv_freq and positions in torch.float)")
    if options.implementation == "eager" and eager_softmax_float32:
        causes.append("eager attention's softmax runs in float32 (softmax(..., dtype=torch.float32))")
    return {"precision": "float32", "note": "; ".join(causes)} if causes else {}


class HFNames(TypedDict):
    """`hf_names`'s answer: the `Decoder` fields a transformers family's naming gives."""

    layout: str
    module: str
    package: str
    config_class: str
    rotary_class: str


def hf_names(module: str, config_class: str | None = None) -> HFNames:
    """A transformers family's names from its attention class, by transformers' naming: ``Qwen3NextAttention`` ->
    layout ``hf-qwen3-next``, package ``qwen3_next`` (``transformers.models.qwen3_next.modeling_qwen3_next``),
    ``Qwen3NextConfig`` and ``Qwen3NextRotaryEmbedding``. ``config_class``: where the config is named otherwise
    (Gemma 3's ``Gemma3TextConfig``)."""
    prefix = module.removesuffix("Attention")
    package = re.sub(r"(?<!^)(?=[A-Z])", "_", prefix).lower()  # GptOss -> gpt_oss, DeepseekV3 -> deepseek_v3
    return {
        "layout": "hf-" + package.replace("_", "-"),
        "module": module,
        "package": package,
        "config_class": config_class or f"{prefix}Config",
        "rotary_class": f"{prefix}RotaryEmbedding",
    }


def hf_heads(cfg: MHAConfig, grouped: bool = True) -> dict:
    """The config keywords every transformers family spells alike: ``hidden_size`` and ``num_attention_heads``, and
    where the family groups its kv heads (``grouped``), ``num_key_value_heads`` and ``head_dim``."""
    sizes = {"hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads}
    return sizes | ({"num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_k} if grouped else {})
