"""``keras-hub-llama``, ``keras-hub-mistral``, ``keras-hub-gemma``, ``keras-hub-gemma3``, ``keras-hub-qwen2``,
``keras-hub-qwen3``, ``keras-hub-phi3``, ``keras-hub-gpt-oss``: keras-hub's attention layers
(keras_hub/src/models/<family>/<family>_attention.py), on Keras 3's JAX or torch backend.

Each family writes its own `keras.layers.Layer` with `EinsumDense` kernels that keep the head axis (see
`_keras_hub_io`), keras-hub's ``RotaryEmbedding`` (rotate-half, float32 angles), kv heads repeated with
``ops.repeat`` and a cache ``[B, 2, S, G, d]`` written at ``cache_update_index`` (Gemma 3: a ``(keys, values)``
tuple). keras-hub's "Qwen" (``keras_hub.src.models.qwen``) is Qwen 2.

Design rules:

* The reader reads the **instance**: heads, kv heads and head_dim from the kernels' shapes, the scale the layer
  applies (``_inv_norm_factor``; Gemma's ``query_head_dim_normalize``: ``head_dim**-0.5`` or
  ``(hidden_dim // heads)**-0.5``), biases from the variables, QK-norm's eps, the softcap, the sinks, the rotary
  from its rotary layer (`_keras_hub_io.keras_hub_rope`) and this layer's window where keras-hub applies one.
* The window: Gemma, Gemma 3 and Qwen 2 apply ``sliding_window_size`` inside the layer when
  ``use_sliding_window_attention``; Mistral's decoder applies its ``sliding_window`` as a band of the mask (the
  backbone gives the layer the same value, read from ``_sliding_window``). Qwen 3's ``sliding_window_size`` and
  gpt-oss's ``sliding_window`` are stored and applied nowhere in keras-hub 0.32 (neither the layer nor the decoder
  reads them, outside vLLM serving): the reader reads window=None, what they compute.
* The forward is the layer's own call with its decoder's mask (``compute_causal_mask``, Mistral's band), in the
  layer's dtype: float32's tolerance, with the cause (float32 rotary angles and softmax) in the run's note.

Keras and keras-hub are imported inside the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig

from ._hf_decoder import field_is
from ._keras_hub_io import (
    enable_x64,
    gemma_scale,
    gemma_scale_rule,
    head_kernels,
    keras_hub_forward,
    keras_hub_state,
    keras_hub_steps,
    keras_hub_variables,
    load_keras_hub,
    read_config,
    scalings_rule,
)
from ._layout import (
    SEPARATE,
    Layout,
    causal_only,
    default_scale,
    head_dim_is_width_over_heads,
    rotary_is,
    self_attention_heads,
)
from ._module_io import ModuleReader

REQUIRES = ("keras", "keras_hub")


@dataclass(frozen=True)
class KerasHubFamily:
    """One keras-hub family: its attention class, the constructor arguments it takes from an MHAConfig."""

    layout: str  # "keras-hub-llama"
    path: str  # "llama.llama_attention.LlamaAttention": keras_hub.src.models.<path>
    description: str
    args: tuple[str, ...]  # the class's constructor keywords (`ARGS`: each one's value for an MHAConfig)
    variants: tuple[str, ...] = ()
    biases: tuple = (False,)
    rope: str = "rotary_embedding_layer"  # the attribute holding the rotary layer
    heads_first: bool = False  # Gemma's kernels (H, E, d)
    extras: Mapping[str, str] = field(default_factory=dict)  # canonical -> the variable path below the layer
    offsets: Mapping[str, float] = field(default_factory=dict)
    qk_norm: str | None = None
    scalings: tuple = (None, "linear")  # the rope_scaling types its rotary layer computes
    window: Callable | None = None  # layer -> (the window it computes, whether the decoder's mask applies it)
    scale: Callable | None = None  # layer -> the scale it applies (None: _inv_norm_factor)
    softcap: bool = False
    tuple_cache: bool = False
    rules: tuple = ()  # beyond the scale and head_dim rules `keras_hub_layout` derives
    notes: tuple[str, ...] = ()
    more_args: Callable[[MHAConfig], dict] | None = None  # keywords only some configs give (Llama 3.1 scaling)

    @property
    def cls(self) -> str:
        return self.path.rsplit(".", 1)[1]

    def kwargs(self, cfg: MHAConfig) -> dict:
        """The class's constructor keywords for ``cfg``: its `args` computed by `ARGS`, then its `more_args`."""
        return {name: ARGS[name](cfg) for name in self.args} | (self.more_args(cfg) if self.more_args else {})

    def build(self, cfg: MHAConfig, dtype: str = "float64", seed: int = 0):
        """A tiny keras-hub layer of the family for ``cfg``: built for ``(None, None, d_model)``, seeded weights."""
        module, name = self.path.rsplit(".", 1)
        enable_x64()
        cls = getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)
        layer = cls(**self.kwargs(cfg), dtype=dtype)
        layer.build((None, None, cfg.d_model))
        rng = np.random.default_rng(seed)
        for path, variable in keras_hub_variables(layer).items():
            draw = rng.standard_normal(tuple(variable.shape))
            canonical = {stored: name for name, stored in self.extras.items()}.get(path)
            if canonical in ("q_norm", "k_norm"):  # near the identity: stored = 1 + noise - offset
                draw = 1.0 + 0.1 * draw - self.offsets.get(canonical, 0.0)
            elif canonical is None:
                draw = draw / math.sqrt(cfg.d_model)
            variable.assign(draw.astype(variable.dtype))
        return layer

    def decoder_window(self, layer) -> int | None:
        return self.window(layer)[0] if self.window and self.window(layer)[1] else None


def keras_hub_layout(family: KerasHubFamily) -> Layout:
    """The `Layout` (runner and `from_module` reader) of one keras-hub family.

    Two rules follow from what the family states: its scale (Gemma's ``query_head_dim_normalize`` where it has
    a `KerasHubFamily.scale`, else ``1/sqrt(head_dim)``), and, where its class takes no ``head_dim`` keyword,
    a head_dim of hidden_dim // heads."""
    module_name = f"keras_hub.src.models.{family.path}"
    package = f"keras_hub.src.models.{family.path.split('.')[0]}"
    scale_rule = gemma_scale_rule(module_name) if family.scale else default_scale(package)
    width_rules = () if "head_dim" in family.args else (head_dim_is_width_over_heads(package),)
    packing = head_kernels(family.heads_first, family.extras, family.offsets)

    def forward(layer, cfg, x, padding, options):
        return keras_hub_forward(family.layout, layer, cfg, x, padding, family.decoder_window(layer))

    def runner(cfg, state, x, padding, options):
        return forward(load_keras_hub(family.build(cfg), state), cfg, x, padding, options)

    windowed = "window" in family.variants
    return Layout(
        name=family.layout,
        module=module_name,
        description=family.description,
        packing=SEPARATE,
        scale="gemma: query_head_dim_normalize (head_dim or hidden_dim // heads)"
        if family.scale
        else "1/sqrt(head_dim)",
        rotary="keras-hub RotaryEmbedding: rotate-half over every feature of a head, float32 angles",
        source=f"keras_hub/src/models/{family.path.rsplit('.', 1)[0].replace('.', '/')}.py",
        split="EinsumDense kernels with the head axis inside; kv heads ops.repeat-ed to the query heads",
        rules=(
            *self_attention_heads(module_name),
            causal_only(module_name),
            rotary_is(("half",), module_name),
            scalings_rule(module_name, family.scalings),
            field_is(module_name, "bias", family.biases, f"is built with bias in {family.biases} only"),
            field_is(module_name, "qk_norm", (family.qk_norm,), f"has qk_norm={family.qk_norm!r}"),
            *(() if windowed else (field_is(module_name, "window", (None,), "applies no window"),)),
            scale_rule,
            *width_rules,
            *family.rules,
        ),
        **packing,
        notes=family.notes,
        runner=runner,
        requires=REQUIRES,
        reader=ModuleReader(
            classes=(f"keras_hub.{family.cls}",),
            config=lambda layer: read_config(family, layer),
            state=lambda layer, cfg: keras_hub_state(layer, packing["shapes"](cfg)),
            load=load_keras_hub,
            forward=forward,
        ),
        example={
            "n_kv_heads": 2,
            "bias": family.biases[0],
            "rope": "half",
            "causal": True,
            **({"qk_norm": family.qk_norm} if family.qk_norm else {}),
            **({"sinks": True} if "sinks" in family.extras else {}),
        },
        variants=family.variants,
    )


def decode(layer, x: np.ndarray) -> list[np.ndarray]:
    """keras-hub's cached decode of ``layer`` (`_keras_hub_io.keras_hub_steps`), its window applied as its model does."""
    family = {f.cls: f for f in FAMILIES.values()}[type(layer).__name__]  # the exact class: from_module read it
    return keras_hub_steps(layer, x, family.decoder_window(layer), family.tuple_cache)


# The constructor keywords of keras-hub's attention classes, each -> its value for an MHAConfig. A family names the
# ones its class takes (`KerasHubFamily.args`): the families differ in which keywords, not in how each is computed.
ARGS: dict[str, Callable[[MHAConfig], object]] = {
    "head_dim": lambda cfg: cfg.d_k,
    "num_query_heads": lambda cfg: cfg.n_heads,
    "num_key_value_heads": lambda cfg: cfg.n_kv_heads,
    "layer_norm_epsilon": lambda cfg: cfg.norm_eps,
    "rope_max_wavelength": lambda cfg: cfg.rope_base,
    "rope_wavelength": lambda cfg: cfg.rope_base,  # Gemma 3's spelling
    "rope_scaling_factor": lambda cfg: (cfg.rope_scaling or {}).get("factor", 1.0),
    "sliding_window": lambda cfg: cfg.window,  # Mistral: its decoder's band
    "logit_soft_cap": lambda cfg: cfg.softcap,
    "use_sliding_window_attention": lambda cfg: cfg.window is not None,
    "sliding_window_size": lambda cfg: cfg.window or 4096,
    "query_head_dim_normalize": lambda cfg: math.isclose(cfg.scale, cfg.d_k**-0.5, rel_tol=1e-12),
    "use_query_key_norm": lambda cfg: True,
}
HEADS = ("num_query_heads", "num_key_value_heads")
# Gemma's and Gemma 3's: the softcap, the in-layer window and the scale rule (`gemma_scale`).
GEMMA_ARGS: tuple[str, ...] = (
    *HEADS,
    "head_dim",
    "logit_soft_cap",
    "query_head_dim_normalize",
    "use_sliding_window_attention",
)
GEMMA_ARGS += ("sliding_window_size",)


def _llama3_args(cfg: MHAConfig) -> dict:
    """LlamaAttention's Llama 3.1 scaling keywords, given only where ``cfg`` scales its rotary."""
    scaling = cfg.rope_scaling
    if not scaling:
        return {}
    return {
        "rope_frequency_adjustment_factor": scaling["factor"],
        "rope_low_freq_factor": scaling["low_freq_factor"],
        "rope_high_freq_factor": scaling["high_freq_factor"],
        "rope_pretraining_sequence_length": scaling["original_max_position_embeddings"],
    }


def _in_layer_window(layer):
    return (layer.sliding_window_size if layer.use_sliding_window_attention else None, False)


def _qwen_window(layer):
    """Qwen 2 masks its window only on its einsum path: where keras-hub's fused attention runs (JAX and torch:
    ``fused_attention_op_available()``), ``ops.dot_product_attention`` gets the causal mask alone."""
    from keras_hub.src.utils.keras_utils import fused_attention_op_available

    return (None, False) if fused_attention_op_available() else _in_layer_window(layer)


# Gemma's and Gemma 3's classes alike beyond `GEMMA_ARGS`: kernels (H, E, d), the rotary in ``rope_layer``, the
# in-layer window, the scale rule (`gemma_scale`) and the softcap.
_gemma_family = partial(
    KerasHubFamily, rope="rope_layer", heads_first=True, window=_in_layer_window, scale=gemma_scale, softcap=True
)


LLAMA = KerasHubFamily(
    layout="keras-hub-llama",
    path="llama.llama_attention.LlamaAttention",
    description="keras-hub Llama: EinsumDense (E, H, d) kernels, no biases, LlamaRotaryEmbedding (Llama 3.1 scaling)",
    args=(*HEADS, "rope_max_wavelength"),
    more_args=_llama3_args,
    variants=("rope_scaling",),
    scalings=(None, "llama3"),
    notes=("LlamaRotaryEmbedding ignores rope_position_scaling_factor (its _get_inverse_freq does not divide by it)",),
)
MISTRAL = KerasHubFamily(
    layout="keras-hub-mistral",
    path="mistral.mistral_attention.CachedMistralAttention",
    description="keras-hub Mistral: Llama's kernels, head_dim, its decoder's band mask of sliding_window keys",
    args=(*HEADS, "head_dim", "sliding_window", "rope_max_wavelength", "rope_scaling_factor"),
    variants=("window", "rope_scaling"),
    window=lambda layer: (layer._sliding_window, True),
)
GEMMA = _gemma_family(
    layout="keras-hub-gemma",
    path="gemma.gemma_attention.CachedGemmaAttention",
    description="keras-hub Gemma (and Gemma 2): kernels (H, E, d), query_head_dim_normalize, softcap, in-layer window",
    args=GEMMA_ARGS,
    variants=("window", "softcap"),
    scalings=(None,),
    rules=(
        field_is(
            "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention",
            "rope_base",
            (10_000.0,),
            "fixes RotaryEmbedding(max_wavelength=10_000.0)",
        ),
    ),
)
GEMMA3 = _gemma_family(
    layout="keras-hub-gemma3",
    path="gemma3.gemma3_attention.CachedGemma3Attention",
    description="keras-hub Gemma 3: Gemma's kernels, query_norm/key_norm RMSNorm multiplying by 1 + scale, "
    "query_head_dim_normalize, in-layer window, a (keys, values) tuple cache",
    args=(*GEMMA_ARGS, "use_query_key_norm", "layer_norm_epsilon", "rope_wavelength", "rope_scaling_factor"),
    variants=("window", "softcap", "qk_norm_head", "rope_scaling"),
    extras={"q_norm": "query_norm/scale", "k_norm": "key_norm/scale"},
    offsets={"q_norm": 1.0, "k_norm": 1.0},
    qk_norm="head",
    tuple_cache=True,
    notes=("RMSNormalization stores scale and multiplies by 1 + scale: canonical = 1 + stored",),
)
QWEN2 = KerasHubFamily(
    layout="keras-hub-qwen2",
    path="qwen.qwen_attention.QwenAttention",
    description="keras-hub Qwen (2): biases on q, k, v (bias_axes), head_dim = hidden_dim // heads, in-layer window",
    args=(*HEADS, "rope_max_wavelength", "rope_scaling_factor"),
    variants=("qkv_bias", "rope_scaling"),
    biases=("qkv",),
    window=_qwen_window,
    notes=(
        "known difference: use_sliding_window_attention masks the window on the einsum path only; on JAX and torch "
        "keras-hub takes the fused ops.dot_product_attention, which gets the causal mask alone: read as window=None",
    ),
)
QWEN3 = KerasHubFamily(
    layout="keras-hub-qwen3",
    path="qwen3.qwen3_attention.Qwen3Attention",
    description="keras-hub Qwen 3: no biases, Qwen3LayerNorm(head_dim) of q and k before the rotary",
    args=(*HEADS, "head_dim", "layer_norm_epsilon", "rope_max_wavelength", "rope_scaling_factor"),
    variants=("qk_norm_head", "rope_scaling"),
    extras={"q_norm": "query_dense_layernorm/scale", "k_norm": "key_dense_layernorm/scale"},
    qk_norm="head",
    notes=("sliding_window_size is stored and applied nowhere (keras-hub 0.32): read as window=None",),
)
PHI3 = KerasHubFamily(
    layout="keras-hub-phi3",
    path="phi3.phi3_attention.Phi3Attention",
    description="keras-hub Phi-3: Llama's kernels (not HF's fused qkv_proj), RotaryEmbedding; su scaling refused",
    args=(*HEADS, "rope_max_wavelength"),
    scalings=(None,),
    notes=(
        "rope_scaling_type='su' builds Phi3SuScaledRotaryEmbedding: refused, not yet read. It is the spec's longrope "
        "(core.longrope: the long table when start_index + seq_len > pretraining_sequence_length, Hugging Face's rule, "
        "and the factor from max_sequence_length / pretraining_sequence_length), but no reader is proved on it here",
    ),
)
GPT_OSS = KerasHubFamily(
    layout="keras-hub-gpt-oss",
    path="gpt_oss.gpt_oss_attention.GptOssAttention",
    description="keras-hub gpt-oss: biases on all four, sinks (H,) concatenated to the logits, YaRN RotaryEmbedding",
    args=(*HEADS, "head_dim", "rope_max_wavelength"),
    variants=("sinks",),
    biases=(True,),
    extras={"sinks": "sinks"},
    scalings=(None,),
    notes=(
        "its RotaryEmbedding is YaRN; with rope_scaling_factor 1 it is the unscaled table and is read; another factor "
        "is refused",
        "sliding_window is stored and applied nowhere (keras-hub 0.32): read as window=None",
    ),
)
FAMILIES = {family.layout: family for family in (LLAMA, MISTRAL, GEMMA, GEMMA3, QWEN2, QWEN3, PHI3, GPT_OSS)}
LAYOUTS = tuple(keras_hub_layout(family) for family in FAMILIES.values())
