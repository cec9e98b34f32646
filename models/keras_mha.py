"""``keras``: Keras 3 ``keras.layers.MultiHeadAttention`` (keras/src/layers/attention/multi_head_attention.py).

Keys are the layer's variable paths relative to the layer (``query/kernel`` for
``multi_head_attention/query/kernel``). Keras keeps the head axis inside its
``EinsumDense`` kernels: ``query/kernel (E, H, key_dim)``, ``key/kernel (kdim, H, key_dim)``,
``value/kernel (vdim, H, value_dim)``, biases ``(H, head_dim)``, and
``attention_output/kernel (H, value_dim, E)`` with bias ``(E,)``. ``key_dim`` is the
size **per head** (torch's ``embed_dim`` is the total).
"""

from __future__ import annotations

import re

import numpy as np

from mha_rosetta.core import MHAConfig

from ._layout import SEPARATE, Layout, LayoutError, default_scale, dense_general, no_grouped_kv, rotary_is
from ._module_io import ModuleReader, class_name, to_array, unexpressible
from ._real import RealRun, allowed_mask

MODULE = "keras MultiHeadAttention"


def _keras(cfg, state, x, padding, options):
    import keras

    # Keras's own backend switch (models imports only core, so it cannot ask the framework layer).
    if keras.backend.backend() == "jax":
        import jax

        # The layer is built in float64; without x64 JAX silently computes it in float32 (process-global switch,
        # as the JAX backends set it). models imports only core, so this is not the backends' helper.
        jax.config.update("jax_enable_x64", True)
    layer = keras.layers.MultiHeadAttention(
        num_heads=cfg.n_heads,
        key_dim=cfg.d_k,
        value_dim=cfg.d_v,
        use_bias=cfg.bias,
        dtype="float64",
        sliding_window=cfg.window,  # |i - j| < W, the spec's two-sided window; with the causal mask, the causal one
    )
    layer.build((None, None, cfg.d_model), (None, None, cfg.vdim), (None, None, cfg.kdim))
    by_path = {variable.path.removeprefix(layer.name + "/"): variable for variable in layer.weights}
    if set(by_path) != set(state):
        raise ValueError(f"keras MultiHeadAttention holds {sorted(by_path)}, the state dict {sorted(state)}")
    for name, variable in by_path.items():
        variable.assign(state[name])
    B, N, _ = x.shape
    mask = allowed_mask(cfg, B, N, padding)[:, 0]  # (B, N, N), True = may attend: Keras's polarity
    backend = keras.backend.backend()
    run = RealRun(
        "keras",
        "real",
        f"keras.layers.MultiHeadAttention ({backend} backend)",
        np.zeros(0),
        parameters={name: tuple(variable.shape) for name, variable in by_path.items()},
    )
    try:
        run.output = np.asarray(layer(x, x, key=x, attention_mask=mask))
    except Exception as error:  # the known JAX-backend failure with value_dim != key_dim, kept visible
        run.known_difference = f"the default call fails: {type(error).__name__}: {_first_line(error)}"
        # return_attention_scores=True takes Keras's own einsum path instead of the fused dot_product_attention.
        run.output = np.asarray(layer(x, x, key=x, attention_mask=mask, return_attention_scores=True)[0])
        run.note = "output from the return_attention_scores=True path (Keras's einsum), which runs in float64"
        return run
    if backend == "jax":  # Keras's own backend switch, as in `_keras`
        run.precision = "float32"
        run.note = "on JAX the default call uses jax.nn.dot_product_attention, whose softmax always runs in float32"
    return run


def _first_line(error: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras colours its messages for terminals
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Keras wraps the backend error in "Exception encountered when calling ...": keep the backend's own line.
    inner = [line for line in lines if not line.startswith(("Exception encountered", "Arguments received", "•"))]
    return (inner or lines or [""])[0]


def _variables(layer) -> dict:
    """The layer's variables by the layout's names: the last two parts of each path (``query/kernel``)."""
    if not layer.built:
        raise LayoutError(
            f"{class_name(layer)} is not built: it holds no weights yet; call it once or layer.build(query_shape, "
            "value_shape, key_shape)"
        )
    return {"/".join(variable.path.split("/")[-2:]): variable for variable in layer.weights}


def _config(layer) -> MHAConfig:
    """The layer's configuration: its constructor arguments, and the widths its kernels were built for."""
    variables = _variables(layer)
    if getattr(layer, "_use_gate", False):
        raise unexpressible(layer, "use_gate=True", "the spec has no gate on the attention output")
    if tuple(layer._attention_axes) != (1,):
        raise unexpressible(layer, f"attention_axes={layer._attention_axes!r}", "the spec attends over tokens (axis 1)")
    width = variables["query/kernel"].shape[0]  # (E, H, key_dim)
    out_width = variables["attention_output/kernel"].shape[-1]  # (H, value_dim, out)
    if out_width != width:
        raise LayoutError(
            f"{class_name(layer)} has output_shape={layer._output_shape!r} ({out_width} features), queries of "
            f"width {width}: the spec's output has the query's width d_model"
        )
    return MHAConfig(
        d_model=width,
        n_heads=layer._num_heads,
        d_k=layer._key_dim,
        d_v=layer._value_dim or layer._key_dim,
        kdim=variables["key/kernel"].shape[0],
        vdim=variables["value/kernel"].shape[0],
        bias=layer._use_bias,
        # Keras's band |i - j| < sliding_window: the spec's window without causal (use_causal_mask is a call
        # argument, not the layer's: the layer is read as non-causal and a causal call adds the causal mask)
        window=getattr(layer, "_sliding_window", None),
    )


def _load(layer, state: dict[str, np.ndarray]):
    variables = _variables(layer)
    for name, array in state.items():
        variables[name].assign(array.astype(variables[name].dtype))
    return layer


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
        "sliding_window=W: |i - j| < W (a symmetric band), the spec's two-sided window; with use_causal_mask=True "
        "the spec's causal window of W keys",
    ),
    runner=_keras,
    requires=("keras",),
    variants=("window",),
    reader=ModuleReader(
        classes=("keras.MultiHeadAttention",),
        config=_config,
        state=lambda layer, cfg: {name: to_array(variable) for name, variable in _variables(layer).items()},
        load=_load,
    ),
)
