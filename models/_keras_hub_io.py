"""Reading, loading and running a keras-hub attention layer: its kernels, its rotary, its own call, its cache.

Shared by every keras-hub family of `keras_hub` (the families and their layouts). Keras and keras-hub are imported
inside the functions; importing this module imports NumPy only.

* Kernels keep the head axis (`EinsumDense`): ``query/kernel (E, H, d)`` and ``key``/``value/kernel (E, G, d)``
  (``bqm,muh->bquh``; Gemma's ``btd,ndh->btnh`` puts the heads first: ``(H, E, d)``), biases ``(H, d)``/``(G, d)``
  and ``attention_output/kernel (H, d, E)``, bias ``(E,)`` (`head_kernels`).
* The rotary is keras-hub's ``RotaryEmbedding``: ``x1, x2 = split(x, 2)``, ``stack((-x2, x1))``: Hugging Face's
  rotate-half over every feature of a head, with positions and inverse frequencies in float32 (`keras_hub_rope`).
* The cache is one tensor ``[B, 2, S, G, d]`` (keys, values) updated at ``cache_update_index`` with
  ``ops.slice_update``; Gemma 3's is a tuple ``(keys, values)`` of ``[B, S, G, d]`` each (`keras_hub_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, expected_param_shapes
from mha_rosetta.core.layouts import (
    from_dense_general_kernel,
    merge_head_bias,
    merge_output_matrix,
    split_head_bias,
    split_output_matrix,
    to_dense_general_kernel,
)

from ._errors import LayoutError
from ._layout import PackFunctions
from ._module_io import class_name, to_array, unexpressible, unexpressible_config
from ._real import RealRun

PRECISION_NOTE = (
    "keras-hub computes the rotary angles in float32 (positions and inverse frequencies are float32 in "
    "RotaryEmbedding) and its softmax in float32 (Softmax(dtype='float32'); on JAX the fused "
    "jax.nn.dot_product_attention's softmax is float32 too): a float64 layer is held to float32"
)
NORM_NOTE = "; its RMSNorm of q and k casts to float32 (ops.cast(x, 'float32'))"


def head_kernels(heads_first: bool, extras: Mapping[str, str], offsets: Mapping[str, float]) -> PackFunctions:
    """`Layout`'s shapes, pack, unpack for a keras-hub attention: per-head `EinsumDense` kernels with kv groups.

    ``heads_first``: the input kernels are ``(H, E, d)`` (Gemma's ``ndh``) rather than ``(E, H, d)``. ``extras``:
    canonical variant parameter -> stored name (``q_norm`` -> ``query_norm/scale``); ``offsets``: a stored
    parameter that is ``canonical - offset`` (Gemma 3's RMSNorm multiplies by ``1 + scale``). Exact both ways.
    """

    def kernel_shape(width: int, heads: int, head_dim: int) -> tuple[int, ...]:
        return (heads, width, head_dim) if heads_first else (width, heads, head_dim)

    def counts(cfg: MHAConfig) -> dict[str, int]:
        return {"query": cfg.n_heads, "key": cfg.n_kv_heads, "value": cfg.n_kv_heads}

    def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
        result: dict[str, tuple[int, ...]] = {}
        for name, heads in counts(cfg).items():
            result[f"{name}/kernel"] = kernel_shape(cfg.d_model, heads, cfg.d_k)
            if cfg.bias:
                result[f"{name}/bias"] = (heads, cfg.d_k)
        result["attention_output/kernel"] = (cfg.n_heads, cfg.d_v, cfg.d_model)
        if cfg.bias is True:
            result["attention_output/bias"] = (cfg.d_model,)
        for canonical, stored in extras.items():
            shape = expected_param_shapes(cfg)[canonical]
            if shape is not None:
                result[stored] = shape
        return result

    def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
        state = {}
        for (name, heads), short in zip(counts(cfg).items(), "qkv", strict=True):
            kernel = to_dense_general_kernel(getattr(params, f"w_{short}"), heads)  # (E, heads, d)
            state[f"{name}/kernel"] = kernel.transpose(1, 0, 2) if heads_first else kernel  # (heads, E, d) view
            bias = getattr(params, f"b_{short}")
            if bias is not None:
                state[f"{name}/bias"] = split_head_bias(bias, heads)  # (heads, d) view
        state["attention_output/kernel"] = split_output_matrix(params.w_o, cfg.n_heads)  # (H, d, E)
        if params.b_o is not None:
            state["attention_output/bias"] = params.b_o.copy()
        for canonical, stored in extras.items():
            value = getattr(params, canonical)
            if value is not None:
                state[stored] = value - offsets.get(canonical, 0.0)
        return state

    def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
        arrays: dict = {}
        for name, short in zip(counts(cfg), "qkv", strict=True):
            kernel = state[f"{name}/kernel"]
            kernel = kernel.transpose(1, 0, 2) if heads_first else kernel  # (E, heads, d) view
            arrays[f"w_{short}"] = from_dense_general_kernel(kernel)
            arrays[f"b_{short}"] = merge_head_bias(state.get(f"{name}/bias"))
        arrays["w_o"] = merge_output_matrix(state["attention_output/kernel"])
        arrays["b_o"] = state.get("attention_output/bias")
        for canonical, stored in extras.items():
            if stored in state:
                arrays[canonical] = state[stored].astype(np.float64) + offsets.get(canonical, 0.0)
        return MHAParams(**arrays)

    return {"shapes": shapes, "pack": pack, "unpack": unpack}


def keras_hub_variables(layer) -> dict:
    """The layer's variables by their paths below the layer (``query/kernel``, ``query_norm/scale``, ``sinks``)."""
    if not layer.built:
        raise LayoutError(
            f"{class_name(layer)} is not built: it holds no weights yet; call layer.build((None, None, hidden_dim))"
        )
    return {variable.path.removeprefix(f"{layer.path}/"): variable for variable in layer.weights}


def keras_hub_state(layer, names) -> dict[str, np.ndarray]:
    variables = keras_hub_variables(layer)
    return {name: to_array(variables[name]) for name in names}


def load_keras_hub(layer, state: Mapping[str, np.ndarray]):
    """Each array into the variable of that path, in the variable's dtype; the layer (Keras layers are mutable)."""
    variables = keras_hub_variables(layer)
    for name, array in state.items():
        target = variables[name]
        if tuple(target.shape) != tuple(np.shape(array)):
            raise LayoutError(
                f"{class_name(layer)}.{name} has shape {tuple(target.shape)}, the state dict {np.shape(array)}"
            )
        target.assign(np.asarray(array).astype(target.dtype))
    return layer


def keras_hub_rope(layer, rope) -> dict:
    """The MHAConfig rotary fields of keras-hub's rotary layer ``rope`` (base, scaling), or LayoutError."""
    kind = type(rope).__name__
    if kind not in ("RotaryEmbedding", "LlamaRotaryEmbedding"):  # Phi-3's su-scaled one keeps two factor tables
        raise unexpressible(layer, f"rotary layer {kind}", "the reader reads RotaryEmbedding and LlamaRotaryEmbedding")
    fields = {"rope": "half", "rope_base": float(rope.max_wavelength), "rope_scaling": None}
    if kind == "LlamaRotaryEmbedding":  # its _get_inverse_freq ignores position_scaling_factor: Llama 3.1's only
        if rope.low_freq_factor is not None:
            fields["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": float(rope.frequency_adjustment_factor),
                "low_freq_factor": float(rope.low_freq_factor),
                "high_freq_factor": float(rope.high_freq_factor),
                "original_max_position_embeddings": int(rope.pretraining_sequence_length),
            }
        return fields
    factor = float(rope.scaling_factor)
    if factor == 1.0 and rope.rope_type in ("linear", "yarn"):  # YaRN of factor 1: the unscaled table, mscale 1
        return fields
    if rope.rope_type == "linear":
        fields["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        return fields
    raise unexpressible(
        layer,
        f"RotaryEmbedding(rope_type={rope.rope_type!r}, scaling_factor={factor})",
        "keras-hub's dynamic scaling is static (no length) and its YaRN is not checked against the spec's",
    )


def causal_band(batch: int, queries: int, keys: int, start: int, window: int | None) -> np.ndarray:
    """keras-hub's decoder mask (B, Nq, Nk): ``compute_causal_mask`` (key ``j <= i + start``), and where the
    decoder applies a window (Mistral's ``i < j + sliding_window``) its band."""
    i = np.arange(queries)[:, None] + start
    j = np.arange(keys)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= i < j + window
    return np.broadcast_to(allowed, (batch, queries, keys)).astype("int32")


def enable_x64() -> None:
    import keras

    if keras.backend.backend() == "jax":
        import jax

        # The layer is built in float64; without x64 JAX silently computes it in float32 (process-global switch,
        # as keras_mha sets it). models imports only core, so this is not the backends' helper.
        jax.config.update("jax_enable_x64", True)


def keras_hub_forward(layout: str, layer, cfg: MHAConfig, x, padding, decoder_window: int | None) -> RealRun:
    """The layer's own call, ``layer(x, attention_mask=...)`` with its decoder's causal mask (and band)."""
    import keras

    if padding is not None:
        raise ValueError(f"{layout}: the keras-hub reader runs unpadded inputs; padding=None here")
    enable_x64()
    B, N, _ = x.shape
    mask = causal_band(B, N, N, 0, decoder_window)
    output = layer(keras.ops.convert_to_tensor(x.astype(layer.compute_dtype)), attention_mask=mask)
    run = RealRun(
        layout,
        "real",
        f"keras-hub {class_name(layer)} ({keras.backend.backend()} backend, its decoder's causal mask)",
        np.asarray(to_array(output), dtype=np.float64),
    )
    run.parameters = {name: tuple(v.shape) for name, v in keras_hub_variables(layer).items()}
    dtype = str(layer.compute_dtype)
    run.precision = "float32" if dtype in ("float64", "float32") else dtype  # a bfloat16 layer: its own level
    run.note = PRECISION_NOTE + (NORM_NOTE if cfg.qk_norm else "")
    return run


def keras_hub_steps(layer, x: np.ndarray, decoder_window: int | None, tuple_cache: bool) -> list[np.ndarray]:
    """The layer's output for each token of ``x (B, T, E)``, as keras-hub's ``generate`` steps it: a zero cache of
    T positions, ``layer(x_t, attention_mask=..., cache=cache, cache_update_index=t)``; T arrays (B, E)."""
    import keras

    enable_x64()
    variables = keras_hub_variables(layer)
    B, T, _ = x.shape
    _, kv_heads, head_dim = _kv_dims(variables["key/kernel"].shape, layer)
    dtype = layer.compute_dtype
    zeros = np.zeros((B, T, kv_heads, head_dim), dtype=dtype)  # (B, S, G, d)
    cache = (zeros, zeros.copy()) if tuple_cache else np.stack([zeros, zeros], axis=1)  # [B, 2, S, G, d]
    outputs = []
    for t in range(T):
        token = keras.ops.convert_to_tensor(np.ascontiguousarray(x[:, t : t + 1]).astype(dtype))  # (B, 1, E)
        mask = causal_band(B, 1, T, t, decoder_window)  # (B, 1, S): the cached keys up to t
        out, cache = layer(token, attention_mask=mask, cache=cache, cache_update_index=t)
        outputs.append(np.asarray(to_array(out), dtype=np.float64)[:, 0])  # (B, E)
    return outputs


def _kv_dims(shape, layer) -> tuple[int, int, int]:
    """(width, kv heads, head_dim) of a key kernel, (E, G, d) or Gemma's (G, E, d)."""
    a, b, d = shape
    return (b, a, d) if type(layer).__name__.startswith("CachedGemma") else (a, b, d)


def read_config(family, layer) -> MHAConfig:
    """The MHAConfig ``layer`` computes, read as ``family`` (a `keras_hub.KerasHubFamily`) says."""
    variables = keras_hub_variables(layer)
    if getattr(layer, "dropout", 0) or getattr(layer, "_dropout", 0):
        raise unexpressible(layer, "dropout > 0", "the spec has no dropout (the reader reads inference)")
    kernel = variables["query/kernel"].shape
    heads, width, head_dim = (
        (kernel[0], kernel[1], kernel[2]) if family.heads_first else (kernel[1], kernel[0], kernel[2])
    )
    kv = variables["key/kernel"].shape[0 if family.heads_first else 1]
    qkv_bias, out_bias = "query/bias" in variables, "attention_output/bias" in variables
    settings = keras_hub_rope(layer, getattr(layer, family.rope))
    if family.qk_norm:
        settings.update(qk_norm=family.qk_norm, norm_eps=float(norm_eps(layer)))
    if family.softcap and layer.logit_soft_cap is not None:
        settings["softcap"] = float(layer.logit_soft_cap)
    with unexpressible_config(layer):
        return MHAConfig(
            d_model=width,
            n_heads=heads,
            n_kv_heads=kv,
            d_k=head_dim,
            causal=True,
            bias="qkv" if qkv_bias and not out_bias else qkv_bias,
            scale=float(family.scale(layer) if family.scale else layer._inv_norm_factor),
            window=family.window(layer)[0] if family.window else None,
            sinks="sinks" in family.extras,
            **settings,
        )


def norm_eps(layer) -> float:
    eps = {
        getattr(layer, name).epsilon
        for name in ("query_norm", "key_norm", "_query_dense_layer_norm", "_key_dense_layer_norm")
        if hasattr(layer, name)
    }
    if len(eps) != 1:
        raise unexpressible(layer, f"q and k norms with eps {sorted(eps)}", "the spec has one norm_eps")
    return eps.pop()


def scalings_rule(module: str, allowed: tuple) -> Callable:
    def rule(cfg: MHAConfig) -> str | None:
        kind = None if cfg.rope_scaling is None else cfg.rope_scaling["rope_type"]
        if kind not in allowed:
            return f"MHAConfig.rope_scaling type {kind!r}: {module}'s rotary layer computes {allowed} only"
        return None

    return rule


def gemma_scale(layer) -> float:
    if layer.query_head_dim_normalize:
        return 1 / math.sqrt(layer.head_dim)
    return 1 / math.sqrt(layer.hidden_dim // layer.num_query_heads)


def gemma_scale_rule(module: str):
    def rule(cfg: MHAConfig) -> str | None:
        if not any(
            math.isclose(cfg.scale, s, rel_tol=1e-12) for s in (cfg.d_k**-0.5, (cfg.d_model // cfg.n_heads) ** -0.5)
        ):
            return f"MHAConfig.scale={cfg.scale:g}: {module} scales by head_dim**-0.5 or (hidden_dim // heads)**-0.5"
        return None

    return rule
