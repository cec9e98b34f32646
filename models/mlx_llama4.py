"""``mlx-llama4``: mlx-lm's Llama 4 text ``Attention`` (mlx_lm/models/llama4.py), rotary and NoPE layers.

Llama's four ``nn.Linear`` (``(out, in)``, biases with ``attention_bias``), ``reshape(B, L, H, -1)
.transpose(0, 2, 1, 3)``, grouped kv heads handed to the SDPA as they are, ``head_dim**-0.5``. What mlx-lm does
its own way, against Hugging Face's ``Llama4TextAttention`` (`hf_llama4`), read in the installed source:

* **The layer kind is the layer's index**, ``use_rope = (layer_idx + 1) % 4 != 0`` (every fourth layer is NoPE),
  where Hugging Face reads ``config.no_rope_layers``. The reader reads the instance's ``use_rope``.
* **The rotary** is ``initialize_rope(head_dim, traditional=True, scaling_config=rope_scaling)``: interleaved
  pairs as real rotations (``mx.fast.rope``), where Hugging Face multiplies complex64 numbers; Llama 4's
  checkpoints scale it with ``llama3`` (``Llama3RoPE``: read from the model args, proved on its table).
* **The QK-norm** after rotary is ``mx.fast.rms_norm(x, None, eps=1e-6)``: eps 1e-6 whatever ``rms_norm_eps``
  says (Hugging Face's ``Llama4TextL2Norm`` takes ``rms_norm_eps``). The reader reads 1e-6.
* **The temperature** (NoPE layers with ``attn_temperature_tuning``) is the same formula, ``1 + attn_scale *
  log(floor((p + 1) / floor_scale) + 1)`` on the queries, after the (absent) norm, from ``cache.offset``, with
  its factors in float32 (an int ``arange`` over an int ``floor_scale``).
* **The chunk is the model's mask**, not the layer's: ``LlamaModel`` gives every rotary layer
  ``(j // C == i // C) & (j <= i)`` with ``C = args.attention_chunk_size`` (always: mlx-lm has no unchunked
  rotary layer) and the NoPE layers the causal mask. So the reader reads ``C`` from the model args the instance
  is given (``attention.args = model.args``; the class keeps none), and the forward passes that mask, as the model.
  Decode (`decode_cache`, for `decode_steps`) steps what the model gives the layer: on a rotary layer a
  ``ChunkedKVCache(C)``, trimmed to its chunk before each step (``maybe_trim_front``), and the chunk mask over the
  keys it holds (``linds = arange(start_position, offset + 1)``); on a NoPE layer a ``KVCache`` and no mask.

mlx's exp/sin/cos are float32-accurate in float64 (`_mlx_io.FLOAT64_NOTE`): held to float32. MLX is imported
inside the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from mha_rosetta.core import MHAConfig

from ._hf_decoder import LINEARS
from ._layout import (
    SEPARATE,
    Layout,
    causal_only,
    default_scale,
    rotary_is,
    same_head_dims,
    self_attention_widths,
    separate_linears,
)
from ._mlx_build import cast_parameters, mlx_rope_arguments, tiny_model_args
from ._mlx_io import load_mlx, mlx_bias, mlx_forward, mlx_reader, mlx_rope, model_args, scaling_read
from ._module_io import unexpressible, unexpressible_config
from .hf_llama4 import llama4_kind_reason

MODULE = "mlx_lm.models.llama4.Attention"
NORM_EPS = 1e-6  # mx.fast.rms_norm(queries, weight=None, eps=1e-6) in Attention.__call__
_PACKING = separate_linears(LINEARS)


def build(cfg: MHAConfig, dtype: str = "float64"):
    """A tiny mlx-lm Llama 4 ``Attention`` for ``cfg``: layer 0 (rotary) or layer 3 (NoPE), given its model args."""
    models = importlib.import_module("mlx_lm.models.llama4")
    args = models.TextArgs(
        **tiny_model_args(cfg, layers=4),
        **mlx_rope_arguments(cfg, length=8192),  # rope_scaling, max_position_embeddings
        attention_bias=bool(cfg.bias),
        attention_chunk_size=cfg.attention_chunk_size or 8192,  # NoPE layers: the model's global mask ignores it
        head_dim=cfg.d_k,
        interleave_moe_layer_step=1,
        intermediate_size_mlp=cfg.d_model,
        model_type="llama4_text",
        num_experts_per_tok=1,
        num_local_experts=1,
        rms_norm_eps=cfg.norm_eps,
        use_qk_norm=bool(cfg.qk_norm_after_rope),
        attn_temperature_tuning=int(bool(cfg.attn_temperature_tuning)),
        floor_scale=int(cfg.floor_scale),
        attn_scale=float(cfg.attn_scale),
    )
    module = models.Attention(args, 0 if cfg.rope is not None else 3)  # (layer_idx + 1) % 4 == 0: NoPE
    module.args = args  # what a port does: the chunk (the model's mask) and a Llama3RoPE are read from them
    return cast_parameters(module, dtype)


def llama4_fields(module) -> dict[str, Any]:
    """The MHAConfig fields both mlx-lm Llama 4 attentions (``llama4``, ``llama4_text``) keep alike: the sizes, the
    biases, the scale and the layer's rotary (``use_rope``; none on a NoPE layer)."""
    rope = mlx_rope(module) if module.use_rope else None
    if rope is not None and rope["rope_dims"] != module.head_dim:
        raise unexpressible(module, f"rotary over {rope['rope_dims']} features", "Llama 4 rotates every feature")
    return dict(
        d_model=module.q_proj.weight.shape[1],
        n_heads=module.n_heads,
        n_kv_heads=module.n_kv_heads,
        d_k=module.head_dim,
        bias=mlx_bias(module),
        causal=True,
        scale=float(module.scale),
        rope=None if rope is None else rope["rope"],
        rope_base=10000.0 if rope is None else rope["rope_base"],
        rope_scaling=None if rope is None else rope["rope_scaling"],
    )


def llama4_rules(module: str) -> tuple:
    """The rules both mlx-lm Llama 4 attentions share: interleaved or no rotary, Llama's linears, causal, the scale."""
    return (
        rotary_is(("interleaved", None), module),
        same_head_dims(module),
        self_attention_widths(module),
        causal_only(module),
        default_scale(module),
    )


def read(module) -> MHAConfig:
    """The instance's layer kind (``use_rope``), rotary, QK-norm and temperature; the chunk from its model args."""
    args = model_args(module)
    if args is None:
        raise unexpressible(
            module,
            "no model args",
            "its chunk is its model's mask (LlamaModel: args.attention_chunk_size on every rotary layer): give the "
            "instance its model's (attention.args = model.args)",
        )
    fields = llama4_fields(module)
    rotary = fields["rope"] is not None
    # the temperature's registry fields (typed Any in core.config), on NoPE layers that temper
    kind: dict[str, Any] = {"attn_temperature_tuning": bool(module.attn_temperature_tuning) and not rotary}
    if kind["attn_temperature_tuning"]:
        kind.update(floor_scale=float(module.floor_scale), attn_scale=float(module.attn_scale))
    with unexpressible_config(module):
        return MHAConfig(
            **fields,
            attention_chunk_size=int(args.attention_chunk_size) if rotary else None,
            qk_norm_after_rope=bool(module.use_qk_norm),
            norm_eps=NORM_EPS,
            **kind,
        )


def chunk_mask(chunk: int, start: int, offset: int, tokens: int) -> np.ndarray:
    """LlamaModel's chunk mask (N, K) for ``tokens`` queries at positions ``offset..`` over the keys a cache holds from
    ``start`` (``linds = arange(start, offset + N)``, ``rinds = arange(offset, offset + N)``)."""
    columns = np.arange(start, offset + tokens)  # linds: the key positions, (K,)
    rows = np.arange(offset, offset + tokens)[:, None]  # rinds: the query positions, (N, 1)
    same_chunk = np.abs(columns // chunk - rows // chunk) == 0
    return same_chunk & (columns <= rows)  # (N, K)


def model_mask(module, cfg: MHAConfig, tokens: int) -> np.ndarray | None:
    """LlamaModel's mask for this layer, as it builds it: the chunked causal (N, N) on a rotary layer; None (the
    model's ``create_attention_mask``: causal) on a NoPE layer."""
    if not module.use_rope:
        return None
    return chunk_mask(cfg.attention_chunk_size, 0, 0, tokens)


def decode_cache(module):
    """``(cache, mask(cache))`` for a decode through the layer as LlamaModel steps it: a rotary layer's
    ``ChunkedKVCache(attention_chunk_size)``, trimmed before each step, with the chunk mask of one query over the keys
    it holds; a NoPE layer's ``KVCache`` and no mask."""
    import mlx.core as mx
    from mlx_lm.models.cache import ChunkedKVCache, KVCache

    if not module.use_rope:
        return KVCache(), lambda cache: None
    chunk = int(read(module).attention_chunk_size)  # read refuses an instance without its model args

    def mask(cache):
        cache.maybe_trim_front()  # what LlamaModel does to its chunked layers' caches before each call
        return mx.array(chunk_mask(chunk, cache.start_position, cache.offset, 1))  # (1, K)

    return ChunkedKVCache(chunk), mask


def _forward(module, cfg, x, padding, options):
    return mlx_forward("mlx-llama4", module, cfg, x, padding, mask=model_mask(module, cfg, np.shape(x)[1]))


def _runner(cfg, state, x, padding, options):
    return _forward(load_mlx(build(cfg), state), cfg, x, padding, options)


def _layer_kind_rule(cfg: MHAConfig) -> str | None:
    """mlx-lm's layer kinds: rotary layers chunked, the temperature on NoPE layers, its norm's eps 1e-6."""
    if cfg.rope is not None and cfg.attention_chunk_size is None:
        return (
            f"MHAConfig.attention_chunk_size=None with rope={cfg.rope!r}: mlx-lm's LlamaModel chunks every rotary layer"
        )
    if reason := llama4_kind_reason(cfg, MODULE, "mlx-lm's TextArgs"):
        return reason
    if cfg.rope is None and cfg.qk_norm_after_rope:
        return f"MHAConfig.qk_norm_after_rope=True with rope=None: {MODULE} norms its rotary layers only"
    if cfg.qk_norm_after_rope and cfg.norm_eps != NORM_EPS:
        return f"MHAConfig.norm_eps={cfg.norm_eps!r}: {MODULE}'s QK-norm uses eps 1e-6 whatever rms_norm_eps says"
    if cfg.qk_norm is not None:
        return f"MHAConfig.qk_norm={cfg.qk_norm!r}: {MODULE}'s only QK-norm is weightless, after rotary"
    return None


LAYOUT = Layout(
    name="mlx-llama4",
    module=MODULE,
    description="mlx-lm Llama 4 (text): Llama's linears; rotary layers (interleaved, chunked by the model, "
    "weightless QK-norm eps 1e-6 after rotary) and every fourth layer NoPE (causal, query temperature)",
    packing=SEPARATE,
    scale="1/sqrt(d_k) (head_dim**-0.5)",
    rotary="initialize_rope(traditional=True): interleaved pairs on rotary layers, none on NoPE layers",
    source="mlx_lm/models/llama4.py",
    split="q_proj(x).reshape(B, L, H, -1).transpose(0, 2, 1, 3); rotary, then the norm, on (B, H, L, d); k/v with "
    "G heads, grouped by the SDPA",
    rules=(
        _layer_kind_rule,
        scaling_read(MODULE),
        *llama4_rules(MODULE),
    ),
    **_PACKING,
    notes=(
        "use_rope = (layer_idx + 1) % 4 != 0, where Hugging Face reads config.no_rope_layers",
        "the QK-norm's eps is 1e-6 (mx.fast.rms_norm(..., eps=1e-6)), Hugging Face's rms_norm_eps",
        "the chunk is LlamaModel's mask on every rotary layer: read from the model args the instance is given",
    ),
    runner=_runner,
    requires=("mlx", "mlx_lm"),
    reader=mlx_reader(MODULE, read, _PACKING["shapes"], _forward),
    example={"n_kv_heads": 2, "bias": False, "rope": "interleaved", "causal": True, "attention_chunk_size": 4},
    variants=("chunked", "qk_norm_after_rope", "temperature", "rope_scaling"),
)
