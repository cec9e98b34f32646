"""``hf-falcon``: Hugging Face ``FalconAttention`` (transformers/models/falcon/modeling_falcon.py).

Keys are relative to ``FalconAttention`` (``transformer.h.{i}.self_attention.`` in a
``FalconForCausalLM`` checkpoint): ``query_key_value`` and ``dense``, ``FalconLinear`` (``(out, in)``
like ``nn.Linear``), with biases when ``config.bias``. ``head_dim = hidden_size / num_attention_heads``
is derived, never configured. Falcon has **three** packings of ``query_key_value``, chosen by two
config switches, and all three are the per-group packing ``[q heads of g; k_g; v_g]`` for some G:

* ``new_decoder_architecture=True`` (Falcon-40B/180B): ``((H + 2G)*d, E)``, G = ``num_kv_heads``;
  split with ``view(B, N, G, H/G + 2, d)``: each group's query heads, then its k, then its v;
* ``multi_query=True`` (Falcon-7B, the default): ``((H + 2)*d, E)``, one kv head, split with
  ``view(B, N, H + 2, d)``: every q head, then k, then v (G = 1: also ``[Q; k; v]`` blocks);
* neither (Falcon-RW): ``(3E, E)`` per head, ``view(B, N, H, 3, d)``: ``[q_h; k_h; v_h]`` (G = H,
  GPT-NeoX's packing).

Rotary (rotate-half, every feature of a head) unless ``config.alibi``: Falcon's ALiBi divides the bias by
sqrt(d) and rounds the slopes to bfloat16, which the spec's ALiBi does not (`FALCON_ALIBI`, `LayoutError`).
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._hf import hf_config, hf_forward, hf_implementation, hf_mask, hf_rope_parameters, rotary_precision, rotary_tables
from ._layout import (
    PER_GROUP,
    Layout,
    LayoutError,
    causal_only,
    default_scale,
    fused_qkv,
    head_dim_is_width_over_heads,
    rotary_is,
    self_attention_heads,
)
from ._module_io import class_name, hf_rope, torch_reader, unexpressible
from ._packing import pack_groups, unpack_groups
from ._real import HF_REQUIRES, torch_state

MODULE = "FalconAttention"

# Why Falcon's ALiBi is not the spec's (a known difference, transformers/models/falcon/modeling_falcon.py).
FALCON_ALIBI = (
    "Falcon divides the bias by sqrt(d) with the scores, (q.k + m_h p_j) / sqrt(d) (alibi / sqrt(head_dim) in the "
    "mask; before transformers 5.25 its own eager path scaled the biased logits, attention_logits *= "
    "inv_norm_factor), and rounds the slopes to bfloat16 "
    "(slopes.bfloat16()); the spec adds m_h (p_j - p_i) to the scaled scores with float64 slopes"
)


def falcon_eager_is_shared() -> bool:
    """True where ``FalconAttention``'s eager path is the shared ``eager_attention_forward`` (transformers 5.25 on),
    whose softmax runs in float32; before, Falcon's own eager attention kept the hidden states' dtype."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    return "eager_attention_forward" in FalconAttention.forward.__code__.co_names


def falcon_takes_alibi() -> bool:
    """True where ``FalconAttention.forward`` takes ``alibi=`` (before transformers 5.25; since, ``FalconModel``
    folds ``alibi / sqrt(head_dim)`` into the additive attention mask)."""
    import inspect

    from transformers.models.falcon.modeling_falcon import FalconAttention

    return "alibi" in inspect.signature(FalconAttention.forward).parameters


def packing_switches(cfg: MHAConfig) -> dict[str, bool]:
    """The FalconConfig switches whose packing the runner builds for ``cfg``: by its kv heads, as the models do."""
    if cfg.n_kv_heads == cfg.n_heads:
        return {"new_decoder_architecture": False, "multi_query": False}  # per head (Falcon-RW)
    if cfg.n_kv_heads == 1:
        return {"new_decoder_architecture": False, "multi_query": True}  # multi-query (Falcon-7B)
    return {"new_decoder_architecture": True, "multi_query": False}  # per kv group (Falcon-40B)


def falcon_config(cfg: MHAConfig, **switches):
    """A tiny FalconConfig for ``cfg`` (``head_dim`` derived from hidden_size / heads, not passed)."""
    from transformers import FalconConfig

    return FalconConfig(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_kv_heads=cfg.n_kv_heads,
        bias=bool(cfg.bias),  # True or False: bias="qkv" is refused by the layout (Falcon biases both or neither)
        alibi=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        rope_parameters=hf_rope_parameters(cfg),
        **{**packing_switches(cfg), **switches},
    )


def _falcon(cfg, state, x, padding, options):
    from transformers.models.falcon.modeling_falcon import FalconAttention

    module = FalconAttention(hf_config(falcon_config(cfg), options), layer_idx=0).double().eval()
    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    from transformers.models.falcon.modeling_falcon import FalconRotaryEmbedding

    alibi = {"alibi": None} if falcon_takes_alibi() else {}  # no ALiBi here (rotary); the keyword went in 5.25
    with hf_implementation(module.config, options) as config:

        def forward(xt):
            cos_sin = rotary_tables(cfg, options, FalconRotaryEmbedding(config), xt)
            mask = hf_mask(config, cfg, xt, padding)
            return module(xt, attention_mask=mask, position_embeddings=cos_sin, **alibi)[0]

        packing = (
            "new_decoder_architecture" if module.new_decoder_architecture else
            "multi_query" if module.multi_query else "per head"
        )  # fmt: skip
        description = f"transformers FalconAttention, {packing} packing ({options.implementation})"
        precision = rotary_precision(options, eager_softmax_float32=falcon_eager_is_shared())
        return hf_forward("hf-falcon", module, description, x, forward, **precision)


def _config(module) -> MHAConfig:
    """The FalconAttention instance's configuration: its packing decides the kv heads; ALiBi is not in the spec."""
    config = module.config
    if config.alibi:
        raise unexpressible(module, "config.alibi=True (ALiBi position biases instead of rotary)", FALCON_ALIBI)
    heads = module.num_heads
    if module.new_decoder_architecture:
        kv_heads = module.num_kv_heads
    elif module.multi_query:
        kv_heads = 1
    else:
        kv_heads = heads
        if module.num_kv_heads != heads:
            raise LayoutError(
                f"{class_name(module)} packs per head (new_decoder_architecture=False, multi_query=False) with "
                f"num_kv_heads={module.num_kv_heads} != num_attention_heads={heads}: its own forward cannot split that"
            )
    rope = hf_rope(module, config, module.head_dim)  # Falcon's default tables rotate every feature
    return MHAConfig(
        d_model=module.hidden_size,
        n_heads=heads,
        n_kv_heads=kv_heads,
        d_k=module.head_dim,
        bias=module.query_key_value.bias is not None,
        causal=bool(module.is_causal),
        scale=module.inv_norm_factor,
        **rope.half_fields(),
    )


# All three packings are Megatron's per-group one: G = num_kv_heads, 1 (multi-query) or H (per head).
PACKING = fused_qkv("query_key_value", "dense", pack_groups, unpack_groups)

LAYOUT = Layout(
    name="hf-falcon",
    module=MODULE,
    description="Falcon: query_key_value packed per kv group [q heads of g; k_g; v_g] "
    "(new_decoder_architecture; multi_query is G = 1, the classic per-head packing G = H); dense",
    packing=PER_GROUP,
    scale="1/sqrt(d_k) (inv_norm_factor)",
    rotary="half (rotate_half), every feature of a head; none with config.alibi",
    source="transformers/models/falcon/modeling_falcon.py (FalconAttention._split_heads)",
    split="new_decoder_architecture: view(B, N, G, H/G + 2, d) -> [:, :, :, :-2], [-2], [-1]; multi_query: "
    "view(B, N, H + 2, d) -> [:-2], [-2], [-1]; otherwise view(B, N, H, 3, d) -> [..., 0, :], [1], [2]",
    rules=(
        head_dim_is_width_over_heads(MODULE),
        *self_attention_heads(MODULE),
        default_scale(MODULE),
        causal_only(MODULE),
        rotary_is(("half",), MODULE),
    ),
    **PACKING,
    notes=(
        "head_dim = hidden_size // num_attention_heads is a derived property of FalconConfig: do not pass it",
        "the runner picks the packing from the kv heads (G = H: per head, G = 1: multi_query, otherwise "
        "new_decoder_architecture); new_decoder_architecture with G = 1 or G = H stores the very same rows",
        "bias: config.bias puts a bias on both layers (off in the released models)",
        "float32 inside a float64 model: only the rotary module's angles (inv_freq in torch.float); Falcon's own "
        "eager path keeps the hidden states' dtype (softmax(..., dtype=hidden_states.dtype)), so eager with float64 "
        "(cos, sin) is float64 throughout",
        "config.alibi=True (Falcon-RW-1B) adds ALiBi, but divided by sqrt(d) with slopes rounded to bfloat16: a "
        "known difference from the spec's ALiBi; from_module raises LayoutError saying so",
    ),
    runner=_falcon,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.FalconAttention",), _config, PACKING["shapes"], _forward),
    example={"n_kv_heads": 2, "bias": False, "rope": "half", "causal": True},
    variants=("rope_scaling",),
)
