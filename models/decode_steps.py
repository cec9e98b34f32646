"""One real module stepped token by token through its own library's KV cache, as its own model decodes.

* Hugging Face's Llama-like attentions (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``,
  ``Qwen3Attention``, ``Qwen3NextAttention``, ``Llama4TextAttention``...): a ``DynamicCache(config=module.config)``
  (its layer as ``config.layer_types`` says: Llama 4's chunked layers a ``DynamicSlidingWindowLayer`` of the chunk),
  the family's rotary module (its own ``<Family>RotaryEmbedding``, float32 angles) at ``position_ids=[[t]]``, and
  the mask the model builds for the layer's type before the step: ``create_chunked_causal_mask`` on a
  ``"chunked_attention"`` layer (the step's chunk among the keys the cache returns), None on a full-attention one
  (one query token attends every cached key); eager attention. Llama 4's temperature reads the cache's length;
  Mistral 4's reads ``position_ids`` (passed where the forward takes them).
* mlx-lm's ``Attention``: ``mlx_lm.models.cache.KVCache()``, ``module(x_t, mask=None, cache=cache)`` (the
  model's ``create_attention_mask`` gives None for one token); the rotary offset is ``cache.offset``. Llama 4's
  rotary layers step the model's ``ChunkedKVCache`` with its chunk mask (`mlx_llama4.decode_cache`).

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
        from . import mlx_llama4

        cache, mask = mlx_llama4.decode_cache(module) if key == mlx_llama4.MODULE else _plain_mlx_cache()
        return _mlx_steps(module, x, cache, mask)
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
    mask = _hf_mask_function(config, module.layer_idx)
    # Mistral 4's forward requires position_ids (its temperature reads them): the step's position, the cache offset
    takes_positions = "position_ids" in inspect.signature(module.forward).parameters
    outputs = []
    try:
        with torch.no_grad():
            for t in range(x.shape[1]):
                token = torch.from_numpy(np.ascontiguousarray(x[:, t : t + 1])).to(dtype)  # (B, 1, E)
                position = torch.tensor([[t]])
                cos_sin = rotary(token, position, **extra)
                allowed = mask(
                    config=config, inputs_embeds=token, attention_mask=None, cache=cache, position_ids=position
                )
                given = {"position_ids": position} if takes_positions else {}
                out = module(token, position_embeddings=cos_sin, attention_mask=allowed, cache=cache, **given)[0]
                outputs.append(out[:, 0].double().numpy().copy())  # (B, E)
    finally:
        config._attn_implementation = before
    return outputs


def _hf_mask_function(config, layer_idx: int):
    """The mask the model builds before a decode step for the layer's ``config.layer_types`` entry: Llama 4's
    ``create_chunked_causal_mask`` for ``"chunked_attention"``; otherwise a function answering None (one token: every
    cached key; a sliding window is refused before, in `decode_steps`)."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and kinds[layer_idx] == "chunked_attention":
        from transformers.masking_utils import create_chunked_causal_mask

        return create_chunked_causal_mask
    return lambda **_: None


def _plain_mlx_cache():
    """mlx-lm's ``KVCache`` and no mask (the model's ``create_attention_mask`` for one token)."""
    from mlx_lm.models.cache import KVCache

    return KVCache(), lambda cache: None


def _mlx_steps(module, x: np.ndarray, cache, mask) -> list[np.ndarray]:
    """``module(x_t, mask=mask(cache), cache=cache)`` token by token; ``mask(cache)`` is called before each step."""
    import mlx.core as mx

    dtype = module.o_proj.weight.dtype
    outputs = []
    with mx.stream(mx.cpu):
        for t in range(x.shape[1]):
            token = mx.array(np.ascontiguousarray(x[:, t : t + 1]), dtype=dtype)  # (B, 1, E)
            out = module(token, mask=mask(cache), cache=cache)
            mx.eval(out)
            outputs.append(np.array(out[:, 0]).astype(np.float64))  # (B, E)
    return outputs
