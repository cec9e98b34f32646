"""``mlx-llama``, ``mlx-qwen2``, ``mlx-qwen3``, ``mlx-olmo2``, ``mlx-gemma3``, ``mlx-phi3``, ``mlx-gemma2``,
``mlx-gpt-oss``, ``mlx-qwen3-next``: mlx-lm's ``Attention`` classes (gpt-oss: ``AttentionBlock``, Qwen3-Next:
``Qwen3NextAttention``) (mlx_lm/models/<family>.py). DeepSeek V3's latent attention is `mlx_deepseek`, Llama 4's
`mlx_llama4`.

mlx-lm writes each family's attention anew, every class named ``Attention``: `_module_io.class_key` keys
them by their module path (``"mlx_lm.models.qwen3.Attention"``). Mistral has no file of its own: mlx-lm
maps ``model_type "mistral"`` to ``llama`` (mlx_lm/utils.py), so a Mistral port is ``mlx-llama``. Each keeps
Llama's four ``nn.Linear`` layers with ``(out, in)`` weights (Phi-3 one fused ``qkv_proj`` ``[Q; K; V]``), ``reshape(B, L, H, -1).transpose(0, 2, 1, 3)``,
grouped kv heads handed to ``mx.fast.scaled_dot_product_attention`` as they are, and ``self.rope`` from
``initialize_rope``.

Design rules:

* The reader reads the **instance** (the class keeps no ``args``): heads from ``n_heads``/``n_kv_heads``,
  widths from the weights' shapes, ``self.scale``, a bias from the linears' parameters, QK-norm's eps, and the
  rotary from ``self.rope``: ``nn.RoPE``'s ``dims``, ``traditional`` (True: interleaved pairs, the
  convention Hugging Face's rotate-half is not), ``base`` and ``scale`` (``1/factor``: linear scaling),
  and ``DynamicNTKScalingRoPE``'s ``factor`` and ``max_position_embeddings`` (Hugging Face's dynamic NTK
  with ``L = max_position_embeddings``). ``Llama3RoPE`` and ``YarnRoPE`` keep only their frequency table
  (``_freqs``, and YaRN's ``mscale``), not the scaling config: the reader takes ``rope_theta`` and
  ``rope_scaling`` from the model args the instance keeps (``module.args``, DeepSeek V3's ``module.config``;
  a Llama port sets ``attention.args = model.args``, the ones mlx-lm's ``Model`` keeps), fills the keys
  mlx-lm defaults (llama3: low 1, high 4, L 8192; yarn: L 4096, where Hugging Face takes
  ``max_position_embeddings``), then PROVES the reading: ``1 / _freqs`` must equal the spec's
  `scaled_frequencies` to float32's relative tolerance (mlx-lm computes it in float32) and ``mscale`` the YaRN
  attention factor; otherwise refused with both numbers (YarnRoPE reads no ``attention_factor`` and always
  truncates). Without model args they are refused, naming the class. ``SuScaledRoPE`` (Phi-3's longrope) is read
  the same way, as longrope with ``short_factor = long_factor`` (it turns by the long table at every length, where
  Hugging Face's Phi-3 turns by the short one up to ``original_max_position_embeddings``: `core.longrope`) and its
  ``_scale`` as the attention factor. ``ProportionalRoPE`` is refused.
* No window is read: these classes apply the mask they are given, and the model builds the sliding one
  (``LlamaModel`` with ``layer_types``: ``create_attention_mask(h, cache, window_size=sliding_window)``);
  Mistral's ``sliding_window`` is applied only where ``layer_types`` says ``"sliding_attention"``.
* The forward is mlx-lm's own call: ``module(x, mask=create_attention_mask(x, None))``, the string
  ``"causal"`` (the boolean array for Gemma 2, whose model asks ``return_array=True``), on the CPU stream (float64 runs on the CPU only). mlx's exp/sin/cos are
  float32-accurate in float64 (measured in ``backends/frameworks/mlx.py``): a float64 run is held to
  float32's tolerance, with that cause in the run's note.

MLX is imported inside the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mha_rosetta.core import MHAConfig

from ._hf_decoder import LINEARS, LLAMA_LIKE_EXAMPLE, NORMS, field_is
from ._layout import (
    BLOCKS,
    SEPARATE,
    Layout,
    PackFunctions,
    causal_only,
    fused_qkv,
    head_dim_is_width_over_heads,
    rotary_is,
    same_head_dims,
    self_attention_widths,
    separate_linears,
)
from ._mlx_build import cast_parameters, mlx_rope_arguments, tiny_model_args
from ._mlx_io import (
    LONGROPE_SCALINGS,
    READ_SCALINGS,
    load_mlx,
    mlx_bias,
    mlx_forward,
    mlx_reader,
    mlx_rope,
    qk_norm_fields,
    scaling_read,
)
from ._module_io import unexpressible_config
from ._packing import pack_blocks, unpack_blocks
from .hf_qwen3_next import LAYOUT as HF_QWEN3_NEXT
from .hf_qwen3_next import _gated_packing  # q_proj's [q_h | gate_h] rows per head, the same in mlx-lm

MLX_REQUIRES = ("mlx", "mlx_lm")


@dataclass(frozen=True)
class MlxFamily:
    """One mlx-lm family: its file, the ModelArgs it builds from an MHAConfig, what it adds."""

    layout: str  # "mlx-qwen3"
    package: str  # "qwen3": mlx_lm.models.<package>
    description: str
    variants: tuple[str, ...]
    args: Callable[[MHAConfig], dict]  # MHAConfig -> the family's ModelArgs keywords beyond the shared ones
    biases: tuple = (True, False)  # the MHAConfig.bias values its file can build
    qk_norm: str | None = None  # "head" (Qwen3, Gemma 3) or "projection" (OLMo 2): q_norm/k_norm.weight
    offsets: Mapping[str, float] = field(default_factory=dict)  # stored = canonical - offset (Gemma's 1 + w)
    layer_idx: bool = False  # Attention(args, layer_idx) (Gemma 3); layer 0 is built
    query: str = "q_proj"  # the layer holding the queries' rows: Phi-3's fused qkv_proj [Q; K; V]
    packing: PackFunctions | None = None  # None: Llama's four linears (`separate_linears`)
    partial: bool = False  # nn.RoPE(rope_dim) over the first rope_dim features (Phi-3's partial_rotary_factor)
    # the model passes its mask as an array (create_attention_mask(..., return_array=True): Gemma 2's scores are
    # its own code, which reads mask.dtype), else the string "causal"
    array_mask: bool = False
    softcap: bool = False  # self.attn_logit_softcapping: tanh(scores / c) * c (Gemma 2)
    sinks: bool = False  # self.sinks (H,), handed to mx.fast.scaled_dot_product_attention(sinks=...) (gpt-oss)
    gate: bool = False  # o_proj(merged * sigmoid(gate)), q_proj's rows [q_h | gate_h] per head (Qwen3-Next)
    packing_name: str | None = None  # the Layout's packing word where `packing` is not Phi-3's [Q; K; V] blocks
    cls: str = "Attention"  # gpt-oss: AttentionBlock
    # the instance's attribute names of the heads, kv heads and scale (gpt-oss: num_attention_heads, sm_scale...)
    attributes: tuple[str, str, str] = ("n_heads", "n_kv_heads", "scale")
    scalings: tuple = READ_SCALINGS  # the rope_scaling types it is built and read with (Phi-3: longrope only)
    rules: tuple = ()
    notes: tuple[str, ...] = ()
    example: Mapping = field(default_factory=dict)

    def build(self, cfg: MHAConfig, dtype: str = "float64"):
        """A tiny mlx-lm ``Attention`` of the family for ``cfg`` (random weights, cast to ``dtype``)."""
        models = importlib.import_module(f"mlx_lm.models.{self.package}")
        # the keys Hugging Face's form leaves unset are None in the spec's dict; mlx-lm reads a key it finds
        rope = mlx_rope_arguments(cfg)  # rope_scaling, max_position_embeddings (and longrope's original length)
        # from_dict keeps the keys the family's ModelArgs has (mlx-lm's own loading path): Gemma 2 has no rope_scaling
        args = models.ModelArgs.from_dict(
            {"model_type": self.package, **tiny_model_args(cfg), "rms_norm_eps": cfg.norm_eps, **rope, **self.args(cfg)}
        )
        cls = getattr(models, self.cls)
        module = cls(args, 0) if self.layer_idx else cls(args)
        # The instance's rope, as the family builds it, with cfg's convention (Qwen3's file fixes traditional=False:
        # a port that writes nn.RoPE(..., traditional=True) holds the other one, and the reader reads the instance)
        rope_utils = importlib.import_module("mlx_lm.models.rope_utils")
        setattr(
            module, self.attributes[2], cfg.scale
        )  # the instance's own: mlx-lm sets head_dim**-0.5 (Gemma: query_pre_attn_scalar)
        module.rope = rope_utils.initialize_rope(
            cfg.rope_dims or cfg.d_k,
            cfg.rope_base,
            cfg.rope == "interleaved",
            rope["rope_scaling"],
            rope["max_position_embeddings"],
        )
        if getattr(module, "args", None) is None:  # what a port does: Llama3RoPE and YarnRoPE are read from them
            module.args = args
        return cast_parameters(module, dtype)


def mlx_layout(family: MlxFamily) -> Layout:
    """The `Layout` (runner and `from_module` reader) of one mlx-lm family."""
    module_name = f"mlx_lm.models.{family.package}.{family.cls}"
    heads, kv_heads, scale = family.attributes

    def read(module) -> MHAConfig:
        weight = module.o_proj.weight  # (E, H*d): nn.Linear's (out, in)
        # the settings the spec cannot hold raise LayoutError naming them, outside the MHAConfig wrapper below
        settings = {
            "bias": mlx_bias(module, family.query),
            **mlx_rope(module),
            **(qk_norm_fields(module, family.qk_norm) if family.qk_norm else {}),
            **({"softcap": float(module.attn_logit_softcapping)} if family.softcap else {}),
            **({"attn_output_gate": True} if family.gate else {}),
        }
        with unexpressible_config(module):
            return MHAConfig(
                d_model=weight.shape[0],
                n_heads=getattr(module, heads),
                n_kv_heads=getattr(module, kv_heads),
                d_k=weight.shape[1] // getattr(module, heads),
                causal=True,
                scale=float(getattr(module, scale)),
                sinks=family.sinks,
                **settings,
            )

    extras = {**(NORMS if family.qk_norm else {}), **({"sinks": "sinks"} if family.sinks else {})}
    packing = family.packing or separate_linears(LINEARS, extras, family.offsets)

    def runner(cfg, state, x, padding, options):
        module = load_mlx(family.build(cfg), state)
        return forward(module, cfg, x, padding, options)

    def forward(module, cfg, x, padding, options):
        return mlx_forward(family.layout, module, cfg, x, padding, family.array_mask)

    return Layout(
        name=family.layout,
        module=module_name,
        description=family.description,
        packing=family.packing_name or (BLOCKS if family.packing else SEPARATE),
        scale="the instance's self.scale (head_dim**-0.5 as mlx-lm builds these)",
        rotary="nn.RoPE: traditional=True interleaved pairs, False rotate-half; every feature of a head",
        source=f"mlx_lm/models/{family.package}.py",
        split=f"{family.query}(x) (split [Q; K; V] where fused).reshape(B, L, H, -1).transpose(0, 2, 1, 3); k/v the "
        "same with G heads, grouped by the SDPA",
        rules=(
            same_head_dims(module_name),
            self_attention_widths(module_name),
            causal_only(module_name),
            rotary_is(("half", "interleaved"), module_name, partial=family.partial),
            field_is(module_name, "window", (None,), "applies no window: the model's mask does (layer_types)"),
            scaling_read(module_name, family.scalings),
            field_is(module_name, "bias", family.biases, f"is built with bias in {family.biases} only"),
            field_is(module_name, "qk_norm", (family.qk_norm,), f"has qk_norm={family.qk_norm!r}"),
            *family.rules,
        ),
        **packing,
        notes=family.notes,
        runner=runner,
        requires=MLX_REQUIRES,
        reader=mlx_reader(module_name, read, packing["shapes"], forward),
        example=family.example,
        variants=family.variants,
    )


LLAMA_FAMILY = MlxFamily(
    layout="mlx-llama",
    package="llama",
    description="mlx-lm Llama (and Mistral, which mlx-lm maps to llama): four linears, nn.RoPE(traditional=...)",
    variants=("rope_scaling",),
    args=lambda cfg: {"head_dim": cfg.d_k, "attention_bias": bool(cfg.bias)},
    notes=("Mistral: mlx_lm/utils.py maps model_type 'mistral' to llama; its window is the model's mask",),
    example=LLAMA_LIKE_EXAMPLE,
)
QWEN2_FAMILY = MlxFamily(
    layout="mlx-qwen2",
    package="qwen2",
    description="mlx-lm Qwen2: biases on q, k and v only; head_dim = hidden_size // heads",
    variants=("qkv_bias", "rope_scaling"),
    args=lambda cfg: {},
    biases=("qkv",),
    rules=(head_dim_is_width_over_heads("mlx_lm.models.qwen2.Attention"),),
    example={**LLAMA_LIKE_EXAMPLE, "bias": "qkv"},
)
QWEN3_FAMILY = MlxFamily(
    layout="mlx-qwen3",
    package="qwen3",
    description="mlx-lm Qwen3: no biases, q_norm/k_norm nn.RMSNorm(head_dim) before rope, traditional=False",
    variants=("qk_norm_head", "rope_scaling"),
    args=lambda cfg: {"head_dim": cfg.d_k, "tie_word_embeddings": True},
    biases=(False,),
    qk_norm="head",
    example={**LLAMA_LIKE_EXAMPLE, "qk_norm": "head"},
)
OLMO2_FAMILY = MlxFamily(
    layout="mlx-olmo2",
    package="olmo2",
    description="mlx-lm OLMo 2: Llama's linears; q_norm/k_norm nn.RMSNorm over the whole projection (H*d,), before the split",
    variants=("qk_norm_projection", "rope_scaling"),
    args=lambda cfg: {"head_dim": cfg.d_k, "attention_bias": bool(cfg.bias)},
    qk_norm="projection",
    example={**LLAMA_LIKE_EXAMPLE, "qk_norm": "projection"},
)
GEMMA3_FAMILY = MlxFamily(
    layout="mlx-gemma3",
    package="gemma3_text",
    description="mlx-lm Gemma 3 (text): no biases; q_norm/k_norm RMSNorm(head_dim) multiplying by 1 + weight; "
    "self.scale = query_pre_attn_scalar**-0.5",
    variants=("qk_norm_head", "rope_scaling"),
    args=lambda cfg: {"head_dim": cfg.d_k, "query_pre_attn_scalar": cfg.scale**-2, "sliding_window_pattern": 1},
    biases=(False,),
    qk_norm="head",
    offsets={"q_norm": 1.0, "k_norm": 1.0},
    layer_idx=True,
    notes=(
        "a sliding layer (is_sliding) keeps no window size: Gemma3Model's mask applies args.sliding_window, so the "
        "reader reads window=None (and the layer's own rope: rope_local_base_freq on sliding layers)",
        "RMSNorm stores w and multiplies by 1 + w (mx.fast.rms_norm(x, 1.0 + weight, eps)): canonical = 1 + stored",
    ),
    example={**LLAMA_LIKE_EXAMPLE, "qk_norm": "head"},
)
PHI3_FAMILY = MlxFamily(
    layout="mlx-phi3",
    package="phi3",
    description="mlx-lm Phi-3: one qkv_proj [Q; K; V] (mx.split), no biases, nn.RoPE (SuScaledRoPE with longrope) "
    "over the first partial_rotary_factor * head_dim features; head_dim = hidden_size // heads",
    variants=("rope_scaling",),
    args=lambda cfg: {"partial_rotary_factor": (cfg.rope_dims or cfg.d_k) / cfg.d_k},
    biases=(False,),
    query="qkv_proj",
    packing=fused_qkv("qkv_proj", "o_proj", pack_blocks, unpack_blocks),
    partial=True,
    rules=(head_dim_is_width_over_heads("mlx_lm.models.phi3.Attention"),),
    scalings=LONGROPE_SCALINGS,
    notes=("longrope builds SuScaledRoPE: long_factor at every length, read as short_factor = long_factor",),
    example=LLAMA_LIKE_EXAMPLE,
)
GEMMA2_FAMILY = MlxFamily(
    layout="mlx-gemma2",
    package="gemma2",
    description="mlx-lm Gemma 2: no biases; scores written out (queries * scale @ keys), tanh softcap "
    "attn_logit_softcapping; self.scale = query_pre_attn_scalar**-0.5",
    variants=("softcap",),
    args=lambda cfg: {
        "head_dim": cfg.d_k,
        "query_pre_attn_scalar": cfg.scale**-2,
        "attn_logit_softcapping": cfg.softcap,
    },
    biases=(False,),
    array_mask=True,
    softcap=True,
    notes=(
        "Gemma2Model passes one causal mask to every layer (create_attention_mask(h, cache[0], return_array=True)): "
        "mlx-lm's Gemma 2 applies no sliding window, where Hugging Face's alternates sliding and full layers",
    ),
    example={**LLAMA_LIKE_EXAMPLE, "softcap": 50.0},
)
GPT_OSS_FAMILY = MlxFamily(
    layout="mlx-gpt-oss",
    package="gpt_oss",
    description="mlx-lm gpt-oss AttentionBlock: Llama's linears with biases, sinks (H,) in the fused SDPA's softmax",
    variants=("sinks", "rope_scaling"),
    args=lambda cfg: {"head_dim": cfg.d_k, "num_local_experts": 1, "num_experts_per_tok": 1},
    biases=(True,),
    sinks=True,
    cls="AttentionBlock",
    attributes=("num_attention_heads", "num_key_value_heads", "sm_scale"),
    notes=(
        "gpt-oss's checkpoints scale rope with YaRN (YarnRoPE), which keeps only its frequency table: read from the "
        "model args the instance is given (attention.args = model.args) and proved on that table",
        "the window is the model's mask (layer_types 'sliding_attention': create_attention_mask(..., window_size))",
    ),
    example={**LLAMA_LIKE_EXAMPLE, "bias": True, "sinks": True},
)
QWEN3_NEXT_MODULE = "mlx_lm.models.qwen3_next.Qwen3NextAttention"
QWEN3_NEXT_FAMILY = MlxFamily(
    layout="mlx-qwen3-next",
    package="qwen3_next",
    description="mlx-lm Qwen3-Next full attention: q_proj (H*2*d, E) holds [q_h | gate_h] per head, the merged heads "
    "times sigmoid(gate) before o_proj; q_norm/k_norm nn.RMSNorm(head_dim) storing 1 + w; partial rotate-half",
    variants=("qk_norm_head", "gate", "rope_scaling"),
    args=lambda cfg: {
        "head_dim": cfg.d_k,
        "partial_rotary_factor": (cfg.rope_dims or cfg.d_k) / cfg.d_k,
        "attention_bias": bool(cfg.bias),
        **dict.fromkeys(("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim"), 2),
        **dict.fromkeys(("linear_value_head_dim", "linear_conv_kernel_dim", "decoder_sparse_step"), 2),
        **dict.fromkeys(("num_experts", "num_experts_per_tok"), 1),
        **dict.fromkeys(("shared_expert_intermediate_size", "moe_intermediate_size"), cfg.d_model),
        "mlp_only_layers": [],
    },
    qk_norm="head",
    packing=_gated_packing(separate_linears(LINEARS, NORMS, {})),
    packing_name=SEPARATE,
    partial=True,
    gate=True,
    cls="Qwen3NextAttention",
    attributes=("num_attention_heads", "num_key_value_heads", "scale"),
    rules=(
        field_is(QWEN3_NEXT_MODULE, "attn_output_gate", (True,), "always gates its output (q_proj holds the gate)"),
    ),
    notes=(
        "q_proj's rows per head are [q_h | gate_h] (reshape(B, L, H, -1) then mx.split(..., 2, axis=-1)), as "
        "Hugging Face's: w_q and w_gate split per head (core.variants.split_gated_q)",
        "q_norm/k_norm are nn.RMSNorm multiplying by the stored weight: Model.sanitize adds 1 to Hugging Face's "
        "stored w (weights[k] = v + 1.0), so mlx-lm stores the canonical 1 + w where Hugging Face stores w",
        "the layer applies the mask its model gives (create_attention_mask: 'causal'); every "
        "full_attention_interval-th layer is this one, the others gated DeltaNet (not attention)",
    ),
    example=HF_QWEN3_NEXT.example,  # the same layer's: 2 kv heads, rotate-half on 2 features, QK-norm, the gate
)
FAMILIES = {
    family.layout: family
    for family in (
        LLAMA_FAMILY,
        QWEN2_FAMILY,
        QWEN3_FAMILY,
        OLMO2_FAMILY,
        GEMMA3_FAMILY,
        PHI3_FAMILY,
        GEMMA2_FAMILY,
        GPT_OSS_FAMILY,
        QWEN3_NEXT_FAMILY,
    )
}
LAYOUTS = tuple(mlx_layout(family) for family in FAMILIES.values())  # models.LAYOUTS lists them in this order
