"""The Hugging Face decoder attentions built like Llama's, and what each 2024-26 family changes in them.

Llama itself (`hf_llama`), and Qwen2, Mistral, Qwen3, OLMo 2, Gemma 2, Gemma 3 and gpt-oss, which all keep
Llama's four ``nn.Linear`` layers (``q_proj (H*d, E)``, ``k_proj``/``v_proj (G*d, E)``, ``o_proj (E, H*d)``),
Llama's ``view(B, N, -1, d)`` head split, its rotate-half rotary and its ``repeat_kv`` grouping. `decoder_layout`
builds one family's `Layout` from a `Decoder`: what it adds (QK-norm weights, sinks), which variants it has, how
its config is written from an `MHAConfig` (the runner) and read back from a module instance (`from_module`).

Design rules:

* The reader reads the **instance**: its own ``scaling`` (Gemma's ``query_pre_attn_scalar**-0.5``), its own
  ``sliding_window`` attribute (None on a full-attention layer of ``config.layer_types``), ``is_causal``,
  which layers carry a bias, the eps of its norms, and the rotary of its layer type from
  ``config.rope_parameters`` (`_module_io.hf_rope`). A family that applies no window (Llama:
  ``Decoder.sliding_window=False``) refuses a config whose ``sliding_window`` was set by hand, which its
  code ignores, rather than read a window the module does not apply.
* Where Hugging Face computes in float32 inside a float64 model on every path (the QK-norm's RMSNorm),
  `Decoder.float32` names it for `RealRun.note`, next to the causes `_hf.rotary_precision` names (the
  rotary module's angles, eager's float32 softmax); those runs are held to the float32 tolerance. The
  tests prove float64 where a path keeps it (SDPA with float64 (cos, sin); gpt-oss's eager softmax), and
  each layout's notes say where none does, and why.
* A model that refuses SDPA (``_supports_sdpa = False``: Gemma 2's softcap, gpt-oss's sinks) is refused
  SDPA by the runner too: ``sdpa_attention_forward`` would raise on the softcap and silently ignore the
  sinks (``s_aux``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mha_rosetta.core import MHAConfig

from ._errors import LayoutError
from ._hf import (
    hf_config,
    hf_forward,
    hf_heads,
    hf_implementation,
    hf_mask,
    hf_max_positions,
    hf_rope_parameters,
    rotary_precision,
    rotary_tables,
)
from ._layout import (
    SEPARATE,
    Layout,
    causal_only,
    default_scale,
    rotary_is,
    self_attention_heads,
    separate_linears,
)
from ._module_io import (
    class_name,
    hf_attention_fields,
    hf_rope,
    hf_window,
    torch_reader,
    unexpressible,
    unexpressible_config,
)
from ._real import HF_REQUIRES, torch_state

LINEARS = {"w_q": "q_proj", "w_k": "k_proj", "w_v": "v_proj", "w_o": "o_proj"}
NORMS = {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}  # Qwen3, OLMo 2, Gemma 3: RMSNorm(...).weight
# The `Layout.example` fields most Llama-like families share (2 kv heads, no biases, rotate-half, causal); a family's
# example adds its own to them.
LLAMA_LIKE_EXAMPLE = {"n_kv_heads": 2, "bias": False, "rope": "half", "causal": True}


@dataclass(frozen=True)
class Decoder:
    """One Llama-like family: its names, what it adds, and where it computes in float32."""

    layout: str  # "hf-qwen2"
    module: str  # "Qwen2Attention"
    package: str  # "qwen2": transformers.models.<package>.modeling_<package>
    config_class: str  # "Qwen2Config"
    rotary_class: str  # "Qwen2RotaryEmbedding"
    description: str
    variants: tuple[str, ...]  # the `core.config.VARIANTS` the module has
    # MHAConfig -> the family's config keyword arguments beyond the shared ones (its bias switch, window...)
    config_kwargs: Callable[[MHAConfig], dict]
    # the module instance -> the MHAConfig fields only this family has (softcap, qk_norm...), or LayoutError
    read_extra: Callable[[Any], dict] = lambda module: {}
    extras: Mapping[str, str] = field(default_factory=dict)  # variant parameter -> stored name
    offsets: Mapping[str, float] = field(default_factory=dict)  # stored = canonical - offset (Gemma's 1 + w)
    float32: tuple[str, ...] = ()  # what computes in float32 inside a float64 module on every path
    eager_softmax_float32: bool = True  # the eager attention's softmax is float32 (softmax(..., dtype=torch.float32))
    layer_typed_rotary: bool = False  # the rotary module's forward takes layer_type (Gemma 3)
    repeated_tables: bool = True  # the rotary tables hold each angle twice (1, N, d); gpt-oss's once (1, N, d/2)
    custom_scale: bool = False  # the scale is config.query_pre_attn_scalar**-0.5 (Gemma), else head_dim**-0.5
    # False where the model refuses SDPA (_supports_sdpa = False: Gemma 2's softcap, gpt-oss's sinks), whose
    # sdpa_attention_forward would drop the variant (sinks) or raise (softcap): the runner refuses it too
    sdpa: bool = True
    # config.attention_bias puts a bias on all four linears or none (Llama, Qwen3, OLMo 2, Gemma, gpt-oss): the
    # runner sets it from cfg.bias and a rule (after the family's own) refuses bias="qkv". False where the family's
    # source fixes its biases (Qwen2's q/k/v only, Mistral's none): its own rules say which.
    attention_bias: bool = False
    # False where the module applies no window and its model ignores config.sliding_window (Llama): no "window"
    # variant, and the reader refuses a config that sets one by hand
    sliding_window: bool = True
    # True: a decoder layer only (the causal_only rule; the reader refuses is_causal=False). False (Llama): the
    # runner also runs it two-sided, with the model's bidirectional mask (`_hf.hf_mask`), and the reader reads
    # causal from the instance's is_causal
    causal_only: bool = True
    rules: tuple = ()  # the family's own rules (its fixed biases, its QK-norm)
    notes: tuple[str, ...] = ()
    example: Mapping = field(default_factory=dict)

    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.package}.modeling_{self.package}")

    def build(self, cfg: MHAConfig, options):
        """A tiny float64 module of the family for ``cfg`` (layer 0, of ``cfg``'s layer type), not loaded.

        The layout's runner loads it; `backends.oracles.hf_cache` builds its Llama and Mistral modules here too.
        transformers' config validation raises ValueError (or its StrictDataclassError) for a ``cfg`` it refuses.
        """
        config_kwargs = {
            **hf_heads(cfg),
            "attention_dropout": 0.0,
            "num_hidden_layers": 1,
            "rope_parameters": hf_rope_parameters(cfg),
            **hf_max_positions(cfg),
            **({"attention_bias": bool(cfg.bias)} if self.attention_bias else {}),
            **self.config_kwargs(cfg),
        }
        transformers = importlib.import_module("transformers")
        config = hf_config(getattr(transformers, self.config_class)(**config_kwargs), options)
        module = getattr(self.modeling(), self.module)(config, layer_idx=0).double().eval()
        # The instance's is_causal, as transformers' bidirectional models set it: with no mask at all (two-sided,
        # no padding) SDPA falls back to it, and LlamaAttention's class default True made that run causal.
        module.is_causal = bool(cfg.causal)
        return module

    def rotary(self, config):
        """The family's rotary module for ``config`` (its forward computes the angles in float32)."""
        return getattr(self.modeling(), self.rotary_class)(config)


def layer_type(cfg: MHAConfig) -> str:
    """The ``config.layer_types`` entry of a layer with ``cfg``'s window."""
    return "full_attention" if cfg.window is None else "sliding_attention"


def hf_bias(module, q_proj, o_proj) -> bool | str:
    """MHAConfig.bias of a module from which of its layers carry a bias (True, False or "qkv")."""
    qkv, out = q_proj.bias is not None, o_proj.bias is not None
    if out and not qkv:
        raise unexpressible(module, "a bias on o_proj only", "the spec biases q, k, v and the output, or q, k, v only")
    return "qkv" if qkv and not out else qkv


def linear_fields(module) -> dict:
    """The `MHAConfig` fields of a Llama-like instance's four linears: widths, heads, bias, causal and scale."""
    config = module.config
    fields = hf_attention_fields(module, module.q_proj, config.num_attention_heads, module.head_dim)
    return fields | dict(n_kv_heads=config.num_key_value_heads, bias=hf_bias(module, module.q_proj, module.o_proj))


def norm_eps(module) -> float:
    """The eps of the module's q_norm (its k_norm must share it: the spec has one norm_eps)."""
    # Qwen3RMSNorm / Olmo2RMSNorm keep variance_epsilon, Gemma3RMSNorm eps
    eps = [getattr(norm, "variance_epsilon", None) or norm.eps for norm in (module.q_norm, module.k_norm)]
    if eps[0] != eps[1]:
        raise unexpressible(module, f"q_norm eps {eps[0]} and k_norm eps {eps[1]}", "the spec has one norm_eps")
    return float(eps[0])


def decoder_layout(family: Decoder) -> Layout:
    """The `Layout` (with its runner and `from_module` reader) of one Llama-like family."""
    module_name = family.module

    def runner(cfg, state, x, padding, options):
        module = family.build(cfg, options)
        module.load_state_dict(torch_state(state), strict=True)
        return forward(module, cfg, x, padding, options)

    def forward(module, cfg, x, padding, options):
        if options.implementation == "sdpa" and not family.sdpa:
            raise ValueError(
                f"{family.layout}: {module_name}'s model has _supports_sdpa = False (SDPA cannot hold its "
                f"{', '.join(v for v in family.variants if v in ('softcap', 'sinks'))}); use implementation='eager'"
            )
        with hf_implementation(module.config, options) as config:
            rotary_kwargs = {"layer_type": module.layer_type} if family.layer_typed_rotary else {}
            rotary = family.rotary(config).to(module.q_proj.weight.dtype)

            def run(xt):
                cos_sin = rotary_tables(cfg, options, rotary, xt, family.repeated_tables, **rotary_kwargs)
                return module(xt, position_embeddings=cos_sin, attention_mask=hf_mask(config, cfg, xt, padding))[0]

            kind = "" if cfg.window is None else f", sliding window {cfg.window}"
            description = f"transformers {module_name} ({options.implementation}{kind})"
            precision = rotary_precision(options, family.eager_softmax_float32)
            if family.float32:
                causes = [precision.get("note", ""), *family.float32]
                precision = {"precision": "float32", "note": "; ".join(filter(None, causes))}
            return hf_forward(family.layout, module, description, x, run, **precision)

    def read(module) -> MHAConfig:
        config = module.config
        if getattr(module, "layer_type", None) not in (None, "full_attention", "sliding_attention"):
            raise unexpressible(module, f"layer_type={module.layer_type!r}", "the spec has full and sliding layers")
        rope = hf_rope(module, config, module.head_dim, layer_type=getattr(module, "layer_type", None))
        if family.causal_only and not module.is_causal:  # Gemma's use_bidirectional_attention (EmbeddingGemma)
            raise LayoutError(
                f"{class_name(module)} has is_causal=False (config.use_bidirectional_attention): layout "
                f"{family.layout!r} reads decoder layers only; the model's own mask then differs by layer type "
                "(Gemma 3: |p_i - p_j| < sliding_window on sliding layers, after its config halves the window), "
                "which this reader does not build"
            )
        window = hf_window(module, config) if family.sliding_window else None
        if not family.sliding_window and getattr(config, "sliding_window", None):
            model = module_name.removesuffix("Attention") + "Model"  # transformers' names: LlamaAttention, LlamaModel
            raise LayoutError(
                f"{class_name(module)}'s config has sliding_window={config.sliding_window!r}, which {module_name} "
                f"and {model} ignore (no window is applied): remove it, or build the family that applies it "
                "(MistralAttention: hf-mistral)"
            )
        with unexpressible_config(module):
            return MHAConfig(
                **linear_fields(module),
                **rope.half_fields(),
                window=window,
                **family.read_extra(module),
            )

    packing = separate_linears(LINEARS, family.extras, family.offsets)
    return Layout(
        name=family.layout,
        module=module_name,
        description=family.description,
        packing=SEPARATE,
        scale="query_pre_attn_scalar**-0.5 (config)" if family.custom_scale else "1/sqrt(d_k) (head_dim**-0.5)",
        rotary="half (rotate_half), every feature of a head",
        source=f"transformers/models/{family.package}/modeling_{family.package}.py",
        split="q_proj(x).view(B, N, -1, d).transpose(1, 2); k/v the same with G heads; repeat_kv for the groups",
        rules=(
            *self_attention_heads(module_name),
            *((causal_only(module_name),) if family.causal_only else ()),
            integer_pre_attn_scalar(module_name) if family.custom_scale else default_scale(module_name),
            rotary_is(("half",), module_name),
            *family.rules,
            *((attention_bias_rule(module_name),) if family.attention_bias else ()),
        ),
        **packing,
        notes=family.notes,
        runner=runner,
        requires=HF_REQUIRES,
        hf_options=True,
        reader=torch_reader((f"transformers.{module_name}",), read, packing["shapes"], forward),
        example=family.example,
        variants=family.variants,
    )


def field_is(module: str, name: str, allowed: tuple, why: str):
    """A rule: ``MHAConfig.<name>`` is one of ``allowed`` (the module's fixed choice, ``why``)."""

    def rule(cfg: MHAConfig) -> str | None:
        value = getattr(cfg, name)
        if value not in allowed:
            return f"MHAConfig.{name}={value!r}: {module} {why}"
        return None

    return rule


def attention_bias_rule(module: str):
    """``Decoder.attention_bias``'s rule: one config switch biases all four linears or none."""
    return field_is(module, "bias", (True, False), "biases all four linears or none (config.attention_bias)")


def integer_pre_attn_scalar(module: str):
    """Gemma's scale is ``query_pre_attn_scalar ** -0.5`` with an int ``query_pre_attn_scalar`` (its config's type)."""

    def rule(cfg: MHAConfig) -> str | None:
        scalar = cfg.scale**-2
        if abs(scalar - round(scalar)) > 1e-9 * scalar:
            return (
                f"MHAConfig.scale={cfg.scale:g}: {module} scales by query_pre_attn_scalar**-0.5 with an int "
                f"query_pre_attn_scalar, and scale**-2 = {scalar:g} is not one"
            )
        return None

    return rule


def pre_attn_scalar(cfg: MHAConfig) -> int:
    """The int ``query_pre_attn_scalar`` whose ``**-0.5`` is ``cfg.scale`` (`integer_pre_attn_scalar` holds)."""
    return round(cfg.scale**-2)


def sliding_config(cfg: MHAConfig) -> dict:
    """The config keywords of one layer of ``cfg``'s type: ``layer_types`` and ``sliding_window``."""
    return {"layer_types": [layer_type(cfg)], "sliding_window": cfg.window}


__all__ = [
    "Decoder",
    "class_name",
    "decoder_layout",
    "field_is",
    "hf_bias",
    "layer_type",
    "linear_fields",
    "norm_eps",
    "pre_attn_scalar",
    "sliding_config",
]
