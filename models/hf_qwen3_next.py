"""``hf-qwen3-next``: Hugging Face ``Qwen3NextAttention`` (transformers/models/qwen3_next/modeling_qwen3_next.py).

Qwen3-Next's (and Qwen 3.5's) full-attention layer, every 4th of the model. Llama's four linears (`_hf_decoder`),
with what this family changes, read from transformers 5.25's source:

* ``q_proj`` is ``(H*2*d, E)``: each head's ``2*d`` rows are ``[q_h | gate_h]``
  (``q_proj(x).view(..., H, 2*d).chunk(2, -1)``), so the spec's ``w_q`` and ``w_gate`` are its rows split
  **per head** (`core.variants.split_gated_q`; ``fuse_gated_q`` writes them back). Reading the gate as the
  second half of the whole projection is the bug on record (vllm #36242, Megatron-Bridge #1694);
* the output gate: ``o_proj(merged * sigmoid(gate))`` (``attn_output_gate``);
* QK-norm over each head, ``Qwen3NextRMSNorm(head_dim)`` before rotary, whose stored ``weight`` is
  zero-initialised and multiplies as ``1 + weight``, in float32 (``x.float()``, ``1.0 + weight.float()``):
  the canonical ``q_norm`` is ``1 + stored``;
* partial rotate-half rotary: the first ``int(head_dim * partial_rotary_factor)`` features (default 0.25),
  frequencies ``base ** (-2i / rope_dims)``;
* GQA (``repeat_kv``), ``config.attention_bias`` on all four linears or none, no sliding window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.variants import fuse_gated_q, split_gated_q

from ._hf import hf_names, hf_rope_parameters
from ._hf_decoder import (
    LINEARS,
    LLAMA_LIKE_EXAMPLE,
    NORMS,
    Decoder,
    attention_bias_rule,
    decoder_layout,
    field_is,
    norm_eps,
)
from ._layout import causal_only, default_scale, rotary_is, self_attention_heads, separate_linears
from ._module_io import hf_rope, torch_reader

MODULE = "Qwen3NextAttention"

NORM_FLOAT32 = "Qwen3NextRMSNorm computes in float32 (x.float(), 1.0 + weight.float()) on every path"
FUSED_Q = "q_proj.weight"


def _read_extra(module) -> dict:
    rope = hf_rope(module, module.config, module.head_dim, partial=True)  # int(head_dim * partial_rotary_factor)
    return {"qk_norm": "head", "norm_eps": norm_eps(module), "rope_dims": rope.rope_dims, "attn_output_gate": True}


def _config_kwargs(cfg: MHAConfig) -> dict:
    # rope_parameters again, now with partial_rotary_factor (the family's rotary honours it); the one layer is this
    # attention (the default pattern makes layer 0 gated DeltaNet, whose DynamicCache layer holds no keys)
    return {
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": hf_rope_parameters(cfg, partial=True),
        "layer_types": ["full_attention"],
    }


def _gated_packing(inner):
    """`separate_linears`' packing with ``q_proj`` holding ``w_q`` and ``w_gate`` interleaved per head (and
    ``b_q``/``b_gate`` likewise): the other tensors are the inner packing's, for ``cfg`` without the gate."""

    def plain(cfg: MHAConfig) -> MHAConfig:
        ungate: dict[str, Any] = {"attn_output_gate": False}  # a registry field: typed Any (core.config)
        return dataclasses.replace(cfg, **ungate)

    def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
        out = inner["shapes"](plain(cfg))
        for name, shape in list(out.items()):
            if name.startswith("q_proj."):
                out[name] = (2 * shape[0], *shape[1:])  # (H*2*d, ...): [q_h | gate_h] for each head
        return out

    def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
        ungated: dict[str, Any] = {n: a for n, a in params.as_dict().items() if n not in ("w_gate", "b_gate")}
        state = inner["pack"](plain(cfg), MHAParams(**ungated))
        for stored, q, gate in ((FUSED_Q, params.w_q, params.w_gate), ("q_proj.bias", params.b_q, params.b_gate)):
            if q is not None:
                if gate is None:  # validate_params holds b_gate exactly where b_q is, w_gate always
                    raise ValueError(f"{stored}: the gate's half is missing (params.w_gate/b_gate is None)")
                state[stored] = fuse_gated_q(q, gate, cfg.n_heads, cfg.d_k)  # (H*2*d, ...), a copy
        return state

    def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
        split = dict(state)
        gates = {}
        for stored, gate in ((FUSED_Q, "w_gate"), ("q_proj.bias", "b_gate")):
            if stored in state:  # head h's rows h*2d .. h*2d+d are its query, the next d its gate
                split[stored], gates[gate] = split_gated_q(np.asarray(state[stored]), cfg.n_heads, cfg.d_k)
        ungated = inner["unpack"](plain(cfg), split)
        return MHAParams(**{**ungated.as_dict(), **gates})

    return {"shapes": shapes, "pack": pack, "unpack": unpack}


_DECODER = Decoder(
    **hf_names(MODULE),
    description="Qwen3-Next / Qwen 3.5: q_proj (H*2*d, E) holds [q_h | gate_h] per head; the merged heads times "
    "sigmoid(gate) before o_proj; q_norm/k_norm RMSNorm (d,) stored as w for 1 + w; partial rotate-half rotary",
    variants=("qk_norm_head", "gate"),
    config_kwargs=_config_kwargs,
    read_extra=_read_extra,
    extras=NORMS,
    offsets={"q_norm": 1.0, "k_norm": 1.0},
    float32=(NORM_FLOAT32,),
    attention_bias=True,
    sliding_window=False,
    rules=(
        field_is(MODULE, "qk_norm", ("head",), "normalises each head's q and k (Qwen3NextRMSNorm(head_dim))"),
        field_is(MODULE, "attn_output_gate", (True,), "always gates its output (q_proj holds the gate)"),
    ),
    notes=(
        "q_proj's rows per head are [q_h | gate_h] (view(..., H, 2*d).chunk(2, -1)): w_q and w_gate are split per "
        "head (core.variants.split_gated_q), never as the projection's two halves (vllm #36242)",
        "q_norm.weight stores w and the norm multiplies by 1 + w: canonical q_norm = 1 + stored",
        "rope_dims = int(d_k * partial_rotary_factor) (config.rope_parameters; 0.25 by default): rotate-half on "
        "those first features, frequencies base**(-2i/rope_dims)",
        "float32 inside a float64 model on every path: " + NORM_FLOAT32 + " (plus eager's softmax and the rotary "
        "angles): held to float32; with the norm patched to keep float64, SDPA with float64 tables agrees in "
        "float64 (tests/test_from_module_qwen3_next.py)",
    ),
    example={**LLAMA_LIKE_EXAMPLE, "rope_dims": 2, "qk_norm": "head", "attn_output_gate": True},
)


def _layout():
    base = decoder_layout(_DECODER)
    packing = _gated_packing(separate_linears(LINEARS, NORMS, _DECODER.offsets))
    # decoder_layout's rules, but the rotary one: Llama's rotates every feature, this family's only rope_dims of them.
    rules = (
        *self_attention_heads(MODULE),
        causal_only(MODULE),
        default_scale(MODULE),
        rotary_is(("half",), MODULE, partial=True),
        *_DECODER.rules,
        attention_bias_rule(MODULE),
    )
    assert base.reader is not None
    reader = torch_reader(base.reader.classes, base.reader.config, packing["shapes"], base.reader.forward)
    return dataclasses.replace(
        base,
        rules=rules,
        rotary="half (rotate_half) on the first partial_rotary_factor * d_k features of each head",
        split="q_proj(x).view(B, N, -1, 2*d).chunk(2, -1): [q | gate] per head; k/v view(B, N, -1, d); repeat_kv",
        reader=reader,
        **packing,
    )


LAYOUT = _layout()
