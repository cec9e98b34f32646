"""A Gemma 3 attention layer and its keras-hub ports, as factories for `mha-rosetta compare` (docs/ports.md).

``hf_gemma3`` is Hugging Face's ``Gemma3Attention`` with ``query_pre_attn_scalar = hidden_size / heads`` (as Gemma 3
27B's config has it: 5376 / 32 = 168, not its head_dim 128); ``keras_hub_gemma3`` is keras-hub's
``CachedGemma3Attention`` port, which says the same with ``query_head_dim_normalize=False`` (scale
``(hidden_dim // heads)**-0.5``); ``keras_hub_gemma3_head_dim_scale`` is the same port with the real-world mistake
of leaving ``query_head_dim_normalize`` at its default, True: ``head_dim**-0.5``. All are tiny, float64, with seeded
random weights (nothing is downloaded). Keras needs its backend chosen before it is imported (``KERAS_BACKEND``:
jax here, the default). Run from the repository root::

    mha-rosetta compare examples.ports_gemma3:hf_gemma3 examples.ports_gemma3:keras_hub_gemma3
"""

from __future__ import annotations

import os

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 16  # hidden / heads = 8, not head_dim: the scale a port gets wrong
ROPE_THETA = 1_000_000.0  # Gemma 3's full-attention layers
EPS = 1e-6


def hf_gemma3():
    import torch
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        query_pre_attn_scalar=HIDDEN // HEADS,
        rms_norm_eps=EPS,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": ROPE_THETA},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    config._attn_implementation = "eager"
    attention = Gemma3Attention(config, layer_idx=0).double().eval()
    with torch.no_grad():  # Gemma's RMSNorm stores w and multiplies by 1 + w: away from 0, so that a swap shows
        attention.q_norm.weight.normal_(0.0, 0.1)
        attention.k_norm.weight.normal_(0.0, 0.1)
    return attention


def keras_hub_gemma3(query_head_dim_normalize: bool = False):
    os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras 3 defaults to TensorFlow
    import keras

    if keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # a float64 layer computes in float64 only with x64 on
    from keras_hub.src.models.gemma3.gemma3_attention import CachedGemma3Attention

    layer = CachedGemma3Attention(
        head_dim=HEAD_DIM,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        use_query_key_norm=True,
        query_head_dim_normalize=query_head_dim_normalize,
        layer_norm_epsilon=EPS,
        rope_wavelength=ROPE_THETA,
        dtype="float64",
    )
    layer.build((None, None, HIDDEN))
    return layer


def keras_hub_gemma3_head_dim_scale():
    return keras_hub_gemma3(query_head_dim_normalize=True)  # the planted mistake: keras-hub's default
