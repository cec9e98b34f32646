"""``keras``: Keras 3 ``keras.layers.MultiHeadAttention`` (keras/src/layers/attention/multi_head_attention.py).

Keys are the layer's variable paths relative to the layer (``query/kernel`` for
``multi_head_attention/query/kernel``). Keras keeps the head axis inside its
``EinsumDense`` kernels: ``query/kernel (E, H, key_dim)``, ``key/kernel (kdim, H, key_dim)``,
``value/kernel (vdim, H, value_dim)``, biases ``(H, head_dim)``, and
``attention_output/kernel (H, value_dim, E)`` with bias ``(E,)``. ``key_dim`` is the
size **per head** (torch's ``embed_dim`` is the total).
"""

from __future__ import annotations

from ._layout import SEPARATE, Layout, default_scale, dense_general, no_grouped_kv, rotary_is

MODULE = "keras MultiHeadAttention"


LAYOUT = Layout(
    name="keras",
    module="keras.layers.MultiHeadAttention",
    description="Keras 3: EinsumDense kernels with the head axis inside, (in, H, head_dim) and (H, value_dim, E)",
    packing=SEPARATE,
    scale="1/sqrt(key_dim)",
    rotary="none",
    source="keras/src/layers/attention/multi_head_attention.py",
    split="no split: the kernels already carry the head axis; einsum 'abc,cde->abde' gives (B, N, H, d)",
    rules=(no_grouped_kv(MODULE), default_scale(MODULE), rotary_is((None,), MODULE)),
    **dense_general("attention_output"),  # Flax's tree, the output layer named attention_output
    notes=(
        "known difference: on the JAX backend a call with value_dim != key_dim fails inside "
        "jax.nn.dot_product_attention (value shape must equal key shape); return_attention_scores=True takes "
        "Keras's own einsum path, which works",
        "keras needs KERAS_BACKEND (jax or torch here); without it Keras 3 defaults to TensorFlow",
        "attention_mask is boolean (B, Nq, Nk), True = may attend, like the spec",
    ),
)
