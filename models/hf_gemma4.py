"""``hf-gemma4``: Hugging Face ``Gemma4TextAttention`` (transformers/models/gemma4/modeling_gemma4.py, 5.25).

Gemma 3's attention (`hf_gemma3`) changed in four places, each a field of the spec:

* the scale is 1 (``self.scaling = 1.0``): ``MHAConfig.scale=1.0``, nothing new;
* q_norm and k_norm are ``Gemma4RMSNorm(head_dim)`` whose ``weight`` is a plain multiplier (initialised to
  ones), not Gemma 3's ``1 + w``: stored as the canonical ``q_norm``/``k_norm``, with no offset;
* ``v_norm = Gemma4RMSNorm(head_dim, with_scale=False)`` on the split values: ``value_norm=True``
  (`core.variants.value_norm`); it stores nothing;
* a global layer (``layer_types[i] == "full_attention"``) has its own head size (``global_head_dim``), its own
  proportional rotary (``rope_parameters["full_attention"]``: ``rope_type="proportional"``, a quarter of the
  pairs turning, base 1e6) and, with ``attention_k_eq_v``, no ``v_proj`` and its own kv-head count
  (``num_global_key_value_heads``): ``attention_k_eq_v=True`` (`core.variants.k_eq_v`), whose ``w_v`` is
  ``k_proj.weight`` (read once, tied; `to_module` writes only ``k_proj``).

The module's forward needs ``shared_kv_states`` (a dict the model threads through its layers for KV sharing):
the runner passes an empty one. A layer that reuses another's keys and values (``num_kv_shared_layers``) has
no ``k_proj``: the reader refuses it (its K and V are not its own). The reader reads the instance: its
``head_dim``, its ``k_proj`` width (so the kv-head count of its own layer type), ``use_alternative_attention``,
``sliding_window`` and ``is_causal``, the eps of its three norms (one ``norm_eps``; they must agree), and the
rotary of its layer type.

Float32 inside a float64 module: ``Gemma4RMSNorm`` runs ``hidden_states.float()`` (q, k and v norms) on every
path, so a run is held to float32 with that cause named; the tests prove float64 with the norms patched to keep
their dtype, the rotary tables the spec's, and SDPA.
"""

from __future__ import annotations

import importlib

from mha_rosetta.core import MHAConfig, MHAParams

from ._errors import LayoutError
from ._hf import (
    hf_config,
    hf_forward,
    hf_heads,
    hf_implementation,
    hf_mask,
    hf_rope_parameters,
    rotary_precision,
    rotary_tables,
)
from ._hf_decoder import (
    LINEARS,
    LLAMA_LIKE_EXAMPLE,
    NORMS,
    attention_bias_rule,
    field_is,
    hf_bias,
    layer_type,
    norm_eps,
)
from ._layout import (
    SEPARATE,
    Layout,
    causal_only,
    rotary_is,
    self_attention_heads,
    separate_linears,
    unit_scale,
)
from ._module_io import class_name, hf_rope, hf_window, torch_reader, unexpressible, unexpressible_config
from ._real import HF_REQUIRES, torch_state

MODULE = "Gemma4TextAttention"
NORM_FLOAT32 = "Gemma4RMSNorm computes in float32 (hidden_states.float(), weight.float()): q_norm, k_norm and v_norm"
_TIED = ("v_proj.weight", "v_proj.bias")  # absent with attention_k_eq_v: V is k_proj's output


def _modeling():
    return importlib.import_module("transformers.models.gemma4.modeling_gemma4")


def build(cfg: MHAConfig, options):
    """A tiny float64 ``Gemma4TextAttention`` of ``cfg``'s layer type (layer 0), not loaded.

    A sliding layer is layer 0 of two (``Gemma4TextConfig`` forces the last layer to full attention); a global
    layer is the only layer, with ``global_head_dim = d_k`` and, with k_eq_v, ``num_global_key_value_heads``.
    """
    transformers = importlib.import_module("transformers")
    kind = layer_type(cfg)
    types = ["sliding_attention", "full_attention"] if kind == "sliding_attention" else ["full_attention"]
    rope = hf_rope_parameters(cfg)
    if rope["rope_type"] == "proportional" and rope.get("factor") == 1.0:
        del rope["factor"]  # transformers' default, and a key its validation of "proportional" does not list
    config = transformers.Gemma4TextConfig(
        **hf_heads(cfg),
        global_head_dim=cfg.d_k,
        num_global_key_value_heads=cfg.n_kv_heads,
        attention_k_eq_v=bool(cfg.attention_k_eq_v),
        num_hidden_layers=len(types),
        layer_types=types,
        sliding_window=cfg.window if cfg.window is not None else 4096,  # unused by a full-attention layer
        rms_norm_eps=cfg.norm_eps,
        attention_bias=bool(cfg.bias),
        attention_dropout=0.0,
        rope_parameters={"sliding_attention": rope, "full_attention": rope},  # this layer's type is the one read
        vocab_size=32,
        vocab_size_per_layer_input=32,
        intermediate_size=2 * cfg.d_model,
    )
    config = hf_config(config, options)
    return _modeling().Gemma4TextAttention(config, layer_idx=0).double().eval()


def runner(cfg, state, x, padding, options):
    module = build(cfg, options)
    module.load_state_dict(torch_state(state), strict=True)
    return forward(module, cfg, x, padding, options)


def forward(module, cfg, x, padding, options):
    with hf_implementation(module.config, options) as config:
        rotary = _modeling().Gemma4TextRotaryEmbedding(config).to(module.q_proj.weight.dtype)

        def run(xt):
            cos_sin = rotary_tables(cfg, options, rotary, xt, layer_type=module.layer_type)
            mask = hf_mask(config, cfg, xt, padding)
            return module(xt, position_embeddings=cos_sin, attention_mask=mask, shared_kv_states={})[0]

        kind = "global" if cfg.window is None else f"sliding window {cfg.window}"
        precision = rotary_precision(options)
        causes = [precision.get("note", ""), NORM_FLOAT32]
        return hf_forward(
            "hf-gemma4",
            module,
            f"transformers {MODULE} ({options.implementation}, {kind})",
            x,
            run,
            precision="float32",
            note="; ".join(filter(None, causes)),
        )


def read(module) -> MHAConfig:
    config = module.config
    if module.layer_type not in ("full_attention", "sliding_attention"):
        raise unexpressible(module, f"layer_type={module.layer_type!r}", "the spec has full and sliding layers")
    if module.is_kv_shared_layer:
        raise LayoutError(
            f"{class_name(module)} (layer {module.layer_idx}) reuses another layer's keys and values "
            "(config.num_kv_shared_layers: shared_kv_states): it has no k_proj of its own, so no attention layer "
            "of the spec holds it alone; read the layer that stores them"
        )
    if not module.is_causal:
        raise LayoutError(
            f"{class_name(module)} has is_causal=False (config.use_bidirectional_attention='all'): layout "
            "'hf-gemma4' reads decoder layers only"
        )
    if module.v_norm.with_scale:
        raise unexpressible(module, "a v_norm with a weight", "Gemma 4's value norm has none (value_norm)")
    eps = norm_eps(module)
    if module.v_norm.variance_epsilon != eps:
        raise unexpressible(
            module, f"v_norm eps {module.v_norm.variance_epsilon} and q/k_norm eps {eps}", "the spec has one norm_eps"
        )
    head_dim = module.head_dim
    rope = hf_rope(module, config, head_dim, layer_type=module.layer_type)
    with unexpressible_config(module):
        return MHAConfig(
            d_model=module.q_proj.in_features,
            n_heads=config.num_attention_heads,
            n_kv_heads=module.k_proj.out_features // head_dim,  # this layer type's (global: its own with k_eq_v)
            d_k=head_dim,
            bias=hf_bias(module, module.q_proj, module.o_proj),
            causal=True,
            scale=module.scaling,
            **rope.half_fields(),
            window=hf_window(module, config),
            qk_norm="head",
            norm_eps=eps,
            value_norm=True,
            attention_k_eq_v=bool(module.use_alternative_attention),
        )


_SEPARATE = separate_linears(LINEARS, NORMS)  # q_norm/k_norm stored as they multiply: no offset


def _shapes(cfg: MHAConfig) -> dict:
    shapes = _SEPARATE["shapes"](cfg)
    return {k: v for k, v in shapes.items() if not (cfg.attention_k_eq_v and k in _TIED)}


def _pack(cfg: MHAConfig, params: MHAParams) -> dict:
    return {k: v for k, v in _SEPARATE["pack"](cfg, params).items() if not (cfg.attention_k_eq_v and k in _TIED)}


def _unpack(cfg: MHAConfig, state: dict) -> MHAParams:
    if cfg.attention_k_eq_v:  # V is k_proj's output: w_v (b_v) tied to w_k (b_k), one stored weight
        state = dict(
            state, **{v: state[k] for v, k in zip(_TIED, ("k_proj.weight", "k_proj.bias"), strict=True) if k in state}
        )
    return _SEPARATE["unpack"](cfg, state)


def _k_eq_v_on_global_layers(cfg: MHAConfig) -> str | None:
    if cfg.attention_k_eq_v and cfg.window is not None:
        return f"MHAConfig.attention_k_eq_v=True with window={cfg.window}: {MODULE} ties V to K on global layers only"
    return None


LAYOUT = Layout(
    name="hf-gemma4",
    module=MODULE,
    description="Gemma 4: Llama's linears; q_norm/k_norm plain multipliers, weightless v_norm; scale 1; global "
    "layers with their own head size, proportional rotary and (attention_k_eq_v) V = k_proj's output",
    packing=SEPARATE,
    scale="1 (self.scaling = 1.0; the q/k norms set the logits' size)",
    rotary="half (rotate_half) over every feature; global layers proportional (a quarter of the pairs turn)",
    source="transformers/models/gemma4/modeling_gemma4.py",
    split="q_proj(x).view(B, N, -1, d); q_norm, rotary, transpose(1, 2); k likewise; v = v_proj(x) or k_proj(x)",
    rules=(
        *self_attention_heads(MODULE),
        causal_only(MODULE),
        unit_scale(MODULE),
        rotary_is(("half",), MODULE),
        field_is(MODULE, "qk_norm", ("head",), "normalises each head's q and k (Gemma4RMSNorm(head_dim))"),
        field_is(MODULE, "value_norm", (True,), "normalises each head's values (v_norm, no weight)"),
        _k_eq_v_on_global_layers,
        attention_bias_rule(MODULE),
    ),
    shapes=_shapes,
    pack=_pack,
    unpack=_unpack,
    notes=(
        "q_norm.weight and k_norm.weight multiply as stored (Gemma4RMSNorm, initialised to ones): not Gemma 3's 1 + w",
        "v_norm has no weight (with_scale=False): nothing stored; the cache holds the normed values",
        "attention_k_eq_v: a global layer has no v_proj; V is k_proj's raw output (before k_norm and rotary): "
        "params.w_v is k_proj.weight (tied), and to_module writes k_proj only",
        "global layers: head_dim = global_head_dim, num_key_value_heads = num_global_key_value_heads (with "
        "k_eq_v), rope_parameters['full_attention'] proportional: the first int(0.25 * d/2) pairs (i, i + d/2) "
        "turn at base**(-2i/d), the rest stand still",
        "forward needs shared_kv_states (the runner passes {}); a layer reusing another's K/V is refused",
        "float32 inside a float64 model on every path: " + NORM_FLOAT32 + "; held to float32, proved in float64 "
        "with the norms patched to keep float64",
    ),
    runner=runner,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader((f"transformers.{MODULE}",), read, _shapes, forward),
    # A global layer without k_eq_v: the explainer's numbered parameters give w_v numbers of its own, which a
    # tied w_v cannot hold (k_eq_v's state is this one less v_proj; tests/test_gemma4.py shows it).
    example={
        **LLAMA_LIKE_EXAMPLE,
        "scale": 1.0,
        "qk_norm": "head",
        "value_norm": True,
        "rope_base": 1_000_000.0,
        "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    },
    variants=("qk_norm_head", "window", "rope_scaling", "value_norm", "k_eq_v"),
)
