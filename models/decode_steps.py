"""One real module stepped token by token through its own library's KV cache, as its own model decodes.

* Hugging Face's Llama-like attentions (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``,
  ``Qwen3Attention``...): a ``DynamicCache(config=module.config)``, the family's rotary module (its own
  ``<Family>RotaryEmbedding``, float32 angles) at ``position_ids=[[t]]``, ``attention_mask=None`` (one query
  token attends every cached key: what the model's causal mask gives a decode step), eager attention.
* mlx-lm's ``Attention``: ``mlx_lm.models.cache.KVCache()``, ``module(x_t, mask=None, cache=cache)`` (the
  model's ``create_attention_mask`` gives None for one token); the rotary offset is ``cache.offset``.

* keras-hub's attention layers: a zero cache ``[B, 2, S, G, d]`` (Gemma 3: a ``(keys, values)`` tuple) of T
  positions, ``layer(x_t, attention_mask=..., cache=cache, cache_update_index=t)`` (`models.keras_hub.decode`),
  the window applied where keras-hub applies it (in the layer, or the decoder's band mask).

A window is refused for the others (`decode_steps` raises): neither reader there reads a window into a decode
whose mask would need the model's sliding mask. Every framework is imported inside the functions.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np

from ._module_io import class_key, class_name


def decode_steps(module, x: np.ndarray, window=None) -> list[np.ndarray]:
    """The module's output for each token of ``x (B, T, E)``, one call per token through its own cache: T arrays
    (B, E)."""
    key = class_key(module)
    if key.startswith("keras_hub."):  # its cache [B, 2, S, G, d] (Gemma 3: a tuple) and its window, as generate steps
        from .keras_hub import decode

        return decode(module, x)
    if window is not None:
        raise ValueError(f"decode_steps: a window ({window}) needs the model's sliding mask; no stepper builds it here")
    if key.startswith("mlx_lm."):
        return _mlx_steps(module, x)
    if key.startswith("transformers.") and hasattr(module, "o_proj") and hasattr(module, "layer_idx"):
        return _hf_steps(module, x)
    raise ValueError(f"decode_steps: no cache stepper for {class_name(module)} (Hugging Face Llama-like and mlx-lm)")


def _hf_steps(module, x: np.ndarray) -> list[np.ndarray]:
    import torch
    from transformers import DynamicCache

    modeling = importlib.import_module(type(module).__module__)
    rotary_name = type(module).__name__.replace("Attention", "RotaryEmbedding")
    config = module.config
    before = getattr(config, "_attn_implementation", None)
    config._attn_implementation = "eager"
    dtype = module.o_proj.weight.dtype
    rotary = getattr(modeling, rotary_name)(config).to(dtype)
    cache = DynamicCache(config=config)
    # Gemma 3's rotary forward takes the layer type (one table per type)
    extra = {"layer_type": module.layer_type} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    outputs = []
    try:
        with torch.no_grad():
            for t in range(x.shape[1]):
                token = torch.from_numpy(np.ascontiguousarray(x[:, t : t + 1])).to(dtype)  # (B, 1, E)
                cos_sin = rotary(token, torch.tensor([[t]]), **extra)
                out = module(token, position_embeddings=cos_sin, attention_mask=None, cache=cache)[0]
                outputs.append(out[:, 0].double().numpy().copy())  # (B, E)
    finally:
        config._attn_implementation = before
    return outputs


def _mlx_steps(module, x: np.ndarray) -> list[np.ndarray]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    dtype = module.o_proj.weight.dtype
    cache = KVCache()
    outputs = []
    with mx.stream(mx.cpu):
        for t in range(x.shape[1]):
            token = mx.array(np.ascontiguousarray(x[:, t : t + 1]), dtype=dtype)  # (B, 1, E)
            out = module(token, mask=None, cache=cache)
            mx.eval(out)
            outputs.append(np.array(out[:, 0]).astype(np.float64))  # (B, E)
    return outputs
