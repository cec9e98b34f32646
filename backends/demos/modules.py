"""What the libraries' real modules are built with, read off them: parameter shapes, head sizes, float16 scores.

Every function builds the library's own module or calls its own function (never this project's adapter)
and returns plain values (shapes as tuples, arrays as NumPy); the explainer words them. Each framework is
imported inside its function, behind `needs`.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, from_torch_mha_state_dict

from ._needs import needs, run_installed

# --- float16 attention: where the scale goes -----------------------------------------------------


@needs("torch")
def _torch_float16(q: np.ndarray) -> list[tuple[str, np.ndarray]]:
    import torch
    import torch.nn.functional as F

    qt = torch.from_numpy(q)[None, None]  # (1, 1, n, d_k)
    return [
        ("torch float16 Q @ K.T by hand", (qt @ qt.transpose(-1, -2)).numpy()),
        ("F.scaled_dot_product_attention float16", F.scaled_dot_product_attention(qt, qt, qt).numpy()),
    ]


@needs("jax")
def _jax_float16(q: np.ndarray) -> list[tuple[str, np.ndarray]]:
    import jax
    import jax.numpy as jnp

    qj = jnp.asarray(q)[None, :, None, :]  # (1, n, 1, d_k): JAX's (B, N, H, d)
    return [("jax.nn.dot_product_attention float16", np.asarray(jax.nn.dot_product_attention(qj, qj, qj)))]


@needs("flax")
def _flax_float16(q: np.ndarray) -> list[tuple[str, np.ndarray]]:
    import flax.linen as fnn
    import jax.numpy as jnp

    qj = jnp.asarray(q)[None, :, None, :]  # (1, n, 1, d_k)
    label = "flax dot_product_attention float16 (divides the query by sqrt(depth) first)"
    return [(label, np.asarray(fnn.dot_product_attention(qj, qj, qj)))]


def float16_attention(q: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Self-attention of the float16 queries ``q (n, d_k)`` by each installed library's own function (torch's
    Q @ K.T by hand and SDPA, jax.nn.dot_product_attention, Flax's), as (the call, its result in NumPy)."""
    return run_installed((_torch_float16, _jax_float16, _flax_float16), q)


# --- head sizes and parameter shapes of the real modules -----------------------------------------


@needs("torch")
def torch_mha_head_size(embed_dim: int, num_heads: int) -> tuple[tuple[int, ...], int]:
    """nn.MultiheadAttention(embed_dim, num_heads): (in_proj_weight's shape, head_dim)."""
    import torch

    module = torch.nn.MultiheadAttention(embed_dim, num_heads)
    return tuple(module.in_proj_weight.shape), module.head_dim


@needs("flax")
def flax_kernel_shapes(
    num_heads: int, qkv_features: int, in_features: int, out_features: int | None = None
) -> dict[str, tuple[int, ...]]:
    """flax MultiHeadDotProductAttention's kernel shapes by layer (query, key, value, out), from its initialiser
    on a (1, 2, in_features) input (nothing computed: jax.eval_shape)."""
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp

    sizes = {} if out_features is None else {"out_features": out_features}
    module = fnn.MultiHeadDotProductAttention(num_heads=num_heads, qkv_features=qkv_features, **sizes)
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 2, in_features)))["params"]
    return {name: tuple(layer["kernel"].shape) for name, layer in shapes.items()}


@needs("equinox")
def equinox_query_weight_shape(num_heads: int, query_size: int, **sizes: int) -> tuple[int, ...]:
    """equinox.nn.MultiheadAttention(num_heads, query_size, **sizes)'s query_proj.weight shape."""
    import equinox as eqx
    import jax

    module = eqx.nn.MultiheadAttention(num_heads=num_heads, query_size=query_size, **sizes, key=jax.random.PRNGKey(0))
    return tuple(module.query_proj.weight.shape)


@needs("keras")
def keras_query_kernel_shape(num_heads: int, key_dim: int, d_model: int) -> tuple[int, ...]:
    """keras.layers.MultiHeadAttention(num_heads, key_dim) built on a (1, 2, d_model) input: its query kernel's shape."""
    import keras

    layer = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim)
    x = np.zeros((1, 2, d_model), dtype=np.float32)
    layer(x, x)
    return tuple(layer._query_dense.kernel.shape)


# --- canonical weights loaded into the real modules -----------------------------------------------


@needs("torch")
def torch_linear(weight: np.ndarray, bias: np.ndarray | None, x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """A real float64 nn.Linear holding ``weight (out, in)`` and ``bias``, applied to ``x (..., in)``:
    (its output, its weight's shape)."""
    import torch

    out_features, in_features = weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=bias is not None, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight))
        if bias is not None:
            linear.bias.copy_(torch.from_numpy(bias))
        y = linear(torch.from_numpy(x)).numpy()
    return y, tuple(linear.weight.shape)


@needs("torch")
def torch_mha_state_round_trip(cfg: MHAConfig, params: MHAParams) -> tuple[MHAParams, dict[str, tuple[int, ...]]]:
    """Load ``params`` into a real nn.MultiheadAttention (strict: every name and shape) and read them back:
    (the parameters read back, the module's state-dict shapes by name)."""
    from ..oracles.torch import loaded_torch_mha

    module = loaded_torch_mha(cfg, params, "float64", "cpu", batch_first=False)
    state = module.state_dict()
    return from_torch_mha_state_dict(cfg, state), {name: tuple(value.shape) for name, value in state.items()}
