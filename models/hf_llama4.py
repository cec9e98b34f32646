"""``hf-llama4``: Hugging Face ``Llama4TextAttention`` (transformers/models/llama4/modeling_llama4.py, 5.25).

Llama's four ``nn.Linear`` layers (biases with ``config.attention_bias``), ``view(B, N, -1, d)``, ``repeat_kv``
grouping and ``head_dim**-0.5``, and two kinds of layer, chosen by ``config.no_rope_layers[layer_idx]``:

* **rotary layers** (``no_rope_layers[i] == 1``): interleaved rotary as complex numbers (``apply_rotary_emb``:
  ``view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis``: the spec's ``rope="interleaved"``), then,
  with ``config.use_qk_norm``, a weightless RMSNorm per head (``Llama4TextWeightlessRMSNorm(rms_norm_eps)``:
  the spec's ``qk_norm_after_rope``); the model gives them the chunked causal mask
  (``create_chunked_causal_mask``, ``attention_chunk_size``: the spec's ``chunked``);
* **NoPE layers** (``no_rope_layers[i] == 0``): no rotary, no QK-norm, full causal attention and, with
  ``config.attn_temperature_tuning``, the queries times ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``
  with ``p = arange(N) + cache.get_seq_length()`` (the spec's ``temperature``).

Float32 inside a float64 module (`NOTES`): the rotary multiplies in complex64 (``x.float()``, and the rotary
module's ``freqs_cis`` is complex64), the norm runs in float32 (``x.float()``), the temperature's factors are
float32 (``positions.float()``). The eager softmax keeps the input's dtype (Llama 4's own
``eager_attention_forward``), so a NoPE layer without the temperature is float64 throughout.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants.temperature import LLAMA4_OFFSET, offset_reason

from ._hf import hf_config, hf_forward, hf_heads, hf_implementation, hf_max_positions, hf_rope_parameters
from ._hf_decoder import LINEARS, attention_bias_rule, linear_fields
from ._layout import SEPARATE, Layout, causal_only, default_scale, rotary_is, self_attention_heads, separate_linears
from ._module_io import hf_rope, torch_reader, unexpressible, unexpressible_config
from ._real import HF_REQUIRES, torch_state

MODULE = "Llama4TextAttention"
ROTARY_COMPLEX64 = "the rotary multiplies in complex64 (apply_rotary_emb: view_as_complex(x.float()) * freqs_cis)"
NORM_FLOAT32 = "the weightless QK-norm runs in float32 (Llama4TextWeightlessRMSNorm: _norm(x.float()))"
TEMPERATURE_FLOAT32 = "the temperature's factors are float32 (log1p(floor((positions.float() + 1) / floor_scale)))"


def _modeling():
    return importlib.import_module("transformers.models.llama4.modeling_llama4")


def _float32_causes(cfg: MHAConfig) -> list[str]:
    causes = [ROTARY_COMPLEX64] if cfg.rope is not None else []
    causes += [NORM_FLOAT32] if cfg.qk_norm_after_rope else []
    return causes + ([TEMPERATURE_FLOAT32] if cfg.attn_temperature_tuning else [])


def build(cfg: MHAConfig, options):
    """A tiny float64 ``Llama4TextAttention`` (layer 0, rotary or NoPE as ``cfg.rope``), not loaded."""
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(
        **hf_heads(cfg),
        num_hidden_layers=1,
        attention_dropout=0.0,
        attention_bias=bool(cfg.bias),
        rope_parameters=hf_rope_parameters(cfg),
        **hf_max_positions(cfg),
        no_rope_layers=[0 if cfg.rope is None else 1],
        use_qk_norm=cfg.qk_norm_after_rope,
        rms_norm_eps=cfg.norm_eps,
        attention_chunk_size=cfg.attention_chunk_size,
        attn_temperature_tuning=cfg.attn_temperature_tuning,
        floor_scale=int(cfg.floor_scale),  # an int field of Llama4TextConfig (_layer_kind_rule holds it whole)
        attn_scale=cfg.attn_scale,
    )
    return _modeling().Llama4TextAttention(hf_config(config, options), layer_idx=0).double().eval()


def _mask(module, config, x, padding):
    """The mask Llama4TextModel gives this layer: chunked causal on a chunked rotary layer, causal otherwise."""
    import torch
    from transformers import masking_utils as masks

    pad = None if padding is None else torch.from_numpy(padding.astype(np.int64))  # (B, N), 1 = real token
    chunked = module.use_rope and config.attention_chunk_size is not None
    build_mask = masks.create_chunked_causal_mask if chunked else masks.create_causal_mask
    tokens = x.shape[1]
    return build_mask(
        config=config, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=torch.arange(tokens)[None]
    )


def forward(module, cfg: MHAConfig, x, padding, options):
    """Run the loaded module as Llama4TextModel runs its layer 0 (its own rotary module's ``freqs_cis``)."""
    import torch

    if options.float64_rotary:
        raise ValueError(
            f"hf-llama4: {MODULE} multiplies in complex64 whatever freqs_cis it is given (xq.float()); "
            "float64_rotary would change nothing: run with its own rotary module"
        )
    if padding is not None and module.use_rope and module.config.attention_chunk_size is not None:
        raise ValueError(
            "hf-llama4: a padding mask on a chunked layer: create_chunked_causal_mask starts the chunks after any "
            "left padding (the spec's chunks are on the positions), and a right-padded query alone in its chunk has "
            "no key (the spec's zero row, the module's another): run the chunked layer without padding"
        )
    with hf_implementation(module.config, options) as config:
        rotary = _modeling().Llama4TextRotaryEmbedding(config)

        def run(xt):
            freqs_cis = rotary(xt, torch.arange(xt.shape[1])[None])  # (1, N, d/2) complex64
            return module(xt, position_embeddings=freqs_cis, attention_mask=_mask(module, config, xt, padding))[0]

        kind = "rotary, chunked" if cfg.attention_chunk_size is not None else ("rotary" if cfg.rope else "NoPE")
        causes = _float32_causes(cfg)
        precision = {"precision": "float32", "note": "; ".join(causes)} if causes else {}
        return hf_forward(
            LAYOUT.name, module, f"transformers {MODULE} ({options.implementation}, {kind})", x, run, **precision
        )


def runner(cfg, state, x, padding, options):
    module = build(cfg, options)
    module.load_state_dict(torch_state(state), strict=True)
    return forward(module, cfg, x, padding, options)


def read(module) -> MHAConfig:
    """The instance's configuration: its layer kind (``use_rope``), norm, chunk and temperature."""
    config = module.config
    rope = hf_rope(module, config, module.head_dim) if module.use_rope else None
    if rope is not None and rope.rope_dims != module.head_dim:
        raise unexpressible(module, f"rotary over {rope.rope_dims} features", "Llama 4 rotates every feature")
    norm = getattr(module, "qk_norm", None)
    tempered = bool(module.attn_temperature_tuning) and not module.use_rope
    temperature: dict[str, Any] = (  # registry fields: typed Any (core.config)
        {"floor_scale": float(module.floor_scale), "attn_scale": float(module.attn_scale)} if tempered else {}
    )
    with unexpressible_config(module):
        return MHAConfig(
            **linear_fields(module),
            rope=None if rope is None else "interleaved",
            rope_base=10000.0 if rope is None else rope.rope_base,
            rope_scaling=None if rope is None else rope.rope_scaling,
            attention_chunk_size=config.attention_chunk_size if module.use_rope else None,
            qk_norm_after_rope=norm is not None,
            norm_eps=1e-6 if norm is None else float(norm.variance_epsilon),
            attn_temperature_tuning=tempered,
            **temperature,
        )


def llama4_kind_reason(cfg: MHAConfig, module: str, args: str) -> str | None:
    """What every Llama 4 attention class (Hugging Face's, mlx-lm's `mlx_llama4`) computes by layer kind: the chunk
    on rotary layers only, the temperature on NoPE layers only, ``floor_scale`` an int of its ``args`` class, Llama
    4's floor offset."""
    if cfg.rope is None and cfg.attention_chunk_size is not None:
        return f"MHAConfig.attention_chunk_size={cfg.attention_chunk_size} with rope=None: {module}'s NoPE layers attend fully"
    if cfg.rope is not None and cfg.attn_temperature_tuning:
        return f"MHAConfig.attn_temperature_tuning=True with rope={cfg.rope!r}: {module} tempers its NoPE layers only"
    if not float(cfg.floor_scale).is_integer():
        return f"MHAConfig.floor_scale={cfg.floor_scale:g}: {args}.floor_scale is an int"
    return offset_reason(cfg, module, LLAMA4_OFFSET)  # Llama 4 floors (p + 1) / floor_scale


def _layer_kind_rule(cfg: MHAConfig) -> str | None:
    """Llama 4's layer kinds (`llama4_kind_reason`): a chunk and the norm on rotary layers only, no weighted QK-norm."""
    if reason := llama4_kind_reason(cfg, MODULE, "Llama4TextConfig"):
        return reason
    if cfg.qk_norm is not None:
        return f"MHAConfig.qk_norm={cfg.qk_norm!r}: {MODULE}'s only QK-norm is weightless, after rotary (qk_norm_after_rope)"
    return None


NOTES = (
    "no_rope_layers[i] == 1 means the layer uses rotary (and gets the chunked mask and the QK-norm); 0 a NoPE layer "
    "(full causal, the temperature): from_module reads the instance's use_rope",
    "interleaved rotary as complex numbers: pairs (2i, 2i+1), the spec's rope='interleaved'",
    "the temperature is computed inside the forward from the cache's length, not from position_ids: a decode step's "
    "positions include the cache offset",
    "float32 inside a float64 model: " + "; ".join((ROTARY_COMPLEX64, NORM_FLOAT32, TEMPERATURE_FLOAT32)) + ": held "
    "to float32 with the cause named; a NoPE layer without the temperature is float64 throughout (its eager softmax "
    "keeps the input's dtype)",
    "the chunks of create_chunked_causal_mask start after any left padding; the spec's are on the positions",
)

_PACKING = separate_linears(LINEARS)

LAYOUT = Layout(
    name="hf-llama4",
    module=MODULE,
    description="Llama 4 (text): Llama's linears; rotary layers (interleaved, chunked, weightless QK-norm after "
    "rotary) and NoPE layers (full causal, query temperature)",
    packing=SEPARATE,
    scale="1/sqrt(d_k) (head_dim**-0.5)",
    rotary="interleaved (complex pairs) on rotary layers, none on NoPE layers",
    source="transformers/models/llama4/modeling_llama4.py",
    split="q_proj(x).view(B, N, -1, d); rotary and norm on (B, N, H, d); transpose(1, 2); repeat_kv for the groups",
    rules=(
        *self_attention_heads(MODULE),
        causal_only(MODULE),
        default_scale(MODULE),
        rotary_is(("interleaved", None), MODULE),
        _layer_kind_rule,
        attention_bias_rule(MODULE),
    ),
    **_PACKING,
    notes=NOTES,
    runner=runner,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader((f"transformers.{MODULE}",), read, _PACKING["shapes"], forward),
    example={"n_kv_heads": 2, "bias": False, "rope": "interleaved", "causal": True, "attention_chunk_size": 4},
    variants=("chunked", "qk_norm_after_rope", "temperature", "rope_scaling"),
)

__all__ = ["LAYOUT", "MODULE", "build", "read"]
