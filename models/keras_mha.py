"""``keras``: Keras 3 ``keras.layers.MultiHeadAttention`` (keras/src/layers/attention/multi_head_attention.py).

Keys are the layer's variable paths relative to the layer (``query/kernel`` for
``multi_head_attention/query/kernel``). Keras keeps the head axis inside its
``EinsumDense`` kernels: ``query/kernel (E, H, key_dim)``, ``key/kernel (kdim, H, key_dim)``,
``value/kernel (vdim, H, value_dim)``, biases ``(H, head_dim)``, and
``attention_output/kernel (H, value_dim, E)`` with bias ``(E,)``. ``key_dim`` is the
size **per head** (torch's ``embed_dim`` is the total).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAParams,
    from_dense_general_kernel,
    merge_head_bias,
    merge_output_matrix,
    split_head_bias,
    split_output_matrix,
    to_dense_general_kernel,
)

from ._layout import SEPARATE, Layout, default_scale, no_grouped_kv, rotary_is

MODULE = "keras MultiHeadAttention"
_INPUTS = (("query", "q"), ("key", "k"), ("value", "v"))


def _shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
    H = cfg.n_heads
    widths = {"query": (cfg.d_model, cfg.d_k), "key": (cfg.kdim, cfg.d_k), "value": (cfg.vdim, cfg.d_v)}
    shapes = {}
    for name, (width, head_dim) in widths.items():
        shapes[f"{name}/kernel"] = (width, H, head_dim)
        if cfg.bias:
            shapes[f"{name}/bias"] = (H, head_dim)
    shapes["attention_output/kernel"] = (H, cfg.d_v, cfg.d_model)
    if cfg.bias:
        shapes["attention_output/bias"] = (cfg.d_model,)
    return shapes


def _pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
    state = {}
    for name, short in _INPUTS:
        state[f"{name}/kernel"] = to_dense_general_kernel(getattr(params, f"w_{short}"), cfg.n_heads)  # (in, H, d)
        if cfg.bias:
            state[f"{name}/bias"] = split_head_bias(getattr(params, f"b_{short}"), cfg.n_heads)  # (H, d)
    state["attention_output/kernel"] = split_output_matrix(params.w_o, cfg.n_heads)  # (H, Dv, E)
    if cfg.bias:
        state["attention_output/bias"] = params.b_o.copy()
    return state


def _unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
    arrays = {}
    for name, short in _INPUTS:
        arrays[f"w_{short}"] = from_dense_general_kernel(state[f"{name}/kernel"])  # (H*d, in)
        arrays[f"b_{short}"] = merge_head_bias(state.get(f"{name}/bias"))
    arrays["w_o"] = merge_output_matrix(state["attention_output/kernel"])  # (E, H*Dv)
    arrays["b_o"] = state.get("attention_output/bias")
    return MHAParams(**arrays)


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
    shapes=_shapes,
    pack=_pack,
    unpack=_unpack,
    notes=(
        "known difference: on the JAX backend a call with value_dim != key_dim fails inside "
        "jax.nn.dot_product_attention (value shape must equal key shape); return_attention_scores=True takes "
        "Keras's own einsum path, which works",
        "keras needs KERAS_BACKEND (jax or torch here); without it Keras 3 defaults to TensorFlow",
        "attention_mask is boolean (B, Nq, Nk), True = may attend, like the spec",
    ),
)

to_state_dict = LAYOUT.to_state_dict
from_state_dict = LAYOUT.from_state_dict
